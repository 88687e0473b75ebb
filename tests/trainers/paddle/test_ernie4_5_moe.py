"""Routing replay into PaddleFormers 1.2.0's own ERNIE-4.5-MoE (CPU, tiny random configs).

ERNIE's MoE layer (``MOEAllGatherLayerV2``) hands each token's expert ids and combine
weights to ``moe_gate_dispatch_partial_nosoftmaxtopk``, which Paddle 3.3.1 registers for
GPU only, as its combine op.  So the model's own code runs here up to that call: a
stand-in records the ids and weights the dispatch kernel is given — the routing the layer
applies — and stops the forward.  With replay on they are the record's ids (the live
choice where a position has no route) and the softmax of the gate's logits at them (the
probabilities before the correction bias, as the layer weighs); the gate weight gets a
gradient through the layer's all-gather.  ``expand_modality_expert_id`` (GPU/XPU only too)
runs as a CPU stand-in of the same semantics (standins.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("paddleformers", reason="PaddleFormers runs in its own environment: "
                    "`make trainer-paddle` (.venv-paddle)")

import paddle  # noqa: E402

from fd_routing_replay.codec import RoutingRecord  # noqa: E402
from fd_routing_replay.trainers.paddle import (  # noqa: E402
    PaddleRoutingReplay,
    moe_gates,
    moe_layers,
    padded_routes,
    replay_routing,
)
from tests.trainers.paddle.models import HIDDEN, VOCAB, tiny_ernie  # noqa: E402
from tests.trainers.paddle.standins import install_cpu_expand_modality_expert_id  # noqa: E402
from tests.trainers.records import make_record  # noqa: E402

install_cpu_expand_modality_expert_id()

LAYERS, TOP_K, EXPERTS = (1, 2, 3), 2, 8


class Dispatched(Exception):
    """Raised by the dispatch stand-in once it has recorded what it was given."""


@pytest.fixture
def dispatch(monkeypatch):
    """The calls the layer makes to its (GPU-only) dispatch kernel: ``(weights, ids)``."""
    from paddleformers.nn.moe import moe_allgather_layer

    calls: list[tuple[object, np.ndarray]] = []

    def record(x, combine_weights, expert_id, k, capacity, num_experts, *args, **kwargs):
        calls.append((combine_weights, expert_id.numpy().astype(np.int64)))
        raise Dispatched

    monkeypatch.setattr(moe_allgather_layer, "moe_gate_dispatch_partial_nosoftmaxtopk", record)
    return calls


@pytest.fixture(scope="module")
def model():
    return tiny_ernie(seed=2)


class LogitsProbe:
    """The logits each MoE layer's gate returned (its output 0)."""

    def __init__(self, model) -> None:
        self.logits: dict[int, np.ndarray] = {}
        self.hooks = [gate.module.gate.register_forward_post_hook(self._grab(gate.layer))
                      for gate in moe_gates(model)]

    def _grab(self, layer):
        def grab(module, inputs, outputs):
            self.logits[layer] = outputs[0].detach().numpy().astype(np.float64)
        return grab

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def softmax(logits: np.ndarray) -> np.ndarray:
    scores = np.exp(logits - logits.max(axis=1, keepdims=True))
    return scores / scores.sum(axis=1, keepdims=True)


def live_choice(block, logits: np.ndarray) -> np.ndarray:
    """ERNIE's own choice, independently: top-k of softmax + the correction bias, as sets."""
    biased = softmax(logits) + block.moe_statics.e_score_correction_bias.numpy()[0]
    return np.sort(np.argsort(-biased, axis=1)[:, :TOP_K], axis=1)


def run_block(block, hidden: np.ndarray):
    """One MoE block's forward up to its dispatch (a non-leaf input: the layer's all-gather
    refuses a leaf that needs a gradient)."""
    source = paddle.to_tensor(hidden)
    source.stop_gradient = False
    with pytest.raises(Dispatched):
        block(source * 1.0)


def test_the_model_has_the_seams_the_replay_swaps(model):
    from paddleformers.nn.moe.moe_allgather_layer import MOEAllGatherLayerV2

    gates = moe_gates(model)
    assert moe_layers(model) == LAYERS and {g.family.name for g in gates} == {"ERNIE-4.5-MoE"}
    assert all(g.top_k == TOP_K and g.num_experts == EXPERTS for g in gates)
    assert "fused_gate_logits_process_fused" in vars(MOEAllGatherLayerV2)


def test_every_block_dispatches_the_recorded_experts_with_the_live_weights(model, dispatch,
                                                                          seed):
    gen = np.random.default_rng(seed)
    tokens = 9
    record = make_record(gen, tokens=tokens, layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS,
                         unrouted=(4,))
    blocks = {gate.layer: gate.module for gate in moe_gates(model)}
    model.clear_gradients()
    probe = LogitsProbe(model)
    try:
        with replay_routing(model, record.ids) as replay:     # uint8, 255 = no route
            for row, layer in enumerate(LAYERS):
                run_block(blocks[layer], gen.normal(size=(tokens, HIDDEN)).astype("float32"))
                weights, ids = dispatch[-1]
                (weights * paddle.to_tensor(gen.normal(size=weights.shape).astype("float32"))
                 ).sum().backward()
                routed = np.arange(tokens) != 4
                assert (ids[routed] == record.ids[row][routed]).all(), layer
                assert (np.sort(ids[~routed], axis=1) ==
                        live_choice(blocks[layer], probe.logits[layer][~routed])).all()
                np.testing.assert_allclose(
                    weights.numpy(), np.take_along_axis(softmax(probe.logits[layer]), ids, 1),
                    rtol=1e-5, atol=1e-7)
                gate_weight = blocks[layer].gate.weight
                assert gate_weight.grad is not None and float(gate_weight.grad.abs().sum()) > 0
                assert (np.sort(ids[routed], axis=1) !=
                        live_choice(blocks[layer], probe.logits[layer][routed])).any()
    finally:
        probe.remove()
    assert replay.calls == dict.fromkeys(LAYERS, 1)
    assert all("fused_gate_logits_process_fused" not in vars(b) for b in blocks.values())


def test_a_model_forward_reaches_the_first_moe_layer_in_batch_major_order(model, dispatch,
                                                                         seed):
    """Through the model: its first MoE layer (decoder layer 1) gets row 0 of the padded
    routes, tokens flattened ``b * S + s``."""
    gen = np.random.default_rng(seed)
    width = 7
    batch = [make_record(gen, f"exp_e:{i}:0", tokens=n - 1, layers=LAYERS, top_k=TOP_K,
                         num_experts=EXPERTS) for i, n in enumerate([7, 5])]
    mask = np.array([[1] * 7, [1] * 5 + [0] * 2])
    routes = padded_routes(batch, mask)
    with pytest.raises(Dispatched), replay_routing(model, routes):
        model(input_ids=paddle.to_tensor(gen.integers(0, VOCAB, (2, width))))
    _, ids = dispatch[-1]
    valid = routes.valid[0]
    assert valid.sum() == 6 + 4 and (ids[valid] == routes.ids[0][valid]).all()
    assert (ids[:6] == batch[0].ids[0]).all() and (ids[7:11] == batch[1].ids[0]).all()


def test_replaying_the_live_choice_gives_the_live_weights(model, dispatch, seed):
    gen = np.random.default_rng(seed)
    hidden = gen.normal(size=(6, HIDDEN)).astype("float32")
    block = model.model.layers[2].mlp
    run_block(block, hidden)
    live_weights, live_ids = dispatch[-1]
    chosen = np.zeros((3, 6, TOP_K), dtype=np.int64)
    chosen[1] = live_ids
    with replay_routing(model, chosen):
        run_block(block, hidden)
    weights, ids = dispatch[-1]
    assert (ids == live_ids).all()
    np.testing.assert_array_equal(weights.numpy(), live_weights.numpy())


def test_mismatches_and_unsupported_layers_are_refused(model, dispatch, seed):
    gen = np.random.default_rng(seed)
    good = make_record(gen, tokens=6, layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS)
    for count in (4, 16):
        other = RoutingRecord("exp_x:0:0", good.ids % 4, count, layers=LAYERS)
        with pytest.raises(ValueError, match=rf"recorded with {count} experts.*has 8"):
            PaddleRoutingReplay(model, other)
    for layers in ((1, 2), (0, 1, 2, 3)):
        wrong = make_record(gen, tokens=6, layers=layers, top_k=TOP_K, num_experts=EXPERTS)
        with pytest.raises(ValueError, match=re.escape(f"decoder layers {list(layers)})")):
            PaddleRoutingReplay(model, wrong)
    with pytest.raises(ValueError, match="routes 5 tokens.*routes hold 7"), \
            replay_routing(model, good):
        model.model.layers[1].mlp(paddle.to_tensor(gen.normal(size=(5, HIDDEN))
                                                   .astype("float32")) * 1.0)
    grouped = tiny_ernie(seed=3, moe_group_experts=True, moe_use_aux_free=False)
    with pytest.raises(ValueError, match="grouped experts"):
        PaddleRoutingReplay(grouped, good).install()
    assert all("fused_gate_logits_process_fused" not in vars(g.module)
               for g in moe_gates(grouped))
