"""Routing replay into PaddleFormers 1.2.0's own DeepSeek-V3 (CPU, tiny random configs).

With replay on, every expert of every MoE block processes exactly the tokens the record
routes to it (found by matching the rows each expert receives against the block's input),
the weights are an independent NumPy recomputation of DeepSeek-V3's rule at those experts,
the router weights get a gradient, and mismatched routes are refused.  The expert-parallel
gate (``MoEGate``, DeepSeek-V3 under EP > 1) is checked on its own: its EP layer needs a
multi-rank expert-parallel group.
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
    packed_routes,
    padded_routes,
    replay_routing,
    sequence_parallel_routes,
)
from tests.trainers.paddle.models import (  # noqa: E402
    HIDDEN,
    VOCAB,
    ExpertProbe,
    tiny_deepseek_v3,
)
from tests.trainers.records import make_record  # noqa: E402

LAYERS, TOP_K, EXPERTS = (1, 2, 3), 2, 8


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_v3(seed=3)


def blocks_of(model) -> dict[int, object]:
    return {gate.layer: model.model.layers[gate.layer].mlp for gate in moe_gates(model)}


def records(gen, lengths, prefix="exp_ds"):
    return [make_record(gen, f"{prefix}:{i}:0", tokens=n - 1, layers=LAYERS, top_k=TOP_K,
                        num_experts=EXPERTS) for i, n in enumerate(lengths)]


class GateProbe:
    """What each router got (its hidden states) and returned (ids, weights)."""

    def __init__(self, model) -> None:
        self.hidden, self.ids, self.weights = {}, {}, {}
        self.hooks = []
        for gate in moe_gates(model):
            self.hooks.append(gate.module.register_forward_pre_hook(self._pre(gate.layer)))
            self.hooks.append(gate.module.register_forward_post_hook(self._post(gate.layer)))

    def _pre(self, layer):
        def grab(module, inputs):
            self.hidden[layer] = inputs[0].detach().numpy().reshape(-1, HIDDEN)
        return grab

    def _post(self, layer):
        def grab(module, inputs, outputs):
            self.ids[layer] = outputs[0].numpy().astype(np.int64)
            self.weights[layer] = outputs[1].detach().numpy()
        return grab

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def reference_weights(gate, hidden: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's weights at ``ids``, in float64: sigmoid of the router logits (no
    correction bias), renormalised (+ 1e-20) when norm_topk_prob, times the scaling factor."""
    logits = hidden.astype(np.float64) @ gate.weight.numpy().astype(np.float64)
    scores = np.take_along_axis(1 / (1 + np.exp(-logits)), ids, axis=1)
    if gate.norm_topk_prob:
        scores = scores / (scores.sum(axis=1, keepdims=True) + 1e-20)
    return scores * gate.routed_scaling_factor


def expected_tokens(ids: np.ndarray) -> dict[int, set[int]]:
    """Expert -> token rows that ``ids [tokens, K]`` send to it."""
    return {e: set(np.flatnonzero((ids == e).any(axis=1)).tolist()) for e in range(EXPERTS)}


def test_the_model_has_the_seams_the_replay_swaps(model):
    gates = moe_gates(model)
    assert moe_layers(model) == LAYERS and {g.family.name for g in gates} == {"DeepSeek-V3"}
    assert all(g.top_k == TOP_K and g.num_experts == EXPERTS for g in gates)
    from paddleformers.transformers.deepseek_v3.modeling import DeepseekV3TopkRouter

    assert "get_topk_indices" in vars(DeepseekV3TopkRouter)


def test_padded_batch_every_expert_processes_its_recorded_tokens(model, seed):
    gen = np.random.default_rng(seed)
    width, lengths = 9, [9, 6, 4]
    batch = records(gen, lengths)
    mask = np.zeros((3, width), dtype=np.int64)
    mask[0] = 1
    mask[1, :6] = 1                                 # right padding
    mask[2, width - 4:] = 1                         # left padding
    input_ids = paddle.to_tensor(gen.integers(0, VOCAB, (3, width)))
    model.clear_gradients()
    probe, gates = ExpertProbe(blocks_of(model)), GateProbe(model)
    try:
        with replay_routing(model, padded_routes(batch, mask)) as replay:
            loss = model(input_ids=input_ids, attention_mask=paddle.to_tensor(mask),
                         labels=input_ids)[0]
            loss.backward()
    finally:
        probe.remove()
        gates.remove()
    live_probe = GateProbe(model)                  # the same batch, routed live
    try:
        with paddle.no_grad():
            model(input_ids=input_ids, attention_mask=paddle.to_tensor(mask))
    finally:
        live_probe.remove()
    assert replay.calls == dict.fromkeys(LAYERS, 1)
    for row, layer in enumerate(LAYERS):
        expected = live_probe.ids[layer].reshape(3, width, TOP_K).copy()   # live where unrouted
        for b, record in enumerate(batch):
            routed = np.flatnonzero(mask[b])[:record.num_tokens]   # all but the last token
            expected[b, routed] = record.ids[row]
        expected = expected.reshape(-1, TOP_K)
        assert (gates.ids[layer] == expected).all(), layer
        assert probe.tokens_of_experts(layer) == expected_tokens(expected), layer
        gate = moe_gates(model)[row].module
        np.testing.assert_allclose(gates.weights[layer],
                                   reference_weights(gate, gates.hidden[layer], expected),
                                   rtol=1e-5, atol=1e-6)
        assert gate.weight.grad is not None and float(gate.weight.grad.abs().sum()) > 0
    # The record differs from what the routers pick live: the test sees the replay.
    live = np.stack([live_probe.ids[layer] for layer in LAYERS])
    replayed = np.stack([gates.ids[layer] for layer in LAYERS])
    assert (np.sort(live, axis=2) != np.sort(replayed, axis=2)).any()


def test_replaying_the_live_choice_reproduces_the_live_forward(model, seed):
    """The family's own code weighs the replayed ids: replaying what the model chose
    (bias and group limit included) gives its forward exactly."""
    input_ids = paddle.to_tensor(np.random.default_rng(seed).integers(0, VOCAB, (2, 7)))
    gates = GateProbe(model)
    try:
        with paddle.no_grad():
            live = model(input_ids=input_ids)[0].numpy()
            chosen = np.stack([gates.ids[layer] for layer in LAYERS])
            with replay_routing(model, chosen):
                again = model(input_ids=input_ids)[0].numpy()
    finally:
        gates.remove()
    assert np.array_equal(again, live)


def test_packed_row_routes_each_sequence_its_record(model, seed):
    gen = np.random.default_rng(seed)
    lengths = [5, 8, 3]
    batch = records(gen, lengths)
    position_ids = np.concatenate([np.arange(n) for n in lengths])[None]
    routes = packed_routes(batch, position_ids=position_ids)
    gates = GateProbe(model)
    try:
        with paddle.no_grad(), replay_routing(model, routes):
            model(input_ids=paddle.to_tensor(gen.integers(0, VOCAB, (1, sum(lengths)))))
    finally:
        gates.remove()
    starts = np.cumsum([0] + lengths)
    for row, layer in enumerate(LAYERS):
        for record, start in zip(batch, starts[:-1], strict=True):
            assert (gates.ids[layer][start:start + record.num_tokens] == record.ids[row]).all()


class OneLayer(paddle.nn.Layer):
    """A model of one MoE block or gate, as decoder layer ``index`` (``layers.<index>``)."""

    def __init__(self, index: int, name: str, layer) -> None:
        super().__init__()
        self.layers = paddle.nn.LayerList([paddle.nn.Layer() for _ in range(index + 1)])
        setattr(self.layers[index], name, layer)
        self.inner = layer

    def forward(self, hidden):
        return self.inner(hidden)


@pytest.mark.parametrize("order", ["bs", "sb"])
def test_a_sequence_parallel_rank_replays_its_share(model, seed, order):
    """Each SP rank's block sees its contiguous share of the flattened batch, ``[B·S]``
    (PaddleFormers) or ``[S·B]`` (Megatron-style): it replays exactly those tokens' routes."""
    gen = np.random.default_rng(seed)
    batch_size, width, sp = 2, 6, 3
    batch = records(gen, [width] * batch_size)
    whole = padded_routes(batch, np.ones((batch_size, width)), layers=(2,))
    hidden = gen.normal(size=(batch_size, width, HIDDEN)).astype("float32")
    flat = hidden.reshape(-1, HIDDEN) if order == "bs" else \
        hidden.transpose(1, 0, 2).reshape(-1, HIDDEN)
    token_of = np.arange(batch_size * width).reshape(batch_size, width)
    token_of = token_of.reshape(-1) if order == "bs" else token_of.T.reshape(-1)
    share = batch_size * width // sp
    one = OneLayer(2, "mlp", model.model.layers[2].mlp)
    for rank in range(sp):
        mine = sequence_parallel_routes(whole, sp, rank, batch_size=batch_size, order=order)
        gates = GateProbe(one)
        try:
            with paddle.no_grad(), replay_routing(one, mine) as replay:
                one(paddle.to_tensor(flat[rank * share:(rank + 1) * share]))
        finally:
            gates.remove()
        rows, positions = np.divmod(token_of[rank * share:(rank + 1) * share], width)
        routed = positions < width - 1                          # the last token has no route
        expected = np.stack([batch[b].ids[1][s] for b, s in
                             zip(rows[routed], positions[routed], strict=True)])
        assert (gates.ids[2][routed] == expected).all(), rank
        assert replay.calls == {2: 1}


def test_expert_parallel_gate_replays_through_topkgating_nodrop(model, seed):
    """``MoEGate`` (DeepSeek-V3 under EP > 1): the routing map holds exactly the recorded
    experts and the combine weights are the scores there over their sum, scaled (sigmoid or
    softmax scores); the gate weight gets a gradient.  Only ``noaux_tc`` runs: 1.2.0's
    ``MoEGate.forward`` updates ``expert_usage``, which ``__init__`` creates for
    ``noaux_tc`` only (deepseek_v3/modeling.py:284-296)."""
    import copy

    from paddleformers.transformers.deepseek_v3.modeling import MoEGate

    gen = np.random.default_rng(seed)
    for method, scoring in (("noaux_tc", "sigmoid"), ("noaux_tc", "softmax")):
        config = copy.deepcopy(model.config)
        config.topk_method, config.scoring_func = method, scoring
        gate = MoEGate(config, num_experts=EXPERTS, expert_hidden_size=HIDDEN, top_k=TOP_K,
                       topk_method=method, n_group=2, topk_group=1, norm_topk_prob=True,
                       routed_scaling_factor=2.5)
        gate.weight.set_value(gen.normal(size=gate.weight.shape).astype("float32"))
        gate.e_score_correction_bias.set_value(gen.normal(0, 0.5, EXPERTS).astype("float32"))
        one = OneLayer(1, "gate", gate)
        record = make_record(gen, tokens=10, layers=(1,), top_k=TOP_K, num_experts=EXPERTS)
        hidden = gen.normal(size=(2, 5, HIDDEN)).astype("float32")
        with replay_routing(one, record.ids, layers=(1,)) as replay:
            assert "_topk_" + method in vars(gate)
            combine, routing_map, _, _ = one(paddle.to_tensor(hidden))
            (combine * paddle.to_tensor(gen.normal(size=combine.shape).astype("float32"))
             ).sum().backward()
        assert replay.calls == {1: 1} and "_topk_" + method not in vars(gate)
        ids = record.ids[0].astype(np.int64)
        want_map = np.zeros((10, EXPERTS), dtype=bool)
        np.put_along_axis(want_map, ids, True, axis=1)
        assert ((routing_map.numpy() != 0) == want_map).all(), method
        logits = hidden.reshape(-1, HIDDEN).astype(np.float64) @ gate.weight.numpy()
        if scoring == "sigmoid":
            scores = 1 / (1 + np.exp(-logits))
        else:
            scores = np.exp(logits - logits.max(axis=1, keepdims=True))
            scores /= scores.sum(axis=1, keepdims=True)
        at_ids = np.take_along_axis(scores, ids, axis=1)
        want = np.zeros((10, EXPERTS))
        np.put_along_axis(want, ids, at_ids / at_ids.sum(axis=1, keepdims=True) * 2.5, axis=1)
        np.testing.assert_allclose(combine.numpy(), want, rtol=1e-5, atol=1e-6)
        assert float(gate.weight.grad.abs().sum()) > 0, method


def test_mismatched_routes_are_refused_naming_both_sides(model, seed):
    gen = np.random.default_rng(seed)
    good = records(gen, [7])[0]
    for count in (4, 16):                                  # another expert count
        other = RoutingRecord("exp_x:0:0", good.ids % 4, count, layers=LAYERS)
        with pytest.raises(ValueError, match=rf"recorded with {count} experts.*has 8"):
            PaddleRoutingReplay(model, other)
    for tokens in (6, 8, 12):                  # one row too long, one and five too short
        with pytest.raises(ValueError, match=rf"6 routed positions.*{tokens} tokens"):
            packed_routes([good], seq_lens=[tokens])
    for layers in ((1, 2), (0, 1, 2, 3), (0, 1, 2)):        # wrong layer count or map
        wrong = make_record(gen, tokens=6, layers=layers, top_k=TOP_K, num_experts=EXPERTS)
        with pytest.raises(ValueError, match=re.escape(f"decoder layers {list(layers)})") +
                           r".*decoder layers \[1, 2, 3\]"):
            PaddleRoutingReplay(model, wrong)
    with pytest.raises(ValueError, match="top_k 3.*top_k 2"):
        PaddleRoutingReplay(model, np.zeros((3, 7, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="outside the gate's 8 experts"):
        PaddleRoutingReplay(model, np.full((3, 7, 2), 8, dtype=np.int64))
    with pytest.raises(ValueError, match="routes 10 tokens.*routes hold 7"), \
            paddle.no_grad(), replay_routing(model, good):
        model(input_ids=paddle.zeros([1, 10], dtype="int64"))


def test_a_block_that_skips_its_gate_is_refused_and_the_seams_come_off(model, seed, monkeypatch):
    gen = np.random.default_rng(seed)
    record = records(gen, [6])[0]
    block = model.model.layers[3].mlp
    monkeypatch.setattr(block, "forward", lambda hidden_states: hidden_states * 0)
    with pytest.raises(RuntimeError, match=r"decoder layers \[3\] did not run"), \
            paddle.no_grad(), replay_routing(model, record):
        model(input_ids=paddle.to_tensor(gen.integers(0, VOCAB, (1, 6))))
    monkeypatch.undo()
    assert all("get_topk_indices" not in vars(g.module) for g in moe_gates(model))


def test_mtp_layers_route_live(seed):
    """DeepSeek-V3's multi-token-prediction layers (decoder index >= num_hidden_layers) are
    not in a record: their gates keep routing live while the others replay."""
    model = tiny_deepseek_v3(seed=5, num_nextn_predict_layers=1)
    assert moe_layers(model) == LAYERS
    gen = np.random.default_rng(seed)
    record = records(gen, [7])[0]
    replay = PaddleRoutingReplay(model, record)
    assert replay.live_gates == ["model.layers.4.mlp.gate"]
    replay.install()
    try:
        assert "get_topk_indices" not in vars(model.model.layers[4].mlp.gate)
        assert all("get_topk_indices" in vars(g.module) for g in replay.gates)
    finally:
        replay.remove()
