"""The harness's Paddle Qwen3-MoE is transformers' Qwen3-MoE: same logits, router logits and
top-k from the same weights (fp32), loaded through the safetensors checkpoint the harness
writes; its paged engine forward equals its one-sequence forward; bf16 rounding is
round-to-nearest-even, as Paddle's cast."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fd_routing_replay.trainers.hf import replay_routing  # noqa: E402
from fdrr_dev.harness.fidelity import topk_margins  # noqa: E402
from fdrr_dev.harness.hf_checkpoint import (  # noqa: E402
    WEIGHTS_FILE,
    load_hf_model,
    save_hf_checkpoint,
)
from fdrr_dev.harness.paddle_runtime import paddle  # noqa: E402
from fdrr_dev.harness.qwen3_moe import (  # noqa: E402
    TinyQwen3Config,
    TinyQwen3Moe,
    round_to_bf16,
)
from tests.near_ties import agreeing_tokens  # noqa: E402


def small_config(gen: np.random.Generator, **overrides) -> TinyQwen3Config:
    """A random small shape: GQA or not, a dense layer or not, top-k renormalised or not."""
    layers = int(gen.integers(2, 5))
    kv_heads = int(gen.choice([1, 2, 4]))
    fields = dict(num_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                  head_dim=int(gen.choice([8, 16])), hidden_size=int(gen.choice([32, 48])),
                  num_experts=int(gen.choice([8, 16])), top_k=int(gen.integers(1, 5)),
                  norm_topk_prob=bool(gen.integers(2)), vocab_size=80,
                  mlp_only_layers=(0,) if gen.integers(2) else (),
                  rope_theta=float(gen.choice([10000.0, 1e6])),
                  seed=int(gen.integers(2**31)))
    fields.update(overrides)
    return TinyQwen3Config(**fields)


@pytest.mark.parametrize("attempt", range(3))
def test_fp32_forward_equals_transformers(seed, tmp_path, attempt):
    gen = np.random.default_rng([seed, attempt])
    config = small_config(gen)
    model = TinyQwen3Moe(config)
    hf = load_hf_model(save_hf_checkpoint(model, tmp_path / "ckpt"))
    assert [r for r in range(config.num_layers) if r not in config.mlp_only_layers] == \
        list(config.moe_layers)
    tokens = gen.integers(0, config.vocab_size, int(gen.integers(2, 60)))
    ours = model.forward_full(tokens)
    input_ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, output_router_logits=True)
        # A router call that is a near-tie at fp32 noise may go the other way in transformers
        # and change every later layer and token.  With our experts replayed, nothing but
        # rounding separates the two forwards, so everything else is compared there.
        with replay_routing(hf, ours.topk_ids):
            replayed = hf(input_ids=input_ids, output_router_logits=True)

    def router_logits_of(output) -> np.ndarray:
        return np.stack([r.numpy() for r in output.router_logits])             # [L_moe, S, E]

    def chosen(router_logits: np.ndarray) -> np.ndarray:
        return np.sort(np.argsort(-router_logits, axis=-1, kind="stable")[..., :config.top_k], -1)

    logits = replayed.logits[0].numpy()
    scale = np.abs(logits).max()
    np.testing.assert_allclose(ours.logits, logits, rtol=0, atol=2e-5 * scale)
    router_logits = router_logits_of(replayed)
    assert router_logits.shape == ours.gate_logits.shape
    np.testing.assert_allclose(ours.gate_logits, router_logits, rtol=0, atol=1e-4)
    # the chosen sets agree wherever the call is not a near-tie at fp32 noise
    decisive = topk_margins(router_logits, config.top_k) > 1e-4
    same = (np.sort(ours.topk_ids, -1) == chosen(router_logits)).all(-1)
    assert same[decisive].all()
    # transformers routing on its own: where it chose as we did everywhere (all but ~1 run
    # in 2000), its forward is ours too
    if (chosen(router_logits_of(theirs)) == np.sort(ours.topk_ids, -1)).all():
        np.testing.assert_allclose(ours.logits, theirs.logits[0].numpy(), rtol=0, atol=2e-5 * scale)


def test_checkpoint_is_what_transformers_expects(seed, tmp_path):
    gen = np.random.default_rng(seed)
    config = small_config(gen, mlp_only_layers=(0,))
    model = TinyQwen3Moe(config)
    path = save_hf_checkpoint(model, tmp_path / "ckpt")
    written = json.loads((path / "config.json").read_text())
    hf_config = transformers.AutoConfig.from_pretrained(str(path))
    assert hf_config.model_type == "qwen3_moe" and written["tie_word_embeddings"] is False
    assert (hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.mlp_only_layers) == \
        (config.num_experts, config.top_k, [0])
    assert hf_config.rope_parameters["rope_theta"] == config.rope_theta
    hf = load_hf_model(path)
    # every weight is bf16-exact and reached the model unchanged (untied lm_head included)
    for name, value in model.state_dict.items():
        assert (round_to_bf16(value) == value).all(), name
    np.testing.assert_array_equal(hf.lm_head.weight.detach().numpy(),
                                  model.state_dict["lm_head.weight"])
    expert = int(gen.integers(config.num_experts))
    layer = config.moe_layers[-1]
    fused = hf.model.layers[layer].mlp.experts.gate_up_proj.detach().numpy()[expert]
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    np.testing.assert_array_equal(fused[:config.moe_intermediate_size],
                                  model.state_dict[prefix + "gate_proj.weight"])
    np.testing.assert_array_equal(fused[config.moe_intermediate_size:],
                                  model.state_dict[prefix + "up_proj.weight"])


def test_incomplete_checkpoint_is_refused(tmp_path):
    from safetensors.numpy import save_file

    model = TinyQwen3Moe(TinyQwen3Config(num_layers=2, num_experts=4, top_k=2))
    path = save_hf_checkpoint(model, tmp_path / "ckpt")
    tensors = dict(model.state_dict)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_norm"):
        load_hf_model(path)


def test_paged_engine_forward_equals_one_sequence_forward(seed):
    """Two chunks through forward_step over a shuffled slot layout (the paged KV cache)
    give the logits and routes of forward_full."""
    gen = np.random.default_rng(seed)
    config = small_config(gen)
    model = TinyQwen3Moe(config)
    length = int(gen.integers(4, 40))
    tokens = gen.integers(0, config.vocab_size, length)
    full = model.forward_full(tokens)
    num_slots = length + int(gen.integers(0, 20))
    slot_of = gen.permutation(num_slots)[:length]           # position -> KV slot
    cache = model.new_kv_cache(num_slots)
    split = int(gen.integers(1, length))
    routes: list[list[np.ndarray]] = [[] for _ in range(config.num_moe_layers)]
    outputs = []
    for lo, hi in ((0, split), (split, length)):
        positions = np.arange(lo, hi)
        context = np.broadcast_to(slot_of[:hi], (hi - lo, hi))
        mask = np.arange(hi)[None, :] <= positions[:, None]

        def hook(*, layer_idx, topk_ids):
            routes[layer_idx].append(topk_ids.numpy())

        outputs.append(model.forward_step(tokens[lo:hi], positions, slot_of[lo:hi], context,
                                          mask, cache, hook).numpy())
    # every token before a near-tie that went the other way (all of them in almost every run)
    t0 = agreeing_tokens(np.stack([np.concatenate(r) for r in routes]), full.topk_ids,
                         full.gate_logits, near_tie=1e-4)
    np.testing.assert_allclose(np.concatenate(outputs)[:t0], full.logits[:t0], rtol=0, atol=1e-4)


def test_bf16_rounding_is_nearest_even_as_paddle_casts(seed):
    gen = np.random.default_rng(seed)
    values = (gen.standard_normal(4096) * 10.0 ** gen.integers(-8, 8, 4096)).astype(np.float32)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-9], dtype=np.float32)
    values = np.concatenate([values, ties, [0.0, -0.0, np.inf, -np.inf]]).astype(np.float32)
    ours = round_to_bf16(values)
    cast = paddle.to_tensor(values).astype("bfloat16").astype("float32").numpy()
    np.testing.assert_array_equal(ours, cast)
    assert ours[-8] == 1.0 and ours[-7] == 1 + 4 * 2**-8        # ties go to the even neighbour
    # bf16 keeps 8 significant bits: relative error at most half a unit, 2**-8
    finite = np.isfinite(values) & (values != 0)
    assert (np.abs(ours[finite] - values[finite]) <= np.abs(values[finite]) * 2**-8).all()


def test_bf16_activations_change_the_numbers_not_the_weights(seed):
    gen = np.random.default_rng(seed)
    config = small_config(gen)
    tokens = gen.integers(0, config.vocab_size, 24)
    fp32 = TinyQwen3Moe(config)
    bf16 = TinyQwen3Moe(TinyQwen3Config(**{**config.__dict__, "activation_dtype": "bfloat16"}))
    assert all((fp32.state_dict[n] == bf16.state_dict[n]).all() for n in fp32.state_dict)
    a, b = fp32.forward_full(tokens).logits, bf16.forward_full(tokens).logits
    assert (round_to_bf16(b) == b).all()                       # the engine's logits are bf16
    assert 0 < np.abs(a - b).max() < 0.1 * np.abs(a).max()


@pytest.mark.parametrize("bad, message", [
    (dict(activation_dtype="float16"), "activation_dtype"),
    (dict(num_attention_heads=3, num_key_value_heads=2), "multiple"),
    (dict(head_dim=7), "even"),
    (dict(top_k=0), "top_k"),
    (dict(num_layers=2, mlp_only_layers=(0, 1)), "mlp_only_layers"),
    (dict(mlp_only_layers=(99,)), "mlp_only_layers"),
])
def test_bad_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        TinyQwen3Config(**bad)
