"""What the parent test and its ranks share: the scenario, FastDeploy configs per rank and
per engine, the token keys and the numpy reference of every record.

A scenario is JSON: the parallel layout (``tp``, ``dp``, ``ep``, ``sequence_parallel``),
one schedule per DP rank (its requests, their slots, KV blocks and steps) and the hook
faults to inject.  Every token of every request has a key (``key_base + position``); the
MoE gate's scores for a token are row ``key`` of a fixed per-layer table, so the routing
of a token does not depend on the rank that routes it, and key 0 (FastDeploy's zero
padding rows) routes differently from every real token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

EOS = 2
MAX_MODEL_LEN = 256
NUM_BLOCKS = 64


def make_spec(*, tp: int, dp: int = 1, ep: bool = False, sequence_parallel: bool = True,
              requests: list[list[dict[str, int]]], faults: list[dict[str, int]] = (),
              out_dir: Path, store_dir: Path, ports: list[int], seed: int = 0,
              eplb: dict[str, int] | None = None) -> dict[str, Any]:
    """A scenario.  ``requests[d]``: DP rank ``d``'s requests, each ``prompt_len``,
    ``new_tokens`` and ``start_step`` (its prefill step); request ``i`` gets slot ``i``.
    ``eplb``: ``{"redundant": R, "rebalance_step": s}``: EPLB with R redundant experts,
    FastDeploy's rebalance before step s on every rank."""
    rng = np.random.default_rng(seed)
    schedules, index = [], 0
    for d, reqs in enumerate(requests):
        out = []
        blocks = rng.permutation(NUM_BLOCKS)
        used = 0
        for slot, r in enumerate(reqs):
            need = (r["prompt_len"] + r["new_tokens"]) // 16 + 1
            rid = f"exp_{seed}:{d}:{slot}:0"
            out.append(dict(r, slot=slot, rollout_id=rid, key_base=1 + index * MAX_MODEL_LEN,
                            request_id=f"chatcmpl-{rid}-0f8fad5b-d9cb-469f-a165-70867728950e_0",
                            blocks=blocks[used: used + need].tolist()))
            used += need
            index += 1
        last = max((r["start_step"] + r["new_tokens"] for r in out), default=0)
        schedules.append({"requests": out, "steps": []})
        schedules[-1]["num_steps"] = last
    num_steps = max(s["num_steps"] for s in schedules)
    for schedule in schedules:
        for step in range(num_steps):
            entries = []
            for r in schedule["requests"]:
                k = step - r["start_step"]
                if 0 <= k < r["new_tokens"]:
                    n, d = (r["prompt_len"], 0) if k == 0 else (1, r["prompt_len"] + k - 1)
                    entries.append([r["slot"], n, d])
            schedule["steps"].append(entries)
    return {"tp": tp, "dp": dp, "ep": ep, "sequence_parallel": sequence_parallel,
            "world": tp * dp, "schedules": schedules, "faults": list(faults),
            "out_dir": str(out_dir), "store_dir": str(store_dir), "ports": ports,
            "num_blocks": NUM_BLOCKS, "seed": seed, "num_keys": 1 + index * MAX_MODEL_LEN,
            "eplb": eplb}


def write_spec(spec: dict[str, Any], path: Path) -> Path:
    """Write the scenario and the tiny model directory every rank's ``ModelConfig`` reads.

    The parent writes both before any rank starts: ranks only read them.  (When every rank
    wrote ``config.json`` itself, one rank could read it while another had just truncated
    it -- a JSONDecodeError on that rank, and its peers failing in the TP group's set-up.)
    """
    import fdctx

    model_dir = _model_dir(spec)
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(fdctx.MODEL))
    path.write_text(json.dumps(spec))
    return path


def _model_dir(spec: dict[str, Any]) -> Path:
    return Path(spec["out_dir"]) / "model"


# ------------------------------------------------------------------ FastDeploy configs
def _configs(spec: dict[str, Any], parallel: dict[str, Any]):
    from fastdeploy import config as C

    mc = C.ModelConfig({"model": str(_model_dir(spec)), "max_model_len": MAX_MODEL_LEN})   # write_spec wrote it
    rr = C.RoutingReplayConfig({"enable_routing_replay": True, "local_store_dir": spec["store_dir"]})
    cc = C.CacheConfig({"block_size": 16, "model_cfg": mc})
    pc = C.ParallelConfig({
        "tensor_parallel_size": spec["tp"], "data_parallel_size": spec["dp"],
        "enable_expert_parallel": spec["ep"], "disable_sequence_parallel_moe": not spec["sequence_parallel"],
        "engine_worker_queue_port": ",".join(str(p) for p in spec["ports"]),
        "device_ids": ",".join(str(i) for i in range(spec["world"])), **parallel})
    return C, mc, rr, cc, pc


def _fd_config(C, mc, rr, cc, pc, spec=None):
    config = _new_fd_config(C, mc, rr, cc, pc)
    if spec is not None and spec.get("eplb"):      # --eplb-config, as the engine and workers get it
        config.eplb_config = C.EPLBConfig({"enable_eplb": True, "redundant_experts_num": spec["eplb"]["redundant"]})
    return config


def _new_fd_config(C, mc, rr, cc, pc):
    return C.FDConfig(
        model_config=mc, cache_config=cc, parallel_config=pc,
        scheduler_config=C.SchedulerConfig({"max_num_seqs": 8, "max_num_batched_tokens": 256}),
        load_config=C.LoadConfig({}), graph_opt_config=C.GraphOptimizationConfig({}),
        routing_replay_config=rr, device_config=C.DeviceConfig({}), speculative_config=C.SpeculativeConfig({}))


def worker_config(spec: dict[str, Any], local_rank: int):
    """A worker's ``FDConfig`` as ``initialize_fd_config`` builds it (worker_process.py:1171-1211
    in 2.6): ranks from the global rank, then FastDeploy's own communication groups."""
    C, mc, rr, cc, pc = _configs(spec, {})
    pc.tensor_parallel_rank = local_rank % pc.tensor_parallel_size
    pc.data_parallel_rank = local_rank // pc.tensor_parallel_size
    if pc.data_parallel_size > 1:
        pc.local_data_parallel_id = pc.data_parallel_rank % (8 // pc.tensor_parallel_size)
    if pc.expert_parallel_size > 1:
        pc.expert_parallel_rank = int(local_rank % pc.expert_parallel_size)
    pc.set_communicate_group()
    return _fd_config(C, mc, rr, cc, pc, spec)


def engine_config(spec: dict[str, Any], dp: int):
    """The engine process of DP rank ``dp``: FastDeploy's ExpertService sets only
    ``local_data_parallel_id`` and re-derives the ports (expert_service.py:81-84 in 2.6);
    ``data_parallel_rank`` is a worker-side field and stays at its default there."""
    C, mc, rr, cc, pc = _configs(spec, {})
    pc.local_data_parallel_id = dp
    return _fd_config(C, mc, rr, cc, pc, spec)


# ------------------------------------------------------------------ tokens and routing
def gate_tables(spec: dict[str, Any], num_layers: int = 4, num_experts: int = 300) -> list[np.ndarray]:
    """One score table per MoE layer: row ``key`` scores token ``key``."""
    return [np.random.default_rng([spec["seed"], layer]).random((spec["num_keys"], num_experts),
                                                                dtype=np.float32)
            for layer in range(num_layers)]


def reference_topk(table: np.ndarray, keys: np.ndarray, top_k: int, softmax: bool = False) -> np.ndarray:
    """numpy top-k of the gate's scores, in descending order (as paddle.topk returns them);
    ``softmax``: of their float32 softmax, as FastDeploy's selection kernels rank them (EPLB's
    moe_redundant_topk_select: ``cpu_kernels.softmax_topk``, the same arithmetic row by row)."""
    if softmax:
        from cpu_kernels import softmax_topk

        return softmax_topk(table[keys], top_k)[0]
    return np.argsort(-table[keys], axis=1, kind="stable")[:, :top_k]


def step_keys(schedule: dict[str, Any], lens: list[int], decoded: list[int]) -> np.ndarray:
    """The step's token keys, slot by slot (FastDeploy's token order)."""
    by_slot = {r["slot"]: r for r in schedule["requests"]}
    parts = [by_slot[s]["key_base"] + np.arange(d, d + n) for s, (n, d) in enumerate(zip(lens, decoded, strict=True)) if n]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def slot_mapping(schedule: dict[str, Any], lens: list[int], decoded: list[int], block_size: int) -> np.ndarray:
    """KV slot of each token of the step (what get_position_ids_and_slot_mapping computes)."""
    by_slot = {r["slot"]: r for r in schedule["requests"]}
    parts = []
    for s, (n, d) in enumerate(zip(lens, decoded, strict=True)):
        if n:
            pos = np.arange(d, d + n)
            blocks = np.array(by_slot[s]["blocks"], dtype=np.int64)
            parts.append(blocks[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(parts).astype(np.int64)


def prompt_len(schedule: dict[str, Any], slot: int) -> int:
    return next((r["prompt_len"] for r in schedule["requests"] if r["slot"] == slot), 0)


def sampled(schedule: dict[str, Any], slot: int, step: int) -> int:
    """EOS at a request's last step, another token before."""
    for r in schedule["requests"]:
        if r["slot"] == slot and step == r["start_step"] + r["new_tokens"] - 1:
            return EOS
    return 7


def buffer_rows(buffer: Any, num_tokens: int) -> np.ndarray:
    """The step buffer's first rows as unsigned routing ids ``[tokens, L, K]``."""
    from fd_routing_replay import ops

    array = np.asarray(buffer.numpy())
    dtype = ops.routing_dtype(300)
    return array.view(dtype)[:num_tokens].copy()


def expected_record(spec: dict[str, Any], request: dict[str, Any], top_k: int = 4,
                    lost_steps: set[int] = frozenset()) -> np.ndarray:
    """The request's routing ``[L, prompt + new - 1, K]`` by numpy; the tokens of
    ``lost_steps`` (a hook failed on the saving rank) are the fill value."""
    tables = gate_tables(spec)
    positions = request["prompt_len"] + request["new_tokens"] - 1
    keys = request["key_base"] + np.arange(positions)
    ids = np.stack([reference_topk(t, keys, top_k, bool(spec.get("eplb"))) for t in tables]).astype(np.uint16)
    for step in lost_steps:
        k = step - request["start_step"]
        if k == 0:
            ids[:, : request["prompt_len"]] = np.iinfo(np.uint16).max
        elif 0 < k < request["new_tokens"]:
            ids[:, request["prompt_len"] + k - 1] = np.iinfo(np.uint16).max
    return ids
