"""Write the demo models' word-level tokenizer files (and the JSON writer the demo files share)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerwise_cli.demo.recipe import PRE_TOKENIZER_PATTERN, SPECIAL_TOKENS, VOCAB_TOKENS


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write DATA as sorted, indented JSON: byte-identical from build to build."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tokenizer(out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into OUT."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 - tokenizers: 70 ms to import, only to build the demo tokenizer

    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB_TOKENS)}, unk_token="<unk>"))
    # "3 4 = " -> ["3", " ", "4", " ", "=", " "]; no BOS is added; decoding concatenates.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
    })
    write_json(out / "special_tokens_map.json", {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
    })
