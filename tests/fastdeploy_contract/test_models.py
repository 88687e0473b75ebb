"""The model matrix: every MoE architecture of FastDeploy 2.6, built by FastDeploy's own model
class with a tiny config, run on the CPU with the plugin, each record checked against the
top-k the model computed.

One process per FastDeploy version runs the models (``model_run.py``; FastDeploy's CUDA code
path is presented there, the kernels stood in by ``tests/fdcpu`` and ``cpu_kernels``).
Per model: FastDeploy's config and registry class, a prefill (chunked where the row says so)
and decode steps through the model's ``forward`` and FastDeploy's step code
(``post_process_normal``; 2.6: the engine's token processor), then the record against the
selections the MoE kernels returned -- every row, the layer map, the expert count, the dtype
-- and the stand-ins the model's path must have used.  Rows FastDeploy itself refuses are
checked to fail in FastDeploy's own config code, where docs/fastdeploy.md says.
With FastDeploy 2.5 / develop the multimodal row runs (ERNIE-4.5-VL records there; 2.6
refuses it) beside ERNIE-4.5 MoE.  docs/fastdeploy.md, "Model matrix", lists every row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from conftest import SOURCE  # noqa: E402

from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402

HERE = Path(__file__).resolve().parent
V26 = fdctx.GENERATION == fd_api.STEP_BUFFER
TIMEOUT_S = 420

BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
            intermediate_size=96, max_position_embeddings=512, dtype="float32", rms_norm_eps=1e-6, head_dim=16,
            hidden_act="silu", rope_theta=10000)


@dataclass(frozen=True)
class Row:
    """One model of the matrix: its tiny config, the request, what its record must be."""

    config: dict[str, Any]
    layers: tuple[int, ...] = (1, 2)
    experts: int = 16
    top_k: int = 4
    kernels: tuple[str, ...] = ()            # stand-ins the model's path must have run
    request: dict[str, Any] = field(default_factory=dict)
    refused_at: str = ""                     # FastDeploy's own config code raises here


ERNIE = dict(architectures=["Ernie4_5_MoeForCausalLM"], moe_num_experts=300, moe_k=4, moe_layer_start_index=1,
             moe_intermediate_size=32, moe_num_shared_experts=0)
ERNIE_VL = dict(architectures=["Ernie4_5_VLMoeForConditionalGeneration"], moe_num_experts=[8, 8], moe_k=2,
                moe_layer_start_index=1, moe_intermediate_size=[32, 32], moe_num_shared_experts=0, pixel_hidden_size=32, spatial_conv_size=2, temporal_conv_size=2,
                vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=2,
                                   spatial_merge_size=2, in_channels=3, mlp_ratio=2, hidden_act="quick_gelu"))
IMAGE_CHUNKED_AND_CACHED = {"chunks": [8], "prefix_hit": 16}   # the image spans positions 4..11
"""Chunked prefill splits the image's placeholder tokens (4..7 | 8..11); a second request
hits the first one's prefix cache (16 tokens, the image among them)."""

MATRIX: dict[str, Row] = {
    "ernie4_5_moe": Row(ERNIE, experts=300, kernels=("moe_expert_dispatch", "fused_bias_act", "attention")),
    "qwen3_moe": Row(dict(architectures=["Qwen3MoeForCausalLM"], num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True),
                     kernels=("moe_expert_dispatch", "qk_rmsnorm_fused")),
    "deepseek_v3": Row(dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", n_routed_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=32, first_k_dense_replace=1,
                            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid"),
                       kernels=("noaux_tc", "moe_expert_dispatch:topk_only", "mla:prefill", "mla:decode",
                                "fused_rotary_position_encoding")),
    "glm4_moe": Row(dict(architectures=["Glm4MoeForCausalLM"], n_routed_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                         topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=False,
                         partial_rotary_factor=0.5, attention_bias=True),
                    kernels=("noaux_tc", "moe_expert_dispatch:topk_only")),
    "qwen3_vl_moe": Row(dict(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe",
                             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, decoder_sparse_step=1,
                             mlp_only_layers=[0], norm_topk_prob=True, image_token_id=990, video_token_id=991,
                             vision_start_token_id=992,
                             vision_config=dict(depth=1, hidden_size=32, num_heads=2, patch_size=2,
                                                temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=64,
                                                in_channels=3, intermediate_size=64, deepstack_visual_indexes=[0],
                                                hidden_act="gelu_pytorch_tanh", num_position_embeddings=16)),
                        kernels=("moe_expert_dispatch",),
                        request=dict(IMAGE_CHUNKED_AND_CACHED, image={"start": 4, "length": 8, "token_id": 990,
                                                                      "features": 128})),
    "ernie4_5_mtp": Row(dict(ERNIE, moe_layer_start_index=0, moe_num_experts=16), layers=(0, 1, 2),
                        kernels=("moe_expert_dispatch",), request={"draft": True}),
    "ernie4_5_vl_moe": Row(ERNIE_VL, top_k=2, refused_at="config.py:1881 postprocess"),
    "gpt_oss": Row(dict(architectures=["GptOssForCausalLM"], num_local_experts=16, num_experts_per_tok=4,
                        experts_per_token=4, sliding_window=8, attention_bias=True,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                   refused_at="config.py:1881 postprocess"),
}
"""FastDeploy 2.6's MoE architectures that the matrix runs.  Not run here (docs/fastdeploy.md
says why): DeepSeek-V3.2 and GLM MoE DSA (DSA sparse attention: FastDeploy's indexer and
radix top-k kernels have no CPU stand-in), GLM-4.5 MTP, the ERNIE-4.5-VL reward model
(refused by FastDeploy like ERNIE-4.5-VL)."""

OLDER: dict[str, Row] = {
    "ernie4_5_moe": MATRIX["ernie4_5_moe"],
    "ernie4_5_vl_moe": Row(ERNIE_VL, top_k=2, kernels=("text_image_index_out", "text_image_gather_scatter"),
                           request=dict(IMAGE_CHUNKED_AND_CACHED, image={"start": 4, "length": 8, "token_id": 900,
                                                                         "features": 64},
                                        model_args={"image_patch_id": 900})),
}
"""FastDeploy 2.5 / develop: ERNIE-4.5-VL, whose records carry both expert groups there."""

ROWS = MATRIX if V26 else OLDER


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every row of this FastDeploy version, run in one model_run.py process."""
    out = tmp_path_factory.mktemp("matrix")
    models = []
    for index, (name, row) in enumerate(ROWS.items()):
        request = {key: value for key, value in row.request.items()}
        models.append({"name": name, "config": dict(BASE, **row.config), "seed": 11 + index, "prompt_len": 21,
                       "new_tokens": 4, "port": 24000 + (os.getpid() % 2000) * 8 + index, **request})
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "models": models}))
    env = dict(os.environ, FD_PLUGINS="fd_routing_replay", FD_RR_WRITER__MODE="thread",
               FD_LOG_DIR=str(out / "fdlog"), PYTHONUNBUFFERED="1")
    if SOURCE is not None:
        env["FD_SOURCE_DIR"] = str(Path(SOURCE).resolve())
    run = subprocess.run([sys.executable, str(HERE / "model_run.py"), str(spec)], env=env, cwd=out,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    results = {}
    for name in ROWS:
        path = out / f"{name}.json"
        if not path.exists():
            pytest.fail(f"model_run.py wrote no result for {name} (exit {run.returncode}):\n{run.stdout[-3000:]}\n"
                        f"{run.stderr[-6000:]}")
        results[name] = json.loads(path.read_text())
        if (out / f"{name}.npz").exists():
            results[name]["arrays"] = dict(np.load(out / f"{name}.npz"))
    return results


@pytest.mark.parametrize("name", list(ROWS))
def test_model(matrix, name):
    row, result = ROWS[name], matrix[name]
    if row.refused_at:
        # FastDeploy itself cannot enable routing replay for this model: its own config code
        # raises before any plugin is loaded (docs/fastdeploy.md, "Model matrix").
        assert result["status"] == "fastdeploy-config-error", result
        assert result["where"].endswith(row.refused_at), result["where"]
        assert result["error"].startswith("TypeError"), result["error"]
        return
    assert result["status"] == "ran", f"{name}: {result.get('error')}\n{result.get('traceback', '')}"
    arrays = result["arrays"]
    record, computed = arrays["record"], arrays["computed"]
    assert record.shape == computed.shape == (len(row.layers), 21 + 4 - 1, row.top_k)
    np.testing.assert_array_equal(record, computed)          # every row, every layer
    assert tuple(result["layers"]) == tuple(result["layer_map"]) == row.layers
    assert result["num_experts"] == row.experts
    assert result["dtype"] == ("uint16" if row.experts >= 255 else "uint8")
    assert result["num_decoder_layers"] == 3
    assert result["hook"] == {"errors": 0, "mismatches": 0}
    assert not result["metadata"].get("missing_tokens")
    for kernel in row.kernels:
        assert result["kernels"].get(kernel, 0) > 0, (kernel, result["kernels"])
    if "prefix_hit" in row.request:       # the second request's prefix rows came from the first's
        np.testing.assert_array_equal(arrays["hit_record"], arrays["hit_computed"])
    if row.request.get("draft"):          # the MTP draft layer routed, the hook never saw it
        assert all(calls > 0 for calls in result["draft_selections"]), result["draft_selections"]
    if isinstance(row.config.get("moe_num_experts"), list):
        text, image = row.config["moe_num_experts"]
        # image tokens: ids >= im_patch_id (ernie4_5_vl_moe.py:508), the placeholders and any
        # such id the model generated
        images = arrays["tokens"] >= row.request["model_args"]["image_patch_id"]
        assert images[4:12].all() and images.sum() < len(images)
        assert (record[:, images] >= text).all() and (record[:, ~images] < text).all()
        assert result["metadata"]["expert_groups"] == [{"name": "text", "first": 0, "count": text},
                                                       {"name": "image", "first": text, "count": image}]
