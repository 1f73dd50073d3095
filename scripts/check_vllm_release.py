"""Check vLLM's newest release against what layerwise uses of it, from the wheel's source (no install, no GPU).

1. Symbols: every entry of `layerwise_cli.vllm_compat.PRIVATE` (module, class,
   function, module attribute; a class's members; a function's parameters) is
   looked up in the release's `.py` files, parsed with `ast` (nothing of the
   release is imported; re-exports are followed), in its module or one it
   moved to (`moved_to`); one added in a later release (`since`) may be absent
   from an older one.
2. Copied rules: every `vllm_compat.COPIED_RULES` entry (the read order, the
   vocabulary padding, the completion rule) is compared definition by
   definition (source without docstrings) with the installed vLLM, the one the
   engine tests run on; a definition that differs passes only with a review of
   exactly its text (`vllm_compat.REVIEWED_CHANGES`); a constant is compared
   with layerwise's copy of it.
3. Command flags: every `vllm_compat.COMMAND_FLAGS` entry (the flags
   `layerwise serve --nnodes ...` passes) is declared with `add_argument` in
   one of its modules.
4. Hooks: in a release that reruns module hooks after a reload (0.34's
   `finalize_model_weights`), each hook reviewed as safe to rerun on a layer
   not re-sent (`vllm_compat.IDEMPOTENT_HOOKS`) must have the reviewed text.
5. The architecture table: `scripts/gen_arch_table.py` regenerates the table
   from the release's source, and it must equal the committed table of that
   version (`layerwise_cli/planning/architectures-release.json`), entry by
   entry: a new release fails until its table is generated and committed.
6. `layerwise[gpu]` resolves (`pip install --dry-run --ignore-installed
   --report`, for the wheel's platform and Python 3.12: layerwise's own
   dependencies plus the `gpu` extra, read from pyproject.toml), and the release
   is inside the extra's range. A release whose own pins do not resolve from
   the index is reported, and `layerwise[gpu]` resolved unpinned instead.

Prints one table row per check and exits 1 on any difference (a check that
could not run is a difference).

Usage:
    python scripts/check_vllm_release.py                    # newest release, downloaded to a temp dir
    python scripts/check_vllm_release.py --version 0.34.0 --download-dir DIR   # DIR caches the wheel
    python scripts/check_vllm_release.py --wheel PATH       # a wheel (.whl) or an unpacked source tree
"""


from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:  # run as a script it is there already; a test loads this file by its path
    sys.path.insert(1, str(HERE))

from release_checks import (  # noqa: E402 - after the checkout and this folder are on the path
    Row,
    check_architectures,
    check_flag,
    check_hooks,
    check_rule,
    check_symbol,
)
from release_source import Source, _definitions, definition_digest, method_node  # noqa: E402, F401 - tests read them here

from layerwise_cli import vllm_compat  # noqa: E402

# A GPU user's machine: x86-64 Linux up to glibc 2.39 (Ubuntu 24.04), Python 3.12. pip matches `--platform`
# tags exactly, so every manylinux level is listed (llguidance 1.7 ships manylinux_2_17 wheels only, vLLM _2_28).
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)), "manylinux2014_x86_64", "linux_x86_64")
PYTHON = "3.12"


def gpu_requirements() -> tuple[list[str], list[str]]:
    """(layerwise's own dependencies, the `gpu` extra), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return list(project["dependencies"]), list(project["optional-dependencies"]["gpu"])


def _pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def check_resolution(version: str, work: Path) -> list[Row]:
    """`pip install --dry-run` of layerwise[gpu]'s requirements for a GPU machine; the release within the extra.

    When `vllm==VERSION` does not resolve with layerwise's requirements, vLLM is resolved alone: if it does not
    resolve either, the release itself cannot be installed from the index (one of its own pins is missing), which
    no change to layerwise mends; then what a user gets is checked instead: `layerwise[gpu]` without a pin must
    resolve, and the row names the vllm it picks.
    """
    base, extra = gpu_requirements()
    rows = []
    vllm_pins = [Requirement(r) for r in extra if Requirement(r).name == "vllm"]
    inside = bool(vllm_pins) and all(r.specifier.contains(version, prereleases=True) for r in vllm_pins)
    rows.append(Row("gpu extra", "vllm range", inside, f"{', '.join(map(str, vllm_pins)) or 'no vllm'} "
                    f"{'includes' if inside else 'excludes'} {version}"))
    pinned = _resolve([*base, *extra, f"vllm=={version}"], work / "pinned.json")
    if pinned.installed is not None:
        rows.append(Row("gpu extra", "pip resolution", pinned.installed.get("vllm") == version, pinned.summary()))
        return rows
    alone = _resolve([f"vllm=={version}"], work / "alone.json")
    if alone.installed is not None:
        rows.append(Row("gpu extra", "pip resolution", False, f"vllm {version} resolves alone but not with "
                        f"layerwise's requirements: {pinned.error}"))
        return rows
    unpinned = _resolve([*base, *extra], work / "unpinned.json")
    if unpinned.installed is None:
        rows.append(Row("gpu extra", "pip resolution", False, f"layerwise[gpu] does not resolve: {unpinned.error}"))
        return rows
    rows.append(Row("gpu extra", "pip resolution", True, f"vllm {version} itself does not resolve from the index "
                    f"({alone.error[-160:]}); layerwise[gpu] resolves to vllm {unpinned.installed.get('vllm')}: "
                    f"{unpinned.summary()}"))
    return rows


@dataclass(frozen=True)
class Resolution:
    """One `pip install --dry-run --report`: the packages it would install (None: it failed, see `error`)."""

    installed: dict[str, str] | None
    error: str
    seconds: float

    def summary(self) -> str:
        shown = ", ".join(f"{name} {self.installed.get(name, '?')}"
                          for name in ("vllm", "torch", "transformers", "huggingface-hub"))
        return f"{len(self.installed)} packages in {self.seconds:.0f} s: {shown}"


def _resolve(requirements: list[str], report: Path) -> Resolution:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
               str(report), *_pip_platform_args(), *requirements]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    took = time.perf_counter() - started
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if "WARNING: Location" not in line]
        return Resolution(None, f"pip exit {done.returncode}: {' '.join(' '.join(lines).split())[-400:]}", took)
    installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    return Resolution(installed, "", took)


def newest_version() -> str:
    """The newest `vllm` on the package index, as pip sees it."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True,
                          text=True, check=False, timeout=120)
    match = re.search(r"^vllm \(([^)]+)\)", done.stdout, re.MULTILINE)
    if not match:
        raise SystemExit(f"could not ask the index for vllm's versions: {' '.join(done.stderr.split())[-300:]}")
    return match.group(1)


def download_wheel(version: str, directory: Path) -> Path:
    """The vllm VERSION wheel for a GPU machine in DIRECTORY (downloaded only if not already there)."""
    for wheel in directory.glob(f"vllm-{version}-*.whl"):
        return wheel
    command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--quiet", "-d",
               str(directory), *_pip_platform_args()]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    wheels = list(directory.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise SystemExit(f"pip download vllm=={version} failed: {' '.join(done.stderr.split())[-400:]}")
    return wheels[0]


def installed_source() -> Source:
    """The installed vLLM's source tree (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no installed vLLM to compare the copied rules with (pip install 'layerwise[cpu]')")
    return Source(Path(next(iter(spec.submodule_search_locations))).parent)


def print_table(rows: list[Row]) -> None:
    width = max(len(r.subject) for r in rows)
    check_width = max(len(r.check) for r in rows)
    for r in rows:
        print(f"{'ok' if r.ok else 'DIFF':<4}  {r.check:<{check_width}}  {r.subject:<{width}}  {r.detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="the vllm release (default: the newest on the index)")
    parser.add_argument("--wheel", type=Path, help="check this wheel or unpacked source tree instead of downloading")
    parser.add_argument("--download-dir", type=Path, help="keep the wheel here (default: a temp dir, removed)")
    parser.add_argument("--installed", type=Path, help="the reference vLLM tree for the copied rules "
                        "(default: the installed vllm)")
    parser.add_argument("--skip-resolution", action="store_true", help="no pip resolution of layerwise[gpu]")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-release-") as temp:
        work = Path(temp)
        version = args.version
        if args.wheel is not None:
            path = args.wheel
            version = version or _version_of(path)
        else:
            version = version or newest_version()
            directory = args.download_dir or work
            directory.mkdir(parents=True, exist_ok=True)
            path = download_wheel(version, directory)
        downloaded = time.perf_counter()
        release = Source(path)
        installed = Source(args.installed) if args.installed else installed_source()
        print(f"vLLM {version} from {path.name} against layerwise's vllm_compat ({len(vllm_compat.PRIVATE)} symbols, "
              f"{len(vllm_compat.COPIED_RULES)} copied rules); reference: {installed.path}")
        rows = [check_symbol(release, symbol, version) for symbol in vllm_compat.PRIVATE]
        for rule in vllm_compat.COPIED_RULES:
            rows += check_rule(release, installed, rule)
        rows += [check_flag(release, flag) for flag in vllm_compat.COMMAND_FLAGS]
        rows += check_hooks(release)
        rows += check_architectures(release, version, work)
        checked = time.perf_counter()
        if not args.skip_resolution:
            rows += check_resolution(version, work)
    print_table(rows)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok; wheel {downloaded - started:.1f} s, source checks "
          f"{checked - downloaded:.1f} s, total {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


def _version_of(path: Path) -> str:
    match = re.match(r"vllm-([^-]+)-", path.name)
    return match.group(1) if match else "unknown"


if __name__ == "__main__":
    sys.exit(main())
