"""The harness's Qwen3-MoE as a Hugging Face checkpoint: ``config.json`` + safetensors.

The trainer side of the R3 experiment reads the engine's weights the way a trainer reads a
released model: ``transformers.Qwen3MoeForCausalLM.from_pretrained(directory)``.  The
tensors keep Qwen3-MoE's checkpoint names (experts one by one,
``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``), so transformers' own loading path
(its per-expert → fused conversion included) is what runs.  Written in float32: the
values are bfloat16-exact (:func:`~fdrr_dev.harness.qwen3_moe.round_to_bf16`), so
a float32 trainer and a bf16 engine hold the same weights.

``safetensors``, ``torch`` and ``transformers`` come with the ``trainer-test`` extra and are
imported only inside the functions that need them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fdrr_dev.harness.qwen3_moe import TinyQwen3Config, TinyQwen3Moe

__all__ = ["EXTRA", "hf_config", "load_hf_model", "save_hf_checkpoint"]

EXTRA = "pip install 'fd-routing-replay[trainer-test]'"
WEIGHTS_FILE = "model.safetensors"


def _need(module: str) -> Any:
    """Import ``module`` or raise ImportError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"the Hugging Face side of the harness needs {module.split('.')[0]} "
                          f"(torch, transformers, safetensors): {EXTRA}") from exc


def hf_config(config: TinyQwen3Config) -> dict[str, Any]:
    """``config.json`` of a ``Qwen3MoeForCausalLM`` with the harness model's shape."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.mlp_only_layers),
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_model_len,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "eos_token_id": config.eos_token_id,
        "dtype": "float32",
    }


def save_hf_checkpoint(model: TinyQwen3Moe, directory: str | Path) -> Path:
    """Write ``model``'s weights and config to ``directory`` (created); returns it."""
    save_file = _need("safetensors.numpy").save_file
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    save_file(dict(model.state_dict), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_hf_model(directory: str | Path) -> Any:
    """``Qwen3MoeForCausalLM`` from ``directory`` in float32 with eager attention, in eval
    mode; every tensor of the checkpoint must be used and none may be missing."""
    _need("torch")
    transformers = _need("transformers")
    progress = transformers.utils.logging
    shown = progress.is_progress_bar_enabled()
    progress.disable_progress_bar()            # no per-tensor bar on the terminal
    try:
        model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
            str(directory), dtype="float32", attn_implementation="eager",
            output_loading_info=True)
    finally:
        if shown:
            progress.enable_progress_bar()
    problems = {key: value for key, value in info.items() if value and key != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise ValueError(f"{directory}: the checkpoint does not match Qwen3MoeForCausalLM: "
                         f"{problems or info['error_msgs']}")
    return model.eval()
