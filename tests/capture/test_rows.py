"""capture/rows.py: EPLB physical -> logical, chunked MoE, per-modality expert groups.

Each piece against a NumPy reference on fresh inputs, then through the real 2.6 hook, the
step buffer and the host slot cache (``StepRoutingCapturer``).  FastDeploy's own code runs
around the same pieces in tests/fastdeploy_contract (test_eplb.py, test_chunked_moe.py,
test_models.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from fd_routing_replay.capture.device import save_routing_to_buffer_v2
from fd_routing_replay.capture.fd26 import StepRoutingCapturer
from fd_routing_replay.capture.rows import ExpertGroups, ExpertPlacement, MoEChunks, RowAssembler
from fd_routing_replay.capture.slots import HostSlotCache
from fdrr_dev.harness.paddle_runtime import paddle

LAYERS, TOP_K, SLOTS = 3, 4, 64


def tensor(array, dtype="int64"):
    return paddle.to_tensor(np.asarray(array).astype(dtype))


def placement_table(rng, layers, experts, redundant):
    """A table as FastDeploy's ``rebalance_experts`` lays it out: every expert once, the
    redundant slots replicas of random experts, slots shuffled; int32 [layers, slots]."""
    table = np.empty((layers, experts + redundant), np.int32)
    for layer in range(layers):
        table[layer] = rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, redundant)]))
    return table


# ----------------------------------------------------------------------------- EPLB
def test_placement_maps_each_layers_slots_through_its_own_row(seed):
    rng = np.random.default_rng(seed)
    table = placement_table(rng, 5, 250, 10)
    placement = ExpertPlacement(tensor(table, "int32"), rows=[1, -1, 3])      # hook layer 1: logical already
    physical = rng.integers(0, 260, (9, TOP_K))
    np.testing.assert_array_equal(placement.logical(tensor(physical), 0).numpy(), table[1][physical])
    np.testing.assert_array_equal(placement.logical(tensor(physical), 2).numpy(), table[3][physical])
    np.testing.assert_array_equal(placement.logical(tensor(physical), 1).numpy(), physical)
    np.testing.assert_array_equal(placement.logical(tensor(physical), 7).numpy(), physical)   # not in rows


def test_placement_reads_the_table_fastdeploy_updates_in_place(seed):
    """A rebalance (FastDeploy's update_expert_rank_table: copy_ into the same tensor) is
    seen by the next call; slots outside the table or unassigned (-1) come out -1."""
    rng = np.random.default_rng(seed)
    live = tensor(placement_table(rng, 2, 30, 6), "int32")
    placement = ExpertPlacement(live, rows=[0, 1])
    physical = rng.integers(0, 36, (12, TOP_K))
    before = placement.logical(tensor(physical), 1).numpy()
    rebalanced = placement_table(rng, 2, 30, 6)
    rebalanced[1, 5] = -1
    live.copy_(tensor(rebalanced, "int32"), True)
    physical[0] = [5, 36, -3, 0]
    after = placement.logical(tensor(physical), 1).numpy()
    expected = rebalanced[1][physical.clip(0, 35)]
    expected[0, 1:3] = -1
    np.testing.assert_array_equal(after, expected)
    assert not np.array_equal(before[1:], after[1:])


# ----------------------------------------------------------------------------- chunks
def split(rows, chunks):
    """paddle.tensor_split's sizes: the first n % chunks parts one row longer."""
    return [len(part) for part in np.array_split(np.arange(rows), chunks)]


def test_chunks_are_concatenated_in_order_and_empty_calls_ignored(seed):
    rng = np.random.default_rng(seed)
    chunks = MoEChunks()
    for tokens, parts, dummies in ((300, 3, 1), (7, 1, 3), (64, 4, 0)):
        rows = rng.integers(0, 64, (tokens, TOP_K))
        results = []
        start = 0
        for size in split(tokens, parts):
            results.append(chunks.add(tensor(rows[start:start + size]), 2, tokens))
            start += size
        results += [chunks.add(tensor(np.zeros((0, TOP_K))), 2, tokens) for _ in range(dummies)]
        assert all(r is None for r in results[:parts - 1] + results[parts:])
        np.testing.assert_array_equal(results[parts - 1].numpy(), rows)
    assert chunks.dropped == 0


def test_incomplete_chunks_are_dropped_never_joined_to_the_next_step(seed):
    rng = np.random.default_rng(seed)
    chunks = MoEChunks()
    rows = rng.integers(0, 64, (100, TOP_K))
    assert chunks.add(tensor(rows[:50]), 0, 100) is None
    chunks.end_step()                                  # the step's rows are offloaded
    assert chunks.dropped == 1
    assert chunks.add(tensor(rows[50:]), 0, 100) is None     # not completed by a stale half
    assert chunks.add(tensor(rows[:60]), 0, 120) is None     # other token count: the stale part goes
    assert chunks.dropped == 2
    too_many = chunks.add(tensor(rows[:70]), 0, 120)          # 130 rows for 120 tokens
    assert too_many.shape[0] == 130                           # returned: the recorder counts it


# ----------------------------------------------------------------------------- expert groups
def groups_for(types):
    """ExpertGroups over FastDeploy-style buffers for token types ``types`` (padded as the
    model's max_model_len buffers are, text_image_index_out's indices)."""
    width = 32
    token_types = np.full(width, -1, np.int32)
    token_types[: len(types)] = types
    text_index = np.full(width, 7, np.int32)        # stale values where the kernel does not write
    image_index = np.full(width, 9, np.int32)
    text_index[: len(types)][types == 0] = np.arange((types == 0).sum())
    image_index[: len(types)][types == 1] = np.arange((types == 1).sum())
    return ExpertGroups(text_experts=64, image_experts=32, token_types=tensor(token_types, "int32"),
                        text_index=tensor(text_index, "int32"), image_index=tensor(image_index, "int32"))


def run_layer(groups, types, text_rows, image_rows, layer=0):
    """The text MoE then the image MoE of one layer, as FastDeploy calls the hook."""
    out = [groups.add(tensor(text_rows), layer, len(types))]
    groups.image = True
    try:
        out.append(groups.add(tensor(image_rows), layer, len(types)))
    finally:
        groups.image = False
    return out


@pytest.mark.parametrize("case", ["mixed", "text only", "image only", "one image token"])
def test_groups_put_text_and_image_rows_back_in_token_order(seed, case):
    rng = np.random.default_rng(seed)
    n = {"mixed": 20, "text only": 9, "image only": 6, "one image token": 1}[case]
    types = {"mixed": rng.integers(0, 2, n), "text only": np.zeros(n, int),
             "image only": np.ones(n, int), "one image token": np.ones(1, int)}[case].astype(np.int32)
    if case == "mixed":
        types[:2] = [0, 1]
    text = rng.integers(0, 64, (max(int((types == 0).sum()), 1), TOP_K))   # >= 1 row (a dummy)
    image = rng.integers(0, 32, (int((types == 1).sum()), TOP_K))
    groups = groups_for(types)
    first, second = run_layer(groups, types, text, image)
    expected = np.empty((n, TOP_K), np.int64)
    expected[types == 0] = text[: (types == 0).sum()]
    expected[types == 1] = image + 64
    final = second if second is not None else first
    assert (first is None) == (len(text) < n)          # all text (or one token): recorded at once
    np.testing.assert_array_equal(final.numpy(), expected)
    assert groups.groups() == [{"name": "text", "first": 0, "count": 64},
                               {"name": "image", "first": 64, "count": 32}]


def test_image_rows_without_the_layers_text_rows_raise():
    groups = groups_for(np.array([0, 1], np.int32))
    groups.image = True
    with pytest.raises(ValueError, match="without the layer's text rows"):
        groups.add(tensor(np.zeros((1, TOP_K))), 0, 2)


def test_image_call_marks_the_image_group_and_rewraps_the_original():
    groups = groups_for(np.array([1], np.int32))
    seen = []

    def forward(x):
        seen.append(groups.image)
        return x

    wrapped = groups.image_call(forward)
    again = groups.image_call(wrapped)             # a second manager wraps FastDeploy's forward
    assert again.fdrr_original is forward
    assert again(3) == 3 and seen == [True] and groups.image is False


# ----------------------------------------------------------------------------- the hook
def capturer_with(assembler, experts):
    dtype = np.uint16 if experts >= 255 else np.uint8
    host = HostSlotCache(SLOTS, LAYERS, TOP_K, dtype, np.iinfo(dtype).max)
    capturer = StepRoutingCapturer(max_batched_tokens=32, num_moe_layers=LAYERS, top_k=TOP_K,
                                   num_experts=experts, attach_host=lambda: host)
    capturer.binding.assemble = capturer.step.assembler = assembler
    return capturer, host


def hook(capturer, ids, layer, total):
    save_routing_to_buffer_v2(device_routing_buffer=capturer.get_device_routing_buffer(),
                              topk_ids=tensor(ids), layer_idx=layer, tp_size=1, ep_size=1,
                              tp_group=None, total_token_num=total)


def finish_step(capturer, host, slots):
    mapping = np.full(32, -1, np.int64)
    mapping[: len(slots)] = slots
    capturer.prepare_pending_save(len(slots), paddle.to_tensor(mapping))
    capturer.flush_pending_save()
    return host.read(np.asarray(slots))


def test_the_hook_records_logical_ids_of_chunked_eplb_layers(seed):
    """EPLB + chunked MoE through save_routing_to_buffer_v2: two chunks and an empty call per
    layer, physical slots mapped by each layer's table row; a step whose layer 2 lost its
    second chunk stores that layer as unknown and the next step is exact again."""
    rng = np.random.default_rng(seed)
    table = placement_table(rng, 4, 300, 20)
    assembler = RowAssembler(placement=ExpertPlacement(tensor(table, "int32"), rows=[1, 2, 3]),
                             chunks=MoEChunks())
    capturer, host = capturer_with(assembler, 300)
    for step, lose in enumerate((False, True, False)):
        n = 11
        physical = rng.integers(0, 320, (n, LAYERS, TOP_K))
        for layer in range(LAYERS):
            cut = 6
            hook(capturer, physical[:cut, layer], layer, n)
            if not (lose and layer == 2):
                hook(capturer, physical[cut:, layer], layer, n)
            hook(capturer, np.zeros((0, TOP_K)), layer, n)
        rows = finish_step(capturer, host, list(range(step * n, step * n + n)))
        expected = np.stack([table[layer + 1][physical[:, layer]] for layer in range(LAYERS)], axis=1)
        if lose:
            expected[:, 2] = 65535
        np.testing.assert_array_equal(rows, expected)
        assert expected.max() > 256 or lose
    assert assembler.chunks.dropped == 1 and capturer.binding.errors == 0


def test_the_hook_records_expert_groups_in_one_id_space(seed):
    rng = np.random.default_rng(seed)
    types = rng.integers(0, 2, 13).astype(np.int32)
    types[:2] = [0, 1]
    groups = groups_for(types)
    capturer, host = capturer_with(RowAssembler(groups=groups), 96)
    text = rng.integers(0, 64, (LAYERS, int((types == 0).sum()), TOP_K))
    image = rng.integers(0, 32, (LAYERS, int((types == 1).sum()), TOP_K))
    for layer in range(LAYERS):
        hook(capturer, text[layer], layer, len(types))
        groups.image = True
        hook(capturer, image[layer], layer, len(types))
        groups.image = False
    rows = finish_step(capturer, host, list(range(len(types))))
    expected = np.empty((len(types), LAYERS, TOP_K), np.int64)
    expected[types == 0] = text.transpose(1, 0, 2)
    expected[types == 1] = image.transpose(1, 0, 2) + 64
    np.testing.assert_array_equal(rows, expected)
    assert capturer.binding.errors == 0 and capturer.binding.mismatches == 0
