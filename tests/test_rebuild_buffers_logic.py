"""`RebuildBuffers`: a buffer is handed out again only once nothing refers to it (views and tensors made from it
included), idle buffers are bounded, and a delta's rebuild through the pool gives the same bytes."""

from __future__ import annotations

import numpy as np
import torch

from layerwise_cli import save_checkpoint
from layerwise_cli.checkpoint.delta.buffers import RebuildBuffers
from layerwise_cli.checkpoint.delta.rebuild import rebuilt_bytes
from layerwise_cli.checkpoint.delta.source import open_step
from tests.support.deltas import changed_copy, small_state_dict, stored_bytes


def test_a_buffer_in_use_through_a_tensor_of_a_view_is_never_handed_out_again():
    pool = RebuildBuffers()
    first = pool.take(64)
    # What vLLM holds: a torch tensor made from a view of a view of the buffer.
    held = torch.from_numpy(first.view(np.uint16)[1:].view(np.uint8)).view(torch.int16)
    del first
    second = pool.take(64)
    assert pool.allocated == 2 and pool.reused == 0
    held[0] = 7  # still its own memory: writing it cannot reach SECOND
    second[:] = 0
    assert int(held[0]) == 7
    del held
    third = pool.take(64)
    assert pool.reused == 1 and pool.allocated == 2
    assert third is not second


def test_only_a_buffer_of_the_exact_size_is_reused():
    pool = RebuildBuffers()
    pool.take(64)  # dropped at once: free
    bigger = pool.take(128)
    assert pool.allocated == 2 and pool.reused == 0 and bigger.size == 128
    again = pool.take(64)
    assert pool.reused == 1 and again.size == 64


def test_idle_buffers_beyond_the_limit_are_let_go_and_close_lets_go_of_all():
    pool = RebuildBuffers(idle_bytes=100)
    for size in (40, 50, 60):
        pool.take(size)  # each dropped at once
    pool.take(70)
    kept = sorted(buffer.size for buffer in pool._buffers)
    assert kept == [40, 50, 70], kept  # 60 would take the idle bytes past 100
    in_use = pool.take(40)
    pool.close()
    assert pool._buffers == [] and in_use.size == 40


def test_a_chain_rebuilt_through_one_pool_equals_one_rebuilt_without(tmp_path):
    steps = [small_state_dict(torch.bfloat16)]
    for seed in (1, 2, 3):
        steps.append({name: changed_copy(t, 0.05, seed) for name, t in steps[-1].items()})
    save_checkpoint(steps[0].items(), tmp_path / "s0")
    for i in (1, 2, 3):
        saved = save_checkpoint(steps[i].items(), tmp_path / f"s{i}", base=tmp_path / f"s{i - 1}")
        assert saved.delta is not None
    step = open_step(str(tmp_path / "s3"))
    assert len(step.delta.links) == 3
    base = stored_bytes(tmp_path / "s0")
    plain = {entry.name: rebuilt_bytes(step.delta, entry, base[entry.name], "x") for entry in step.tensors}
    pool = RebuildBuffers()
    for _ in range(2):  # the second round reuses the first round's buffers
        held = {entry.name: rebuilt_bytes(step.delta, entry, base[entry.name], "x", pool) for entry in step.tensors}
        # Every result still held is intact once all were taken: none was handed out twice.
        assert all(np.array_equal(held[name], plain[name]) for name in plain)
        del held
    assert pool.reused > 0
