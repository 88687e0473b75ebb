"""One rank of a multi-process contract test (started by ``paddle.distributed.launch``).

Runs FastDeploy's own code on every rank: its distributed start-up
(``init_distributed_environment``, worker_process.py:115-136 in 2.6), its rank arithmetic
(worker_process.py:1190-1211), its communication groups (``ParallelConfig.
set_communicate_group``, config.py:721-738), ``GpuWorker.initialize_cache`` (which installs
our manager), ``FusedMoE.forward`` (which binds our hook with ``tp_size``, ``ep_size`` and
the real ``tp_group``), and ``post_process_normal`` (whose routing block is gated on
``tp_rank == 0`` in 2.6, pre_and_post_process.py:337-343).  Each rank's MoE input is its
own share of the step's tokens, split as FastDeploy splits it:

* TP only: every TP rank holds all tokens (attention TP; moe.py:780-786, forward_normal);
* TP x EP with sequence-parallel MoE (the default, config.py:714-718): the first MoE
  layer's input norm splits the tokens, ``ceil(n / tp)`` per rank, the last share
  zero-padded (``RMSNorm.split``, normalization.py:172-190);
* TP x EP without it (``disable_sequence_parallel_moe``): ``FusedMoE.forward_split_allgather``
  splits the same way inside the layer (moe.py:701-728, taken at moe.py:769-777);
* then the hook all-gathers over the TP group and slices to ``total_token_num``
  (``forward_meta.batch_id_per_token.shape[0]``, moe.py:756; routing_indices_cache.py:80-86).

The MoE gate is a stand-in whose scores are a fixed function of the token (column 0 of
the hidden state is the token's key, 0 for padding rows), so the parent process computes
the same top-k with numpy.  Usage: ``parallel_rank.py SPEC.json``; results land in the
spec's ``out_dir`` (``rank{N}.json``, ``rank{N}.npz``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fdrr_dev.testing import fastdeploy_standins as standins  # noqa: E402

standins.install()
if os.environ.get("FD_SOURCE_DIR"):
    sys.path.insert(0, os.environ["FD_SOURCE_DIR"])

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import parallel_spec  # noqa: E402
from fastdeploy.worker.worker_process import init_distributed_environment  # noqa: E402


class KeyGate(paddle.nn.Layer):
    """Scores of a token = row ``key`` of a fixed per-layer table (key 0: padding)."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = table

    def forward(self, x):
        keys = x[:, 0].numpy().astype(np.int64)
        return paddle.to_tensor(self.table[keys])


class Fault:
    """Makes the bound recorder raise once at (step, layer): the hook's failure path."""

    def __init__(self, binding, faults, step_ref) -> None:
        self.binding, self.faults, self.step_ref = binding, faults, step_ref
        self.inner = binding.record

    def __call__(self, topk_ids, layer_idx, num_tokens):
        if (self.step_ref[0], int(layer_idx)) in self.faults:
            raise RuntimeError(f"injected hook failure at step {self.step_ref[0]} layer {layer_idx}")
        return self.inner(topk_ids, layer_idx, num_tokens)


def moe_layer(fd_config, layer_idx, quant):
    """``fdctx.make_moe_layer`` with the parallel attributes FusedMoE.__init__ sets
    (moe.py:209-221 in 2.6): EP forces the MoE's own tp_size to 1; attention keeps TP."""
    import fdctx

    layer = fdctx.make_moe_layer(fd_config, layer_idx, quant)
    pc = fd_config.parallel_config
    layer.tp_rank, layer.tp_size = pc.tensor_parallel_rank, pc.tensor_parallel_size
    layer.ep_size, layer.ep_rank = pc.expert_parallel_size, pc.expert_parallel_rank
    layer.tp_group = pc.tp_group
    if layer.ep_size > 1:
        layer.tp_size, layer.tp_rank = 1, 0
    layer.attn_tp_size, layer.attn_tp_rank = pc.tensor_parallel_size, pc.tensor_parallel_rank
    return layer


def eplb_setup(spec, fd_config):
    """EPLB on this rank: FastDeploy's RedundantExpertManger shared by the MoE layers, its
    EPRunner.moe_select through the stand-in moe_redundant_topk_select (unsigned draw: every
    slot a replica of the chosen expert, so records compare with the router row by row)."""
    import importlib

    import eplbctx
    from cpu_kernels import RedundantTopkSelect

    kernel = RedundantTopkSelect(signed_draw=False)
    importlib.import_module("fastdeploy.model_executor.ops.gpu").moe_redundant_topk_select = kernel
    quant = eplbctx.EplbExperts(fd_config.model_config.moe_k, kernel)

    class Placement(SimpleNamespace):
        def table(self):
            return self.manager.model_ep_rank_to_expert_id_list.numpy().copy()

        def rebalance(self, rng):
            eplbctx.EplbModel.rebalance(self, rng)

    model = Placement()
    from fastdeploy.worker.experts_manager import RedundantExpertManger

    pc = fd_config.parallel_config
    model.manager = RedundantExpertManger(
        n_routed_experts=fd_config.model_config.moe_num_experts, num_hidden_layers=fd_config.model_config.num_hidden_layers,
        redundant_experts_num=spec["eplb"]["redundant"], ep_size=pc.expert_parallel_size)
    return SimpleNamespace(quant=quant, manager=model.manager, model=model, kernel=kernel)


def sequence_parallel_split(fd_config, x):
    """FastDeploy's own token split of the first MoE layer's input norm (RMSNorm.split)."""
    from fastdeploy.model_executor.layers.normalization import RMSNorm

    pc = fd_config.parallel_config
    tp, rank = pc.tensor_parallel_size, pc.tensor_parallel_rank
    per_rank = (x.shape[0] + tp - 1) // tp
    if rank * per_rank >= x.shape[0]:
        # A rank with no real token gets only padding rows.  FastDeploy's split assigns the
        # empty slice x[n:n] into part_x[:0], which Paddle's CPU kernel rejects (expand_v2);
        # what split returns there is all zeros, so build exactly that.
        return paddle.zeros([per_rank, x.shape[1]], dtype=x.dtype)
    return RMSNorm.split(SimpleNamespace(tp_size=tp, tp_rank=rank), x)


class PostprocessOps:
    """CPU stand-ins for the two compiled ops around the routing block of post_process_normal."""

    @staticmethod
    def set_stop_value_multi_ends(sampled, stop_flags, seq_lens_this_time, eos, *args):
        hit = paddle.to_tensor(np.isin(sampled.numpy(), eos.numpy()).reshape(stop_flags.shape))
        paddle.assign(paddle.logical_or(stop_flags, hit), stop_flags)

    @staticmethod
    def update_inputs_v1(*args, **kwargs):
        return None


def post_process(manager, share, *, lens, decoded, sampled, bsz, block_size):
    """FastDeploy's real ``post_process_normal`` for a step of ``bsz`` slots."""
    import importlib

    ppp = importlib.import_module("fastdeploy.model_executor.pre_and_post_process")
    ppp.set_stop_value_multi_ends = PostprocessOps.set_stop_value_multi_ends
    ppp.update_inputs_v1 = PostprocessOps.update_inputs_v1
    ppp.update_inputs = PostprocessOps.update_inputs_v1

    def col(values, dtype):
        return paddle.to_tensor(np.array(values, dtype=dtype).reshape(bsz, 1))

    encoder = [n if d == 0 else 0 for n, d in zip(lens, decoded, strict=True)]
    model_output = SimpleNamespace(
        stop_flags=col([False] * bsz, "bool"), step_idx=col([0] * bsz, "int64"),
        max_dec_len=col([1000] * bsz, "int64"),
        seq_lens_this_time=paddle.to_tensor(np.array(lens, dtype="int32")),
        eos_token_id=paddle.to_tensor(np.array([[parallel_spec.EOS]], dtype="int64")),
        next_tokens=col([0] * bsz, "int64"), pre_ids=None, stop_token_ids=None, stop_seqs_len=None,
        min_tokens=None, not_need_stop_device=None, seq_lens_encoder=col(encoder, "int32"),
        seq_lens_decoder=col(decoded, "int32"), input_ids=None, is_block_step=None)
    sampler_output = SimpleNamespace(sampled_token_ids=col(sampled, "int64"), logits=None)
    ppp.post_process_normal(sampler_output, model_output, share, None, block_size=block_size,
                            routing_replay_manager=manager)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ranks, local_rank = init_distributed_environment()          # FastDeploy's: fleet.init
    assert ranks == spec["world"], (ranks, spec["world"])
    fd_config = parallel_spec.worker_config(spec, local_rank)
    pc = fd_config.parallel_config

    import fdctx

    from fd_routing_replay.integrations.fastdeploy.api import STEP_BUFFER

    step_api = fdctx.GENERATION == STEP_BUFFER
    runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=spec["num_blocks"])
    from fd_routing_replay.integrations.fastdeploy.setup import moe_layer_map

    layer_ids = moe_layer_map(fd_config.model_config)
    eplb = eplb_setup(spec, fd_config) if spec.get("eplb") else None
    quant = eplb.quant if eplb is not None else fdctx.CpuExperts(fd_config.model_config.moe_k)
    layers = [moe_layer(fd_config, i, quant) for i in layer_ids]
    if eplb is not None:              # the model is loaded before the cache (worker_process.py:1353-1355)
        for layer in layers:
            layer.redundant_table_manger, layer.top_k = eplb.manager, fd_config.model_config.moe_k
        runner.model = paddle.nn.LayerList(layers)
    fdctx.make_worker(runner, fd_config).initialize_cache(spec["num_blocks"])   # gpu_worker.py:182-189
    manager = runner.routing_replay_manager
    step_ref = [0]
    faults = {(f["step"], f["layer"]) for f in spec["faults"] if f["rank"] == local_rank}
    manager.binding.record = Fault(manager.binding, faults, step_ref)
    tables = parallel_spec.gate_tables(spec)
    gates = [KeyGate(tables[row]) for row in range(len(layer_ids))]
    dp = pc.data_parallel_rank
    schedule = spec["schedules"][dp]
    bsz = fd_config.scheduler_config.max_num_seqs
    block_size = fd_config.cache_config.block_size
    share = runner.share_inputs
    for request in schedule["requests"]:
        share["block_tables"][request["slot"], : len(request["blocks"])] = paddle.to_tensor(
            np.array(request["blocks"], dtype="int32"))
    buffer = manager.get_device_routing_buffer() if step_api else manager.get_routing_table()
    dumped: dict[str, np.ndarray] = {}
    registered: set[int] = set()
    for step, entries in enumerate(schedule["steps"]):
        step_ref[0] = step
        if eplb is not None and step == spec["eplb"]["rebalance_step"]:
            eplb.model.rebalance(np.random.default_rng([spec["seed"], 99]))    # the same on every rank
            dumped["rebalanced_table"] = eplb.model.table()
        if not entries:
            # No request on this DP rank: FastDeploy runs the MoE on an empty input with no
            # forward_meta (empty_input_forward), so the hook is not bound (moe.py:746-747).
            for layer, gate in zip(layers, gates, strict=True):
                layer.forward(paddle.zeros([0, 8], dtype="float32"), gate, None)
            continue
        lens, decoded = [0] * bsz, [0] * bsz
        for slot, n, d in entries:
            lens[slot], decoded[slot] = n, d
            if not step_api and slot not in registered:     # gpu_model_runner.py:825 (2.5)
                registered.add(slot)
                request = next(r for r in schedule["requests"] if r["slot"] == slot)
                manager.register_request(batch_id=slot, request_id=request["request_id"])
        meta, batch, positions = fdctx.forward_meta(buffer, lens_this_time=lens, lens_decoder=decoded)
        if not step_api:      # gpu_model_runner.py:2316-2320 (2.5)
            manager.pending_update_positions = manager.get_token_positions(
                seq_lens_decoder=paddle.to_tensor(np.array(decoded, dtype="int32")),
                seq_lens_this_time=paddle.to_tensor(np.array(lens, dtype="int32")))
        keys = parallel_spec.step_keys(schedule, lens, decoded)
        x = paddle.zeros([len(keys), 8], dtype="float32")
        x[:, 0] = paddle.to_tensor(keys.astype("float32"))
        if pc.use_sequence_parallel_moe:
            x = sequence_parallel_split(fd_config, x)
        quant.calls.clear()
        for layer, gate in zip(layers, gates, strict=True):
            layer.forward(x, gate, meta)                        # FastDeploy's forward
        dumped[f"topk_{step}"] = np.stack(quant.calls)           # this rank's own share, [L, rows, K]
        if eplb is not None:                                    # the replica slots the hook got
            dumped[f"physical_{step}"] = np.stack([c["physical"] for c in eplb.kernel.calls])
            eplb.kernel.calls.clear()
        dumped[f"buffer_{step}"] = parallel_spec.buffer_rows(buffer, len(keys))
        # Stand-in for get_position_ids_and_slot_mapping (a GPU op, gpu_model_runner.py:1334):
        share["slot_mapping_buffer"] = paddle.to_tensor(parallel_spec.slot_mapping(schedule, lens, decoded, block_size))
        share["position_ids_buffer"] = paddle.to_tensor(positions)
        share["ids_remove_padding"] = paddle.zeros([len(keys)], dtype="int64")
        share["step_seq_lens_decoder"] = paddle.zeros([bsz, 1], dtype="int32")
        share["prompt_lens"] = paddle.to_tensor(np.array(
            [[parallel_spec.prompt_len(schedule, s)] for s in range(bsz)], dtype="int64"))
        sampled = [parallel_spec.sampled(schedule, s, step) for s in range(bsz)]
        post_process(manager, share, lens=lens, decoded=decoded, sampled=sampled, bsz=bsz,
                     block_size=block_size)
        if step_api:   # after post_process_event.synchronize(): gpu_model_runner.py:2328-2329
            manager.flush_pending_save()
    stats = manager.stats()
    manager.close()
    out = Path(spec["out_dir"])
    np.savez(out / f"rank{local_rank}.npz", **dumped)
    (out / f"rank{local_rank}.json").write_text(json.dumps({
        "rank": local_rank, "tp_rank": pc.tensor_parallel_rank, "dp_rank": dp,
        "tp_size": pc.tensor_parallel_size, "ep_size": pc.expert_parallel_size,
        "sequence_parallel": bool(pc.use_sequence_parallel_moe),
        "tp_group_ranks": list(pc.tp_group.ranks) if pc.tp_group is not None else None,
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }))


if __name__ == "__main__":
    main()
