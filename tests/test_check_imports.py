"""scripts/check_imports.py: the package has no import cycle, and the check finds one when there is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_layerwise_cli_has_no_import_cycle() -> None:
    done = _check()
    assert done.returncode == 0, done.stderr
    assert "no import cycles" in done.stdout


def test_a_cycle_through_a_deferred_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub.b import thing\n")
    (package / "sub" / "b.py").write_text("def thing():\n    from .. import a\n    return a\n")
    (package / "c.py").write_text("import pkg.a\n")  # imports into the cycle, is not part of it
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip() == "import cycle: pkg.a <-> pkg.sub.b (pkg.a -> pkg.sub.b, pkg.sub.b -> pkg.a)"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "layerwise_cli"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == tmp_path:
                break
            (parent / "__init__.py").touch()
        path.write_text(text)
    return package


def test_an_import_against_the_layer_order_is_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "checkpoint/format/header.py": "",
        "worker/stream.py": "from layerwise_cli.checkpoint.format.header import x\n",
        "client/engine/in_process.py": "from layerwise_cli.worker.stream import y\n",
        "planning/plan.py": "def f():\n    from layerwise_cli.client.engine.in_process import z\n",
    })
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip() == ("layer order: layerwise_cli.planning.plan (layer 2) imports "
                                   "layerwise_cli.client.engine.in_process (layer 5)")


def test_rich_outside_cli_is_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {"cli/view.py": "import rich\n",
                                  "client/engine/in_process.py": "from rich.table import Table\n"})
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip() == "layerwise_cli.client.engine.in_process imports rich.table (only cli/ may)"


def test_private_vllm_outside_vllm_compat_is_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "vllm_compat.py": 'PUBLIC_NAMES = ("LLM", "SamplingParams")\n'
                          "def info():\n    from vllm.model_executor.model_loader.reload.layerwise import X\n",
        "client/engine/in_process.py": "def start():\n    from vllm import LLM, SamplingParams\n",
        "worker/verify.py": "def f():\n    from vllm.model_executor.model_loader.reload.meta import CopyCounter\n",
        "worker/after_reload.py": "def g():\n    from vllm import _custom_ops as ops\n",
        "worker/probe.py": "import vllm.distributed.parallel_state\n",
    })
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "layerwise_cli.worker.after_reload imports vllm._custom_ops (private vLLM: import it in vllm_compat.py)",
        "layerwise_cli.worker.probe imports vllm.distributed.parallel_state (private vLLM: import it in "
        "vllm_compat.py)",
        "layerwise_cli.worker.verify imports vllm.model_executor.model_loader.reload.meta (private vLLM: import it "
        "in vllm_compat.py)",
    ]


def test_an_import_against_the_worker_room_order_is_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "worker/stream/reader.py": "def f():\n    from layerwise_cli.worker.proof.verify import g\n",
        "worker/proof/verify.py": "from layerwise_cli.worker import rpc\n",
        "worker/rpc.py": "",
    })
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip() == ("room order: layerwise_cli.worker.stream.reader (room stream) imports "
                                   "layerwise_cli.worker.proof.verify (room proof, which comes later)")


def test_a_worker_folder_that_is_no_room_and_a_crowded_worker_top_are_found(tmp_path: Path) -> None:
    files = {"worker/misc/thing.py": ""} | {f"worker/part{i}.py": "" for i in range(8)}
    done = _check(str(_package(tmp_path, files)))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "worker/misc is not a room of WORKER_ROOMS",
        "worker/ has 10 entries at its top (at most 9)",
    ]


def test_an_import_against_the_checkpoint_room_order_is_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "checkpoint/format/header.py": "",
        "checkpoint/fetch/range_fetcher.py": "from layerwise_cli.checkpoint.hub.pin import HubPin\n",
        "checkpoint/hub/pin.py": "from layerwise_cli.checkpoint.format.header import x\n",
    })
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip() == ("room order: layerwise_cli.checkpoint.fetch.range_fetcher (room fetch) imports "
                                   "layerwise_cli.checkpoint.hub.pin (room hub, which comes later)")


def test_a_client_room_importing_a_later_one_and_a_module_outside_the_rooms_are_found(tmp_path: Path) -> None:
    package = _package(tmp_path, {
        "client/engine/in_process.py": "from layerwise_cli.client.watch.entry import watch\n",
        "client/watch/entry.py": "",
        "client/stray.py": "",
    })
    done = _check(str(package))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "room order: layerwise_cli.client.engine.in_process (room engine) imports layerwise_cli.client.watch.entry "
        "(room watch, which comes later)",
        "client/stray.py is not a room of CLIENT_ROOMS",
    ]
