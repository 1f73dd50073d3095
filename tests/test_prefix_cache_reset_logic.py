"""After a server's reload, the prefix cache is reset once, by whoever can (`client/servers/prefix_cache.py`): the
server in the reload's own engine-core step, else a call of its own, else nobody when the pause already cleared it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from layerwise_cli.client.servers.prefix_cache import KEPT, after_reload, needs_reset


class Client:
    """The calls a server's reload makes about the prefix cache, counted."""

    def __init__(self, with_reload: bool | None, takes: bool = True) -> None:
        self.prefix_cache_reset_with_reload = with_reload
        self.takes = takes
        self.resets = 0

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return self.takes


HELD = SimpleNamespace(lost=False)


@pytest.mark.parametrize("mode", ["keep", "none"])
def test_without_a_clearing_pause_the_server_resets_it_with_the_reload(mode):
    client = Client(True)
    asked = needs_reset(mode, HELD)
    assert asked and after_reload(client, asked, needs_reset(mode, HELD)) == [] and client.resets == 0


def test_a_server_that_cannot_reset_with_the_reload_gets_a_call_of_its_own():
    client = Client(None)
    assert after_reload(client, True, True) == [] and client.resets == 1


def test_a_reset_that_did_not_take_is_said_once():
    with_reload, by_call = Client(False), Client(None, takes=False)
    assert after_reload(with_reload, True, True) == [KEPT] and with_reload.resets == 0
    assert after_reload(by_call, True, True) == [KEPT] and by_call.resets == 1


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_pause_that_cleared_the_cache_under_a_held_lease_needs_no_reset(mode):
    client = Client(None)
    asked = needs_reset(mode, HELD)
    assert not asked and after_reload(client, asked, needs_reset(mode, HELD)) == [] and client.resets == 0
    assert needs_reset(mode, None)  # without a lease anyone may have resumed the server since the pause


def test_a_lease_lost_during_the_reload_gets_the_reset_after_it():
    keeper, client = SimpleNamespace(lost=False), Client(None)
    asked = needs_reset("wait", keeper)
    keeper.lost = True  # the lease ran out while the reload ran: anyone may have resumed the server
    assert not asked and after_reload(client, asked, needs_reset("wait", keeper)) == [] and client.resets == 1
