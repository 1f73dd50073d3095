"""One commit per operation, on the client: a Hub source's revision resolved once, before anything else."""

from __future__ import annotations

from dataclasses import replace

from layerwise_cli.checkpoint.delta.hub_run import hub_step_commit, is_hub_step
from layerwise_cli.checkpoint.hub.pin import HubPin, is_commit
from layerwise_cli.checkpoint.sources import looks_like_repo_id, open_checkpoint, pin_source
from layerwise_cli.checkpoint.store.objects import display_url, is_store_url
from layerwise_cli.errors import LayerwiseError
from layerwise_cli.worker.rpc import ReloadOptions


def pin_reload(source: str, options: ReloadOptions) -> tuple[ReloadOptions, HubPin | None]:
    """OPTIONS with a Hub SOURCE's revision replaced by its commit, and the pin; a local path as it is.

    A URL SOURCE (`s3://...`) gets its objects' pin (`store.headers.store_pin`) as revision, and no `HubPin`.

    Called where an operation starts (the `reload` command before its engine starts or before any server is
    pre-flighted, `reload_servers`, the Python API's `reload`): every later step (each rank, each server's
    pre-flight, the reload, `--verify`, the rollback, a fleet going back) reads the commit `options.revision`
    then names, and a ref moved meanwhile changes nothing. A revision that already is a commit is used as it is,
    with no request (a caller that pinned it, or a user who gave one).

    Raises:
        LayerwiseError: one line naming the repo and revision (or commit): not found, vanished, unreachable.
    """
    if is_store_url(source):
        # A URL source: every object pinned to the ETag read now (`etags:...`); a later step that finds another
        # refuses, naming the source.
        return replace(options, revision=store_revision(source, options.revision)), None
    if is_hub_step(source):
        # A step folder of a Hub run: the branch resolved to its commit, which pins the whole chain.
        return replace(options, revision=hub_step_commit(source, options.revision)), None
    if not looks_like_repo_id(source):
        return options, None
    if is_commit(options.revision):
        assert options.revision is not None
        return options, HubPin(source, options.revision)
    pin = pin_source(source, options.revision)
    assert pin is not None
    return replace(options, revision=pin.commit), pin


def store_revision(url: str, revision: str | None) -> str:
    """The pin of the step at URL: its objects' (`store_headers.store_pin`), or a delta step's whole chain's
    (`delta.remote.store_step_pin`: headers only, nothing fetched); REVISION, when given, must equal it."""
    from layerwise_cli.checkpoint.delta.remote import store_step_pin  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs
    from layerwise_cli.checkpoint.delta.source import MAX_CHAIN  # noqa: PLC0415 - `--help` stays fast: loaded when the command runs

    pin = store_step_pin(url, MAX_CHAIN)
    if pin is None:
        return open_checkpoint(url, revision).revision
    if revision is not None and pin != revision:
        raise LayerwiseError(f"the chain's objects changed since this operation pinned them ({revision}, now {pin})",
                             where=display_url(url))
    return pin


def pin_engine_args(model: str, args: list[str]) -> list[str]:
    """vLLM server ARGS for serving MODEL, with a Hub repo id's revision resolved to its commit.

    An engine started on a Hub repo id records what it holds as the repo and its revision: a branch there
    would send a later rollback to whatever the branch names by then. The revision given (`--revision`, default
    the default branch) is resolved once, here, and vLLM is handed the commit, for the weights and (unless
    `--tokenizer-revision` is given) the tokenizer. A local MODEL, or a revision that is a commit, is left as is.
    """
    if not looks_like_repo_id(model):
        return list(args)
    given, rest = _take_option(list(args), "--revision")
    if is_commit(given):
        return list(args)
    pin = pin_source(model, given)
    assert pin is not None
    out = [*rest, "--revision", pin.commit]
    if not any(arg == "--tokenizer-revision" or arg.startswith("--tokenizer-revision=") for arg in rest):
        out += ["--tokenizer-revision", pin.commit]
    return out


def pin_engine_revision(model: str, extra: dict) -> dict:
    """`vllm.LLM` keyword arguments EXTRA for MODEL with a Hub repo id's `revision` resolved to its commit."""
    if not looks_like_repo_id(model) or is_commit(extra.get("revision")):
        return dict(extra)
    pin = pin_source(model, extra.get("revision"))
    assert pin is not None
    return {**extra, "revision": pin.commit, "tokenizer_revision": extra.get("tokenizer_revision") or pin.commit}


def _take_option(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """(the value of FLAG in ARGS, given as `FLAG VALUE` or `FLAG=VALUE`; ARGS without it)."""
    value, rest, i = None, [], 0
    while i < len(args):
        if args[i] == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if args[i].startswith(flag + "="):
            value = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return value, rest
