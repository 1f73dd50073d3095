"""scripts/check_vllm_release.py against copies of the installed vLLM's source: one as it is, one doctored."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from layerwise_cli import vllm_compat

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_vllm_release.py"


def _installed_tree() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds, does not import
    assert spec is not None and spec.submodule_search_locations, "the engine tests' vLLM must be installed"
    return Path(next(iter(spec.submodule_search_locations)))


def _wheel(path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A wheel-shaped zip of the installed vLLM's .py files, with each edit (file -> (old, new)) applied once."""
    tree = _installed_tree()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for file in sorted(tree.rglob("*.py")):
            name = f"vllm/{file.relative_to(tree).as_posix()}"
            text = file.read_text(encoding="utf-8")
            if name in edits:
                old, new = edits.pop(name)
                assert text.count(old) == 1, (name, old)
                text = text.replace(old, new)
            wheel.writestr(name, text)
    assert not edits, f"files not found: {sorted(edits)}"
    return path


def _check(wheel: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--wheel", str(wheel), "--installed",
                           str(_installed_tree().parent), "--skip-resolution"],
                          capture_output=True, text=True, timeout=300, check=False)


def _differences(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("DIFF")]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("wheels")
    return {
        "same": _wheel(folder / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", {}),
        "doctored": _wheel(folder / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl", {
            "vllm/model_executor/model_loader/reload/utils.py": ("def get_layer_size(", "def get_layer_numel("),
            "vllm/model_executor/layers/vocab_parallel_embedding.py": ("DEFAULT_VOCAB_PADDING_SIZE = 64",
                                                                       "DEFAULT_VOCAB_PADDING_SIZE = 128"),
            "vllm/entrypoints/serve/middleware/authenticate.py": ("def verify_token(", "def check_token("),
            "vllm/engine/arg_utils.py": ('add_argument("--nnodes"', 'add_argument("--num-nodes"'),
            # The weight-transfer API the `layerwise` backend subclasses.
            "vllm/distributed/weight_transfer/base.py": ("def receive_weights(", "def receive_tensors("),
        }),
        # A symbol moved to the module a later release keeps it in (0.34's `vllm._cpu_ops`).
        "moved": _wheel(folder / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64-moved.whl", {
            "vllm/_custom_ops.py": ("def cpu_prepack_moe_weight(", "def _was_cpu_prepack_moe_weight("),
            "vllm/model_executor/model_loader/reload/utils.py": ("def get_layer_size(",
                                                                "def cpu_prepack_moe_weight(weight, isa):\n"
                                                                "    return weight\n\n\ndef get_layer_size("),
        }),
        # The installed version with one model's fusions changed: the committed table of 0.32.0 no longer matches.
        "refused": _wheel(folder / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64-fused.whl", {
            "vllm/model_executor/models/qwen3.py": ('"gate_up_proj": ["gate_proj", "up_proj"],\n    }\n    embedding',
                                                   '"gate_up_proj": ["gate_proj"],\n    }\n    embedding'),
        }),
    }


def test_the_installed_vllm_passes_its_own_check(wheels: dict[str, Path]) -> None:
    done = _check(wheels["same"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _differences(done.stdout)
    assert "get_layer_size" in done.stdout and "AuthenticationMiddleware" in done.stdout
    assert "--headless" in done.stdout and "--master-port" in done.stdout
    assert "WeightTransferEngineFactory" in done.stdout and "TrainerWeightTransferEngine" in done.stdout


def test_a_renamed_symbol_and_a_changed_rule_fail_naming_them(wheels: dict[str, Path]) -> None:
    done = _check(wheels["doctored"])
    assert done.returncode == 1, done.stdout + done.stderr
    differences = _differences(done.stdout)
    assert len(differences) == 10, differences
    (renamed, verify_token, direct_mode, rerun_hooks, receive, padding_rule, padding_value, completion_rule, nnodes,
     table) = differences
    assert "reload.utils.get_layer_size" in renamed and "get_layer_size is not defined" in renamed
    assert "AuthenticationMiddleware" in verify_token and "has no verify_token" in verify_token
    # 9.9.9 is newer than 0.34.0, the first release with the direct mode and the rerun of module hooks, so their
    # absence is a difference too.
    assert "direct_reload_enabled" in direct_mode and "module vllm.model_executor.model_loader.reload.direct is " \
        "missing" in direct_mode
    assert "finalize_model_weights is not defined in vllm.model_executor.model_loader.weight_utils" in rerun_hooks
    assert "WeightTransferEngine" in receive and "has no receive_weights" in receive
    assert "vocabulary padding" in padding_rule and "changed: DEFAULT_VOCAB_PADDING_SIZE" in padding_rule
    assert "release 128, layerwise (completion_rule.VOCAB_PADDING) 64" in padding_value
    assert "completion rule" in completion_rule and "removed: get_layer_size; added: get_layer_numel" in completion_rule
    assert "--nnodes is not declared in vllm.engine.arg_utils" in nnodes and "layerwise serve --nnodes" in nnodes
    assert "architecture" in table and "no committed table for vLLM 9.9.9" in table


def test_an_architecture_the_release_fuses_otherwise_fails_naming_it(wheels: dict[str, Path]) -> None:
    """The release's model classes regenerate the table; one changed fusion is one failing row naming its class."""
    done = _check(wheels["refused"])
    assert done.returncode == 1, done.stdout + done.stderr
    differences = _differences(done.stdout)
    assert differences and all("architecture" in line for line in differences), differences
    assert any("Qwen3ForCausalLM " in line and "entry differs: packed" in line for line in differences), differences


def test_a_moved_symbol_passes_where_it_moved_and_fails_where_it_is_nowhere(wheels: dict[str, Path]) -> None:
    """`moved_to` is followed: the release holding the name only there passes, naming the new module."""
    symbol = vllm_compat.CPU_PREPACK_MOE_WEIGHT
    check = _script()
    release = check.Source(wheels["moved"])
    nowhere = check.check_symbol(release, symbol, "0.32.0")
    assert not nowhere.ok and "cpu_prepack_moe_weight is not defined in vllm._custom_ops" in nowhere.detail
    moved = vllm_compat.PrivateSymbol(symbol.module, symbol.name, symbol.kind, parameters=symbol.parameters,
                                      moved_to=("vllm.model_executor.model_loader.reload.utils",))
    found = check.check_symbol(release, moved, "0.32.0")
    assert found.ok and "moved to vllm.model_executor.model_loader.reload.utils" in found.detail, found


def test_a_changed_rule_passes_only_with_a_review_of_exactly_its_text(tmp_path: Path, monkeypatch) -> None:
    """A reviewed digest lets one changed definition pass, with its verdict; any other edit still fails."""
    check = _script()
    installed = check.Source(_installed_tree().parent)
    rule = next(r for r in vllm_compat.COPIED_RULES if r.module.endswith("reload.meta"))

    def release_with(body: str) -> object:
        tree = tmp_path / body.replace(" ", "_")[:20] / "vllm/model_executor/model_loader/reload"
        tree.mkdir(parents=True)
        text = (_installed_tree() / "model_executor/model_loader/reload/meta.py").read_text(encoding="utf-8")
        old = "requires_grad=False,\n    )\n"
        assert text.count(old) == 1
        (tree / "meta.py").write_text(text.replace(old, f"requires_grad=False,\n    ){body}\n"), encoding="utf-8")
        return check.Source(tree.parents[3])

    zeroed, other = release_with(".zero_()"), release_with(".fill_(1)")
    digest = check._definitions(zeroed, rule.module)["materialize_meta_tensor"]
    monkeypatch.setattr(vllm_compat, "REVIEWED_CHANGES", (vllm_compat.ReviewedChange(
        rule.module, "materialize_meta_tensor", "9.9.9", digest, "zero-fills"),))
    passed = check.check_rule(zeroed, installed, rule)
    assert all(row.ok for row in passed), passed
    assert [row.detail for row in passed if row.check == "reviewed"] == [f"9.9.9 ({digest}): zero-fills"]
    failed = check.check_rule(other, installed, rule)
    assert [row.ok for row in failed] == [False] and "changed: materialize_meta_tensor" in failed[0].detail
    # Formatting and comments are not the definition: the digest ignores them, and docstrings.
    assert check._definitions(installed, rule.module) == check._definitions(release_with("  # a comment"),
                                                                            rule.module)


def _script():
    spec = importlib.util.spec_from_file_location("check_vllm_release_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_reviewed_hook_passes_only_as_reviewed_and_only_where_hooks_rerun(tmp_path: Path, monkeypatch) -> None:
    """In a release that reruns module hooks after a reload, each reviewed hook's text must be the one reviewed."""
    check = _script()

    def release(hook_body: str, rerun: bool) -> object:
        root = tmp_path / f"{abs(hash((hook_body, rerun)))}"
        loader = root / "vllm/model_executor/model_loader"
        layers = root / "vllm/model_executor/layers"
        loader.mkdir(parents=True, exist_ok=True)
        layers.mkdir(parents=True, exist_ok=True)
        hooks = "def finalize_model_weights(model):\n    pass\n" if rerun else "X = 1\n"
        (loader / "weight_utils.py").write_text(hooks)
        (layers / "attn.py").write_text(f"class Attn:\n    def process_weights_after_loading(self):\n"
                                        f"        {hook_body}\n")
        return check.Source(root)

    digest = check.definition_digest(check.method_node(release("self.impl.refill()", True), "vllm.model_executor."
                                                       "layers.attn", "Attn.process_weights_after_loading"))
    monkeypatch.setattr(vllm_compat, "IDEMPOTENT_HOOKS", (vllm_compat.ReviewedHook(
        "vllm.model_executor.layers.attn", "Attn.process_weights_after_loading", "9.9.9", digest, "refills"),))
    same = check.check_hooks(release("self.impl.refill()", True))
    assert [(row.ok, row.detail) for row in same] == [(True, "as reviewed for 9.9.9: refills")]
    changed = check.check_hooks(release("self.weight.data = self.weight.data.t()", True))
    assert [row.ok for row in changed] == [False] and "changed since reviewed" in changed[0].detail
    older = check.check_hooks(release("self.weight.data = self.weight.data.t()", False))
    assert [row.ok for row in older] == [True] and "reruns no module's own hook" in older[0].detail


def test_a_release_whose_own_pins_do_not_resolve_is_checked_as_users_get_it(monkeypatch) -> None:
    """vLLM 0.34.0 pins flashinfer-python==0.7.3, which the index lacks: pip then backtracks for users, and the
    check resolves layerwise[gpu] unpinned; a release that resolves alone but not with layerwise still fails."""
    check = _script()
    good = check.Resolution({"vllm": "0.33.0", "torch": "2.14.0"}, "", 1.0)
    missing = check.Resolution(None, "pip exit 1: No matching distribution found for flashinfer-python==0.7.3", 1.0)
    conflict = check.Resolution(None, "pip exit 1: ResolutionImpossible: torch", 1.0)

    def resolving(answers):
        def resolve(requirements, report):
            key = "pinned" if any(r.startswith("vllm==") for r in requirements) and len(requirements) > 1 else \
                "alone" if len(requirements) == 1 else "unpinned"
            return answers[key]
        return resolve

    monkeypatch.setattr(check, "_resolve", resolving({"pinned": missing, "alone": missing, "unpinned": good}))
    rows = check.check_resolution("0.34.0", Path("."))
    assert rows[-1].ok and "vllm 0.34.0 itself does not resolve" in rows[-1].detail \
        and "resolves to vllm 0.33.0" in rows[-1].detail
    monkeypatch.setattr(check, "_resolve", resolving({"pinned": conflict, "alone": good, "unpinned": good}))
    rows = check.check_resolution("0.34.0", Path("."))
    assert not rows[-1].ok and "resolves alone but not with layerwise's requirements" in rows[-1].detail
    monkeypatch.setattr(check, "_resolve", resolving({"pinned": missing, "alone": missing, "unpinned": conflict}))
    assert not check.check_resolution("0.34.0", Path("."))[-1].ok
