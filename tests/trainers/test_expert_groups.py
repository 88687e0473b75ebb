"""Records with expert groups (ERNIE-4.5-VL's text and image experts in one id space):
the metadata's validation, and every trainer adapter reading one group at a time --
Megatron-Core, verl, and the Hugging Face replay into transformers' own ERNIE-4.5-VL MoE
modeling code (its text and vision routers, each on its modality's tokens)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, decode_record, encode_record
from fd_routing_replay.codec.groups import ExpertGroup, expert_groups
from fd_routing_replay.errors import RecordError
from fd_routing_replay.trainers import routes
from fd_routing_replay.trainers.megatron import build_megatron_replay
from fd_routing_replay.trainers.verl import to_verl_routed_experts

TEXT, IMAGE, TOP_K = 8, 8, 2
GROUPS = [{"name": "text", "first": 0, "count": TEXT}, {"name": "image", "first": TEXT, "count": IMAGE}]


def vl_record(rng, image: np.ndarray, layers=(1, 2), rollout_id="vl_exp:0:0", unrouted=()):
    """A record as the plugin writes one for ERNIE-4.5-VL: image tokens' rows in
    ``[TEXT, TEXT + IMAGE)``, text tokens' in ``[0, TEXT)``; ``unrouted`` positions hold the fill."""
    tokens = len(image)
    ids = np.empty((len(layers), tokens, TOP_K), np.uint8)
    for layer in range(len(layers)):
        for t in range(tokens):
            base, count = (TEXT, IMAGE) if image[t] else (0, TEXT)
            ids[layer, t] = base + rng.choice(count, TOP_K, replace=False)
    for t in unrouted:
        ids[:, t] = 255
    return RoutingRecord(rollout_id, ids, TEXT + IMAGE, 255, {"expert_groups": GROUPS}, layers=layers)


def test_groups_survive_encoding_and_malformed_ones_are_refused(seed):
    rng = np.random.default_rng(seed)
    record = decode_record(encode_record(vl_record(rng, np.array([0, 1, 1, 0], bool))))
    assert expert_groups(record) == (ExpertGroup("text", 0, TEXT), ExpertGroup("image", TEXT, IMAGE))
    for bad in ([GROUPS[0]], [GROUPS[1], GROUPS[0]], [GROUPS[0], dict(GROUPS[1], count=7)],
                [GROUPS[0], dict(GROUPS[1], name="text")], [GROUPS[0], dict(GROUPS[1], extra=1)]):
        broken = RoutingRecord("x:0:0", record.ids.copy(), TEXT + IMAGE, 255, {"expert_groups": bad},
                               layers=record.layers)
        with pytest.raises(RecordError, match="expert_groups"):
            expert_groups(broken)


def test_routes_are_read_one_group_at_a_time(seed):
    rng = np.random.default_rng(seed)
    image = rng.random(11) < 0.4
    image[:2] = [False, True]
    record = vl_record(rng, image, unrouted=(3,))
    with pytest.raises(ValueError, match=r"expert groups \['text', 'image'\].*expert_group="):
        routes(record)
    with pytest.raises(ValueError, match="no expert group 'video'; its groups are"):
        routes(record, expert_group="video")
    for name, mine, first in (("text", ~image, 0), ("image", image, TEXT)):
        ids, valid = routes(record, expert_group=name)
        expected = mine.copy()
        expected[3] = False                                   # the fill: never valid
        assert (valid == expected[None, :]).all()
        np.testing.assert_array_equal(ids[:, expected], record.ids[:, expected].astype(np.int64) - first)
        assert (ids[:, ~expected] == np.arange(TOP_K)).all()      # placeholders
    plain = RoutingRecord("p:0:0", record.ids.copy(), TEXT + IMAGE, 255, {}, layers=record.layers)
    with pytest.raises(ValueError, match="its experts are one group"):
        routes(plain, expert_group="text")


def test_megatron_and_verl_take_a_group(seed):
    rng = np.random.default_rng(seed)
    images = [rng.random(n) < 0.5 for n in (7, 5)]
    records = [vl_record(rng, image, rollout_id=f"vl:{i}:0") for i, image in enumerate(images)]
    with pytest.raises(ValueError, match="expert_group="):
        build_megatron_replay(records, (1, 2))
    replay = build_megatron_replay(records, (1, 2), expert_group="image")
    column = 0
    for record, image in zip(records, images, strict=True):
        n = record.num_tokens
        for row in range(2):
            block = replay.topk[row][column:column + n]
            np.testing.assert_array_equal(block[image], record.ids[row][image].astype(np.int64) - TEXT)
            assert (block.max() < IMAGE) and (replay.mask[row, column:column + n] == image).all()
        column += n + 1                                     # the last token has no route
    verl = to_verl_routed_experts(records, [3, 2], max_prompt_length=4, max_response_length=6,
                                  expert_group="text")
    for i, (record, image) in enumerate(zip(records, images, strict=True)):
        start = 4 - (3, 2)[i]
        got = verl.routed_experts[i, start:start + record.num_tokens]             # [T, L, K]
        np.testing.assert_array_equal(got[~image].transpose(1, 0, 2), record.ids[:, ~image])
        assert (verl.routed_mask[i, start:start + record.num_tokens] == ~image).all()
        assert (got[image] == 0).all()                        # the other group's tokens: unrouted


# ----------------------------------------------------------------------------- Hugging Face
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_vl_text_model(seed: int):
    """transformers' ERNIE-4.5-VL MoE decoder (``Ernie4_5_VLMoeTextModel``): layer 0 dense,
    layers 1-2 a text and a vision MoE each (8 experts, top-2)."""
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeTextConfig,
    )

    torch.manual_seed(seed)
    config = Ernie4_5_VLMoeTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, moe_intermediate_size=[16, 16], moe_num_experts=TEXT, moe_k=TOP_K,
        moe_num_shared_experts=0, max_position_embeddings=64, mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    config._attn_implementation = "eager"
    model = modeling.Ernie4_5_VLMoeTextModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    return model.train()


def dispatched(model):
    """What each MoE's experts were called with (their ``top_k_index``), per (layer, group)."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if type(module).__name__ == "Ernie4_5_VLMoeMoeExperts":
            key = (int(name.split(".")[1]), "image" if "vision_moe" in name else "text")
            handles.append(module.register_forward_hook(
                lambda m, args, out, key=key: seen.__setitem__(key, args[1].detach().numpy().copy())))
    return seen, handles


def test_hf_grouped_replay_dispatches_each_modality_its_group(seed):
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling

    from fd_routing_replay.trainers.hf.groups import SIGNATURES, replay_grouped_routing
    from fd_routing_replay.trainers.hf.routes import packed_routes
    for class_name, recorded in SIGNATURES:
        assert str(inspect.signature(getattr(modeling, class_name).forward)) == recorded
    rng = np.random.default_rng(seed)
    model = tiny_vl_text_model(seed % 1000)
    image = np.zeros(10, bool)
    image[2:6] = True                                      # the image's placeholder tokens
    record = vl_record(rng, image[:-1])                    # tokens - 1 forwarded positions
    text_routes = packed_routes([record], expert_group="text")
    image_routes = packed_routes([record], expert_group="image")
    types = torch.from_numpy(image.astype(np.int32)).reshape(1, -1)
    seen, handles = dispatched(model)
    try:
        with replay_grouped_routing(model, {"text": text_routes, "image": image_routes}) as replay:
            out = model(input_ids=torch.randint(0, 64, (1, 10)), moe_mm_token_type_ids=types)
            out.last_hidden_state.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert all(calls == 1 for calls in replay.calls.values()) and len(replay.calls) == 4
    for row, layer in enumerate((1, 2)):
        text_ids, image_ids = seen[(layer, "text")], seen[(layer, "image")]
        positions = np.arange(10)
        text_positions, image_positions = positions[~image], positions[image]
        routed_text = text_positions < 9                   # the last token has no route
        np.testing.assert_array_equal(text_ids[routed_text], record.ids[row][text_positions[routed_text]])
        np.testing.assert_array_equal(image_ids, record.ids[row][image_positions].astype(np.int64) - TEXT)
    for name, param in model.named_parameters():
        if name.endswith("gate.weight"):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    # The batch gives token 3 to text while the record routed it through the image experts.
    wrong = types.clone()
    wrong[0, 3] = 0
    with pytest.raises(ValueError, match="token 3 was routed through the 'image' experts"):
        with replay_grouped_routing(model, {"text": text_routes, "image": image_routes}):
            model(input_ids=torch.randint(0, 64, (1, 10)), moe_mm_token_type_ids=wrong)
    with pytest.raises(ValueError, match=r"no routes for the expert group\(s\) \['image'\]"):
        replay_grouped_routing(model, {"text": text_routes}).__enter__()
