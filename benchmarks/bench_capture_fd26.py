"""Capture's host cost against FastDeploy 2.6's own R3 path, side by side on the same inputs.

Claims (issue 24, "Anchor, side by side"):

1. **Per-step host path** of the worker, a decode step of N running sequences (N tokens),
   27 MoE layers x top-8, uint8: FastDeploy 2.6's ``RoutedExpertsCapturer``
   ``prepare_pending_save`` + ``flush_pending_save`` with its ``RoutingHostBufferView.scatter``
   into its ``RoutingHostBuffer`` (routing_indices_cache.py:202-340,
   routing_cache_manager.py:29-91 of ../shared/fastdeploy/2.6) against ours
   (:class:`~fd_routing_replay.capture.fd26.StepRoutingCapturer`, same two calls).
   Both step buffers hold the same rows, both get the same KV slots, and both host buffers
   must end up identical.  FastDeploy's pinned staging buffers are plain CPU tensors here
   (``pin_memory`` needs CUDA); nothing else of its code is changed.
2. **A finished request, engine side**, T tokens (1k, 8k, 32k), 60 MoE layers x top-8,
   uint8, blocks scattered over the cache: FastDeploy's ``RoutingCacheManager.
   gather_routing_for_request`` plus the transpose ``on_request_finished`` makes before it
   hands the ``[L, T, K]`` array to its store (routing_cache_manager.py:233-296) against
   what our engine side runs on the token processor's thread, ``EngineRouting.finish``: the
   request's rows gathered through its block table straight into the background writer's
   ring (a process-mode writer, flushed between repetitions) with the put's description
   sent -- the whole hand-off, the record is built by the writer.  Both are set next to one
   memcpy of the request's rows.  The stored record must equal FastDeploy's array.

Timing: the two sides alternate on every repetition and each pair gives one ratio; the
figure is the median of the paired ratios (wall clock of the calling thread), next to the
medians of each side.  FastDeploy's code needs its own environment: run with
``.venv-fd/bin/python`` (``make fd-env``); started by another interpreter this script
re-runs itself there.

    .venv-fd/bin/python benchmarks/bench_capture_fd26.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")
FD_SOURCE = Path(os.environ.get("FD_SOURCE_DIR", REPO.parent / "shared" / "fastdeploy" / "2.6"))
FD_PYTHON = REPO / ".venv-fd" / "bin" / "python"


def _import_fastdeploy() -> tuple[type, type, type, type]:
    """FastDeploy 2.6's capturer, host buffer, its view and the engine-side manager."""
    from fdrr_dev.testing import fastdeploy_standins

    fastdeploy_standins.install()
    sys.path.insert(0, str(FD_SOURCE))
    os.environ.setdefault("FD_LOG_DIR", tempfile.mkdtemp(prefix="fd-bench-log-"))
    from fastdeploy.cache_manager.routing_cache_manager import (
        RoutingCacheManager,
        RoutingHostBuffer,
        RoutingHostBufferView,
    )
    from fastdeploy.model_executor.layers.moe.routing_indices_cache import RoutedExpertsCapturer

    return RoutedExpertsCapturer, RoutingHostBuffer, RoutingHostBufferView, RoutingCacheManager


def paired(fd_call, our_call, repeats: int, setup=None) -> dict[str, float]:
    """Alternate the two calls ``repeats`` times (who goes first alternates too); each is
    timed in CPU time of the calling thread (the engine's cost: a process this wakes, or
    a neighbour that takes the core meanwhile, is not counted against either)."""
    fd_times, our_times = [], []
    for i in range(repeats):
        order = ((fd_call, fd_times), (our_call, our_times))
        for call, times in (order if i % 2 == 0 else order[::-1]):
            if setup is not None:
                setup()
            started = time.thread_time_ns()
            call()
            times.append((time.thread_time_ns() - started) / 1e9)
    ratios = [f / o for f, o in zip(fd_times, our_times, strict=True)]
    return {"fd": statistics.median(fd_times), "ours": statistics.median(our_times),
            "ratio": statistics.median(ratios), "low": float(np.percentile(ratios, 25)),
            "high": float(np.percentile(ratios, 75))}


# ------------------------------------------------------------------------ 1. per step
LAYERS, TOP_K, EXPERTS, BLOCK = 27, 8, 64, 64


def step_case(classes, num_seqs: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    import paddle

    from fd_routing_replay.capture.fd26 import StepRoutingCapturer
    from fd_routing_replay.capture.slots import HostSlotCache

    capturer_cls, buffer_cls, view_cls, _ = classes
    max_tokens = max(num_seqs, 256)
    num_blocks = num_seqs * 16
    shape = [max_tokens, LAYERS, TOP_K]
    rows = rng.integers(0, EXPERTS, (num_seqs, LAYERS, TOP_K)).astype(np.uint8)
    slots = rng.permutation(num_blocks * BLOCK)[:num_seqs].astype(np.int64)
    slot_mapping = paddle.to_tensor(slots)

    # FastDeploy's capturer, its buffers as _init_routing_cache makes them (unpinned)
    suffix = f"bench{uuid.uuid4().hex[:8]}"
    fd_host = buffer_cls(num_gpu_blocks=num_blocks, block_size=BLOCK, num_moe_layers=LAYERS,
                         top_k=TOP_K, dtype="uint8", dp_suffix=suffix)
    fd = capturer_cls.__new__(capturer_cls)
    fd.fd_config = SimpleNamespace(scheduler_config=SimpleNamespace(enable_overlap_schedule=False))
    fd.num_moe_layers, fd.moe_top_k, fd.debug_mode, fd.token_num_overlap = LAYERS, TOP_K, False, 0
    fd.max_num_kv_tokens = num_blocks * BLOCK
    initial = np.zeros(shape, np.uint8)
    initial[:num_seqs] = rows
    fd.device_routing_buffer = paddle.to_tensor(initial)
    fd.routing_staging_buf = paddle.to_tensor(np.zeros(shape, np.uint8))
    fd.slot_mapping_staging_buf = paddle.zeros([max_tokens], dtype=paddle.int64)
    fd.cpu_routing_buf = paddle.to_tensor(np.zeros(shape, np.uint8))
    fd.cpu_slot_mapping_buf = paddle.zeros([max_tokens], dtype=paddle.int64)
    fd.position_ids_staging_buf = fd.cpu_position_ids_buf = None
    fd._pending_save = None
    fd.routing_host_view = view_cls(shape=fd_host.shape, dtype="uint8", shm_name=fd_host.shm_name)
    fd._routing_host_view_attach_attempted = True

    # ours
    host = HostSlotCache(num_blocks * BLOCK, LAYERS, TOP_K, np.uint8, 255)
    ours = StepRoutingCapturer(max_batched_tokens=max_tokens, num_moe_layers=LAYERS, top_k=TOP_K,
                               num_experts=EXPERTS, attach_host=lambda: host)
    ours.device_routing_buffer[:num_seqs] = paddle.to_tensor(rows)
    counters = ours.step.counters

    def forward() -> None:     # untimed: what the step's MoE layers leave in the device counters
        counters[1:] = counters[1:] + 1

    def fd_step() -> None:
        fd.prepare_pending_save(num_seqs, slot_mapping)
        fd.flush_pending_save()

    def our_step() -> None:
        ours.prepare_pending_save(num_seqs, slot_mapping)
        ours.flush_pending_save()

    forward()
    fd_step()
    our_step()
    if not (np.array_equal(fd_host.buffer[slots], rows) and np.array_equal(host.array[slots], rows)):
        raise RuntimeError("the two flushes disagree")
    if ours.counters["errors"] or ours.counters["damaged_steps"]:
        raise RuntimeError(f"our capturer counted a problem: {ours.counters}")
    out = paired(fd_step, our_step, repeats, setup=forward)
    ours.close()
    fd.routing_host_view.close()
    fd_host.close()
    return out


# ------------------------------------------------------------------------ 2. at finish
ASM_LAYERS, ASM_BLOCK = 60, 64
REQUEST_ID = "chatcmpl-exp_0:0:0-0b6f1c3e-5a2d-4e8f-9c1a-7d3b2e4f6a80"   # FastDeploy: {rollout id}-{uuid}


def assembly_case(classes, num_tokens: int, repeats: int, rng: np.random.Generator,
                  workdir: Path) -> dict[str, float]:
    """One finished request: FastDeploy's gather + transpose vs our hand-off into the
    writer's ring (:meth:`EngineRouting.finish`, the token processor's thread), both next to
    one memcpy of the request's rows."""
    from fd_routing_replay.capture.fd26 import EngineRouting
    from fd_routing_replay.capture.slots import CaptureGeometry, HostSlotCache
    from fd_routing_replay.config import config_from_dict
    from fd_routing_replay.reader import RoutingReader
    from fd_routing_replay.store import open_store
    from fd_routing_replay.writer import RoutingWriter

    _, buffer_cls, view_cls, manager_cls = classes
    num_blocks = 2 * num_tokens // ASM_BLOCK
    suffix = f"bench{uuid.uuid4().hex[:8]}"
    fd_host = buffer_cls(num_gpu_blocks=num_blocks, block_size=ASM_BLOCK, num_moe_layers=ASM_LAYERS,
                         top_k=TOP_K, dtype="uint8", dp_suffix=suffix)
    cache = rng.integers(0, 255, fd_host.shape).astype(np.uint8)
    fd_host.buffer[...] = cache
    manager = manager_cls.__new__(manager_cls)
    manager.block_size, manager.debug_mode = ASM_BLOCK, False
    manager.num_moe_layers, manager.moe_top_k = ASM_LAYERS, TOP_K
    manager.host_view = view_cls(shape=fd_host.shape, dtype="uint8", shm_name=fd_host.shm_name)
    block_table = rng.permutation(num_blocks)[: -(-num_tokens // ASM_BLOCK)].tolist()

    host = HostSlotCache(num_blocks * ASM_BLOCK, ASM_LAYERS, TOP_K, np.uint8, 255)
    host.array[...] = cache
    geometry = CaptureGeometry(max_num_seqs=8, max_model_len=2 * num_tokens, num_moe_layers=ASM_LAYERS,
                               top_k=TOP_K, num_experts=255, block_size=ASM_BLOCK, total_block_num=num_blocks)
    root = workdir / f"finish-{num_tokens}"
    store = {"type": "local", "namespace": "bench", "local": {"root": str(root / "store")}}
    writer = RoutingWriter(store, {"mode": "process", "capacity_bytes": 8 * ASM_LAYERS * num_tokens * TOP_K,
                                   "journal_dir": str(root / "journal"), "dead_letter_dir": str(root / "dead")})
    writer.ready(60)
    routing = EngineRouting(config_from_dict({"enabled": True}), geometry, host, writer=writer)
    table = np.asarray(block_table, dtype=np.int64)
    tokens = rng.integers(0, 50_000, num_tokens + 1).tolist()
    results: dict[str, np.ndarray] = {}
    source = np.ascontiguousarray(cache[:num_tokens])
    copy = np.empty_like(source)

    def fd_finish() -> None:
        # on_request_finished, up to the hand-off to its store (routing_cache_manager.py:270-277)
        data = manager.gather_routing_for_request(block_table, num_tokens)
        results["fd"] = np.ascontiguousarray(data.transpose(1, 0, 2))

    def our_finish() -> None:
        # EngineRouting.finish: the hand-off straight into the writer's ring
        routing.finish(REQUEST_ID, table, num_tokens, tokens)

    def memcpy() -> None:
        np.copyto(copy, source)

    fd_finish()
    our_finish()
    if not writer.flush(60):
        raise RuntimeError("the writer did not store the record")
    stored = RoutingReader(open_store(store)).get("exp_0:0:0")
    if stored is None or not np.array_equal(results["fd"], stored.ids):
        raise RuntimeError("the two assemblies disagree")
    out = paired(fd_finish, our_finish, repeats, setup=lambda: writer.flush(60))
    vs_copy = paired(memcpy, our_finish, repeats, setup=lambda: writer.flush(60))
    out.update(memcpy=vs_copy["fd"], memcpy_ratio=1.0 / vs_copy["ratio"],
               memcpy_low=1.0 / vs_copy["high"], memcpy_high=1.0 / vs_copy["low"])
    if routing.counters["records_failed"]:
        raise RuntimeError(f"our hand-off counted a failure: {routing.counters}")
    writer.close()
    manager.host_view.close()
    fd_host.close()
    return out


def _fmt(seconds: float) -> str:
    from _common import fmt_seconds

    return fmt_seconds(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    try:
        classes = _import_fastdeploy()
    except Exception as exc:  # noqa: BLE001 - this interpreter cannot import FastDeploy 2.6
        if FD_PYTHON.exists() and Path(sys.prefix).resolve() != FD_PYTHON.parent.parent.resolve():
            return subprocess.call([str(FD_PYTHON), __file__, *sys.argv[1:]])
        print(f"FastDeploy 2.6 does not import here ({exc!r}); run `make fd-env` and use "
              f"{FD_PYTHON}", file=sys.stderr)
        return 1
    from _common import markdown_table

    from fd_routing_replay import ops

    if ops.ops_backend() != "compiled":
        print(f"the compiled ops are not loaded: {ops.ops_backend_reason()}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(24)
    repeats = 60 if args.quick else 400
    rows = []
    for num_seqs in (16, 64, 256):
        r = step_case(classes, num_seqs, repeats, rng)
        rows.append([num_seqs, _fmt(r["fd"]), _fmt(r["ours"]), f"**{r['ratio']:.1f}x** "
                     f"({r['low']:.1f}-{r['high']:.1f})"])
    print(f"### Per-step host path, decode step ({LAYERS} MoE layers x top-{TOP_K}, uint8; "
          f"median of {repeats} paired steps, CPU time of the calling thread)\n")
    print(markdown_table(["running sequences", "FastDeploy 2.6 prepare_pending_save + flush_pending_save",
                          "ours (same two calls)", "FastDeploy / ours (IQR)"], rows))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fd-bench-finish-") as workdir:
        for num_tokens in (1024, 8192, 32768):
            r = assembly_case(classes, num_tokens, 20 if args.quick else 60, rng, Path(workdir))
            rows.append([num_tokens, _fmt(r["fd"]), _fmt(r["ours"]), _fmt(r["memcpy"]),
                         f"**{r['ratio']:.1f}x** ({r['low']:.1f}-{r['high']:.1f})",
                         f"**{r['memcpy_ratio']:.2f}x** ({r['memcpy_low']:.2f}-{r['memcpy_high']:.2f})"])
    print(f"\n### A finished request, engine side ({ASM_LAYERS} MoE layers x top-{TOP_K}, uint8, "
          f"block size {ASM_BLOCK}, blocks scattered; median of paired calls, CPU time of the calling "
          f"thread)\n")
    print(markdown_table(["tokens", "FastDeploy 2.6 gather + transpose", "ours: hand-off into the "
                          "writer's ring (token processor's thread)", "one memcpy of the rows",
                          "FastDeploy / ours (IQR)", "ours / memcpy (IQR)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
