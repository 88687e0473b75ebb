"""The tiny model's directory: ``config.json`` for FastDeploy and a character-level tokenizer.

FastDeploy loads the tokenizer with PaddleFormers' ``AutoTokenizer`` (input/text_processor.py:
310-313) and applies its chat template (input/base_processor.py:144-172).  The tokenizer
here maps every printable ASCII character to one token (plus a few special tokens), so any
English prompt -- FastDeploy's own R3 test prompts included -- becomes a varied token
sequence and every generated token decodes back to text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["EOS_TOKEN_ID", "SPECIAL_TOKENS", "VOCAB", "model_config", "write_model_dir"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n"]
VOCAB = SPECIAL_TOKENS + CHARACTERS
EOS_TOKEN_ID = SPECIAL_TOKENS.index("</s>")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def model_config(**overrides: Any) -> dict[str, Any]:
    """The tiny MoE's ``config.json``: 4 decoder layers, the first dense, 3 MoE layers of 16
    experts (top-4), float32; ``fdrr`` holds the model's own settings (tests/live/tiny_moe.py)."""
    fdrr = {"eos_token_id": EOS_TOKEN_ID, "eos_period": 40}
    fdrr.update(overrides.pop("fdrr", {}))
    config = {
        "architectures": ["FdrrTinyMoeForCausalLM"], "model_type": "fdrr_tiny_moe", "dtype": "float32",
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": len(VOCAB), "intermediate_size": 96, "moe_intermediate_size": 32,
        "moe_num_experts": 16, "moe_k": 4, "moe_layer_start_index": 1, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index("<s>"), "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": SPECIAL_TOKENS.index("<pad>"), "fdrr": fdrr,
    }
    config.update(overrides)
    return config


def write_model_dir(path: Path, **overrides: Any) -> Path:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer under ``path``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(**overrides), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_TOKEN_ID}))
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE, "model_max_length": 8192}))
    return path
