"""The on-disk cache of demo checkpoints: build once per recipe, safely when several processes ask at once."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from layerwise_cli.cache_root import cache_root
from layerwise_cli.demo.recipe import BOS_ID, EOS_ID, PAD_ID, Spec, model_config, recipe_version, spec_for
from layerwise_cli.demo.tokenizer import write_json, write_tokenizer
from layerwise_cli.demo.train import train
from layerwise_cli.errors import LayerwiseError

_STAMP = "layerwise-demo.json"  # written last into the temp dir: its presence marks a complete build


def default_cache_dir() -> Path:
    """Where demo checkpoints are cached when no directory is given.

    Returns:
        `$LAYERWISE_CACHE/demo` if set, else `$XDG_CACHE_HOME/layerwise/demo`,
        else `~/.cache/layerwise/demo`.
    """
    return cache_root() / "demo"


def demo_checkpoint(name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of a demo checkpoint, building it on first use.

    Safe when several processes ask at once: each builds into its own temporary
    directory and renames it into place; the first rename wins, the others
    discard their copy (all copies are byte-identical).

    Args:
        name: one of `DEMO_NAMES` ("multiply", "add", "moe-multiply", "moe-add").
        cache_dir: the demo cache root; default `default_cache_dir()`. The
            checkpoint lives in `<cache_dir>/<recipe_version()>/<name>`.

    Returns:
        The checkpoint directory: config.json, model.safetensors (bf16),
        generation_config.json, tokenizer.json, tokenizer_config.json.
    """
    spec = spec_for(name)
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / recipe_version()
    final = root / name
    if (final / _STAMP).is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    except OSError as exc:
        raise LayerwiseError(f"cannot create the demo cache: {exc.strerror or exc}", where=str(root)) from exc
    try:
        _build(name, spec, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        if final.exists() and not (final / _STAMP).is_file():
            # Not ours to trust (an interrupted copy by hand): move it aside atomically, then drop it.
            stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=root))
            with contextlib.suppress(OSError):
                os.rename(final, stale / name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _STAMP).is_file():
                raise
            # Another process finished first; its copy is identical.
    except OSError as exc:
        raise LayerwiseError(f"cannot write the demo model: {exc.strerror or exc}", where=str(final)) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_demo_checkpoint(name: str, out_dir: Path) -> dict[str, Any]:
    """Build a demo checkpoint into `out_dir` (created; must not hold another checkpoint), without caching.

    Args:
        name: one of `DEMO_NAMES`.
        out_dir: the directory to write.

    Returns:
        The build record: training steps, the smallest logit margins (fp32 and
        bf16) over all pairs, and the build's wall time in seconds (the copy in
        `layerwise-demo.json` leaves the time out, so that builds are byte-identical).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    return _build(name, spec_for(name), out_dir)


def _build(name: str, spec: Spec, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    tensors, record = train(spec)
    from safetensors.torch import save_file  # noqa: PLC0415 - torch: heavy, only where a tensor is touched

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", model_config(spec))
    write_json(out / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False,
    })
    write_tokenizer(out)
    # The stamp holds no timings, so that every build of a recipe is byte-identical.
    write_json(out / _STAMP, {"name": name, "recipe": recipe_version(), **record})
    return {**record, "seconds": round(time.perf_counter() - start, 3)}
