"""Fail when layerwise_cli's imports break its structure: a cycle, an import against the layer order, Typer/Rich
outside `cli/`, or private vLLM outside `vllm_compat.py`.

Builds the import graph with `ast` (nothing is imported). An import inside a
function is still an edge: it hides a cycle from Python's import machinery,
not from a reader.

- Cycles: strongly connected components of the graph.
- Layers (`LAYERS`): a subpackage may import only its own modules and those of
  lower layers, so data flows one way (checkpoint -> planning -> worker ->
  client -> cli). Checked only when PACKAGE_DIR is layerwise_cli itself.
- Rooms (`ROOMS`): the same rule one level down, inside `worker/` (rpc ->
  stream -> state -> repairs -> quantization -> proof -> reload -> extension),
  `checkpoint/` (format -> fetch -> hub, store -> sources -> delta -> steps ->
  shard_copy) and `client/` (pinning -> delivery -> engine, servers -> watch); every
  sub-package of `worker/` is a room, and `worker/` has at most
  `WORKER_TOP_ENTRIES` entries at its top; every entry of `checkpoint/` and
  `client/` is a room.
- Typer and Rich are imported only under `cli/` (`UI_LIBRARIES`).
- vLLM is imported only by `vllm_compat.py`, the one door to its private
  symbols; elsewhere only `from vllm import NAME` for a NAME in that module's
  `PUBLIC_NAMES` (vLLM's public API: `LLM`, `SamplingParams`).

Usage: python scripts/check_imports.py [PACKAGE_DIR]   (default: layerwise_cli)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package modules that `name` (at `path`) imports, resolved to modules in `modules`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from . import x` may name a submodule; else the names come from `stem` itself.
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` imports a, a.b and a.b.c; the deepest known module is the edge.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


# Subpackage of layerwise_cli -> layer. Top-level modules (errors, units, ...) are layer 0.
LAYERS = {
    "checkpoint": 1,  # safetensors files: headers, sources, finite checks
    "planning": 2,  # which engine layer each tensor feeds, read order
    "report": 3,  # what a reload produced (built in workers, merged in the client)
    "demo": 3,  # the demo models
    "reorder": 4,  # rewriting checkpoints in layer order
    "worker": 4,  # inside vLLM's worker processes
    "writer": 5,  # save_checkpoint: a trainer's tensors written in layer order, shards planned by reorder's rule
    "client": 5,  # the user's process: engines in process and servers over HTTP
    "server": 5,  # the `layerwise serve` process
    "cli": 6,  # commands and views
}
UI_LIBRARIES = ("typer", "rich", "click")

# The rooms of worker/ (a module or sub-package directly under it) -> their order inside the worker layer.
WORKER_ROOMS = {
    "rpc": 0,  # the extension's call surface: method names, arguments, answers (the client imports it too)
    "stream": 1,  # reading a checkpoint for one rank: plan, read order, read-ahead, handover, loading in place
    "state": 2,  # what a worker keeps between reloads: records, state digests, spot checks, plan cache
    "repairs": 3,  # what vLLM's reload leaves undone or wrong: derived state, CPU kernels, put-back layers, AMX MLA
    "quantization": 4,  # layerwise's online quantization methods (registered with vLLM)
    "proof": 5,  # --verify, fingerprints, checksums, consensus across ranks
    "reload": 6,  # one reload start to end: pre-flight, unchanged layers, stream into vLLM, probe, rollback
    "extension": 7,  # the class vLLM mixes into every worker
}
WORKER_TOP_ENTRIES = 9

# The rooms of checkpoint/ (a module or sub-package directly under it) -> their order inside the checkpoint layer.
CHECKPOINT_ROOMS = {
    "format": 0,  # the bytes of a safetensors file: headers, layout, digests, samples, finite checks, chunked reads
    "fetch": 1,  # bytes by range from any pinned source: the source protocol, the fetcher, partial files, the policy
    "hub": 2,  # the Hub: a revision pinned to a commit, headers by range, its range source and cache
    "store": 2,  # object stores and HTTPS (obstore): objects pinned to ETags, headers by range
    "local_pin": 2,  # local files pinned by their identities (inode, size, times), for work kept on them
    "sources": 3,  # a SOURCE string (folder, file, Hub id, URL) opened as a `Checkpoint`
    "delta": 4,  # sparse delta steps: format, read, encode, opened as the full step they rebuild
    "steps": 5,  # a run's steps: which exist, which are complete, which may be deleted
    "shard_copy": 6,  # a remote checkpoint's shards fetched whole for a copy (`reorder`)
}
# The rooms of client/ -> their order inside the client layer.
CLIENT_ROOMS = {
    "pinning": 0,  # a source's identity (commit, ETags) resolved once per operation, for every room
    "delivery": 1,  # how the bytes arrive (local, download, prefetch, stream), decided once beside the pin
    "engine": 2,  # the engine in this process
    "servers": 2,  # running servers over HTTP: calls, one server's reload, fleets, the lease
    "watch": 3,  # keeping an engine or servers on the newest step of a run
}
# Package -> its rooms: a room imports only its own modules and those of earlier rooms.
ROOMS = {"worker": WORKER_ROOMS, "checkpoint": CHECKPOINT_ROOMS, "client": CLIENT_ROOMS}


ENTRY_POINTS = {"__main__": 7}  # `python -m layerwise_cli` runs the CLI


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return 0
    return LAYERS.get(parts[1], ENTRY_POINTS.get(parts[1], 0))


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a higher layer, or across subpackages of one layer."""
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = name.split("."), target.split(".")
            same_package = len(here) > 1 and len(there) > 1 and here[1] == there[1]
            if same_package:
                continue
            if layer_of(target) >= layer_of(name) and layer_of(target) > 0:
                found.append(f"layer order: {name} (layer {layer_of(name)}) imports {target} "
                             f"(layer {layer_of(target)})")
    return found


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside a package of `ROOMS` against its room order (a later room imported by an earlier one)."""
    found = []
    for name, targets in sorted(graph.items()):
        here = name.split(".")
        rooms = ROOMS.get(here[1] if len(here) > 1 else "")
        if rooms is None or len(here) < 3 or here[2] not in rooms:
            continue
        for target in sorted(targets):
            there = target.split(".")
            if there[1:2] != here[1:2] or len(there) < 3 or there[2] not in rooms or there[2] == here[2]:
                continue
            if rooms[there[2]] > rooms[here[2]]:
                found.append(f"room order: {name} (room {here[2]}) imports {target} (room {there[2]}, "
                             "which comes later)")
    return found


def room_layout(root: Path) -> list[str]:
    """Entries of a package of `ROOMS` that are no room of it, and too many entries at worker/'s top.

    In worker/ every sub-package is a room (its modules at the top are the rpc surface and the extension); in
    checkpoint/ and client/ every module and sub-package is.
    """
    found = []
    for package, rooms in ROOMS.items():
        folder = root / package
        if not folder.is_dir():
            continue
        entries = sorted(p for p in folder.iterdir() if p.name != "__pycache__")
        for entry in entries:
            room = entry.name.removesuffix(".py")
            counts = entry.is_dir() if package == "worker" else entry.is_dir() or entry.suffix == ".py"
            if counts and entry.name != "__init__.py" and room not in rooms:
                found.append(f"{package}/{entry.name} is not a room of {package.upper()}_ROOMS")
        if package == "worker" and len(entries) > WORKER_TOP_ENTRIES:
            found.append(f"worker/ has {len(entries)} entries at its top (at most {WORKER_TOP_ENTRIES})")
    return found


def ui_imports(path: Path, name: str) -> list[str]:
    """Typer/Rich imports in a module outside `cli/`."""
    if name.split(".")[1:2] == ["cli"]:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found += [f"{name} imports {n} (only cli/ may)" for n in names if n.split(".")[0] in UI_LIBRARIES]
    return found


COMPAT_MODULE = "vllm_compat"


def public_vllm_names(root: Path) -> set[str]:
    """`PUBLIC_NAMES` of ROOT's vllm_compat.py, read with `ast` (none when the module is absent)."""
    path = root / f"{COMPAT_MODULE}.py"
    if not path.is_file():
        return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PUBLIC_NAMES" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def vllm_imports(path: Path, name: str, public: set[str]) -> list[str]:
    """Imports of vLLM in a module other than vllm_compat, except `from vllm import NAME` for a public NAME."""
    if name.split(".")[1:] == [COMPAT_MODULE]:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "vllm":
                found += [f"vllm.{alias.name}" for alias in node.names if alias.name not in public]
            elif node.module.split(".")[0] == "vllm":
                found.append(node.module)
    return [f"{name} imports {target} (private vLLM: import it in {COMPAT_MODULE}.py)" for target in found]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent / "layerwise_cli").resolve()
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    # A package imports its parent package's __init__ implicitly; only explicit imports are edges here.
    graph = {name: imports_of(path, name, set(paths)) for name, path in paths.items()}
    found = cycles(graph)
    for component in found:
        members = set(component)
        edges = ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a] & members))
        print(f"import cycle: {' <-> '.join(component)} ({edges})", file=sys.stderr)
    problems = [problem for name, path in paths.items() for problem in ui_imports(path, name)]
    public = public_vllm_names(root)
    problems += [problem for name, path in paths.items() for problem in vllm_imports(path, name, public)]
    if root.name == "layerwise_cli":
        problems += layer_violations(graph) + room_violations(graph) + room_layout(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not found and not problems:
        print(f"no import cycles among {len(graph)} modules of {root.name}; layers, worker rooms, UI and vLLM "
              "imports in order")
    return 1 if found or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
