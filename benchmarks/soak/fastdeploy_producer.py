"""A soak producer on FastDeploy 2.6's own store path, for the side-by-side comparison:
``StoreWrapper`` → ``multiprocessing.Manager().Queue`` → ``StoreProcess`` →
``RoutingStoreLocal`` (``paddle.save`` of the record padded to ``max_model_len``) or
``RoutingStoreRDMA`` (P2PStore), run from FastDeploy's sources
(../shared/fastdeploy/2.6/fastdeploy/cache_manager/routing_store.py) in the contract
environment (``.venv-fd``, with fdrr_dev.testing's stand-ins for FastDeploy's compiled ops).

``.venv-fd/bin/python -m benchmarks.soak.fastdeploy_producer CONFIG.json``: the same
schedule, records and ``put`` events as :mod:`.producer`, each record handed over the way
FastDeploy's ``RoutingCacheManager.on_request_finished`` does with ``use_fused_put``
(routing_cache_manager.py:290-296): ``submit_put_task(routing_indices=[L, T, K],
rollout_id=...)``, then, under ``only_last_turn``, ``submit_clear_prefix_batch_task``.
FastDeploy reports nothing back when a record is stored, so there are no ``durable``
events: the trainers' first successful read times it.

The contract environment has no P2PStore client: for ``rdma`` the config names a directory
holding the main environment's ``p2pstore`` and ``mooncake`` packages (same Python), put
on ``sys.path``; ``P2P_PROTOCOL=tcp`` and ``POD_IP=127.0.0.1:PORT`` select P2PStore's TCP
transport, which FastDeploy's ``P2PConfig(metadata_server=...)`` call leaves at its default.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.soak.events import EventLog, StepGate
from benchmarks.soak.workload import KINDS, MAX_LAYERS, make_ids, schedule, spec_for

__all__ = ["main"]


def _wrapper(config: dict[str, Any], only_last_turn: bool) -> Any:
    source = config["fd_source"]
    if config.get("extra_path"):
        sys.path.insert(0, config["extra_path"])
    sys.path.insert(0, source)
    from fdrr_dev.testing.fastdeploy_standins import install

    install()
    from fastdeploy.cache_manager.routing_store import StoreWrapper
    from fastdeploy.config import RoutingReplayConfig

    routing = RoutingReplayConfig({
        "enable_routing_replay": True, "routing_store_type": config["store_type"],
        "local_store_dir": config.get("local_store_dir", ""),
        "rdma_store_server": config.get("rdma_store_server", ""),
        "only_last_turn": only_last_turn, "use_fused_put": True})
    fd_config = SimpleNamespace(
        model_config=SimpleNamespace(num_hidden_layers=MAX_LAYERS, moe_layer_start_index=0,
                                     max_model_len=int(config["max_model_len"])),
        scheduler_config=SimpleNamespace(max_num_seqs=int(config.get("max_num_seqs", 64))),
        routing_replay_config=routing)
    wrapper = StoreWrapper(fd_config=fd_config)
    wrapper.start_store_warpper()
    return wrapper


def run(config: dict[str, Any]) -> int:
    index, kind = int(config["producer"]), config["kind"]
    out = Path(config["dir"])
    log = EventLog(out / f"producer{index}.jsonl")
    multi = KINDS[kind][0]
    wrapper = _wrapper(config, only_last_turn=multi)
    log.emit("fd_pids", t=time.monotonic(), store_process=wrapper._routing_store_process.pid,
             manager=wrapper.manager._process.pid)
    time.sleep(float(config.get("settle_s", 2.0)))  # StoreProcess's clear_store at start
    rate = float(config["rate"])
    rng = np.random.default_rng(int(config.get("seed", 0)) * 1000 + index)
    start = time.monotonic()
    stop_at = start + float(config["duration_s"])
    next_at = start
    current_step = 0
    step_s = float(config.get("step_s", 2.0))

    def step_now() -> int:
        return int((time.monotonic() - start) / step_s)

    gate = StepGate(out)
    with open(out / f"producer{index}.log", "a") as errors:
        for step, rid in schedule(config["run"], index, kind,
                                  int(config.get("turns", 3)), step_now):
            if step != current_step:
                log.emit("step_done", step=current_step, t=time.monotonic())
                current_step = step
                if not gate.wait(step, stop_at):
                    break
            spec = spec_for(rid)
            ids = make_ids(spec)
            if rate > 0:
                next_at += rng.exponential(1.0 / rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if time.monotonic() >= stop_at:
                break
            began = time.monotonic()
            ok = True
            try:  # what RoutingCacheManager.on_request_finished does (use_fused_put)
                wrapper.submit_put_task(routing_indices=ids, rollout_id=rid)
                if multi:
                    wrapper.submit_clear_prefix_batch_task(rollout_id=rid)
            except RuntimeError as exc:
                ok = False
                errors.write(f"{time.time():.3f} ERROR fastdeploy {exc}\n")
            took = time.monotonic() - began
            log.emit("put", id=rid, t=began, dt=took, ok=ok, bytes=spec.nbytes,
                     late=max(0.0, began - next_at) if rate > 0 else 0.0)
    log.emit("step_done", step=current_step, t=time.monotonic())
    log.emit("submitted_all", t=time.monotonic())
    if config.get("hold_open"):  # as producer.hold_open (which needs fd_routing_replay)
        deadline = time.monotonic() + float(config.get("hold_open_s", 600))
        while not (out / "release-producers").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    # What FastDeploy's atexit hook does: a sentinel, join the store process, join the queue
    wrapper.shutdown()
    log.emit("end", t=time.monotonic(), stats={}, dead_letter_keys=[],
             maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
             children_maxrss_kb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as stream:
        config = json.load(stream)
    os.nice(int(config.get("nice", 0)))
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
