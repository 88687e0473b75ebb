"""Planted bugs: each live scenario's check must fail when the plugin misbehaves this way.

Installed in the rig's processes by ``tests/live/site/sitecustomize.py`` when
``FDRR_LIVE_PLANT_FILE`` names a file; a plant is active while that file holds its name
(:meth:`tests.live.rig.LiveServer.plant` writes it, between requests), so one server serves
the clean run and the planted one.  Each wraps one function of the plugin with the bug a
scenario must catch; none changes FastDeploy.

=====================  ======================================================================
plant                  bug
=====================  ======================================================================
hook_skips_layer       the MoE hook records nothing for MoE layer row 1
slot_off_by_one        the worker scatters each step's rows one KV slot too far
prefix_rows_wiped      a finished request's rows are wiped from the slot cache (a later
                       prefix-cache hit finds none)
choices_share_key      every choice of an ``n > 1`` request is stored under the rollout id
keep_previous_turn     ``only_last_turn`` never finds the previous turn to delete
stale_block_table      the engine gathers a request with the block table it first saw (wrong
                       once preemption gave the request other blocks)
stream_routes_dropped  the last stream chunk carries no routes
reference_tampered     a reference's checksum is not the stored record's
abort_writes_final     an aborted request is finalised as if it had finished
=====================  ======================================================================
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

__all__ = ["PLANTS", "active", "install"]

PLANTS = ("hook_skips_layer", "slot_off_by_one", "prefix_rows_wiped", "choices_share_key", "keep_previous_turn",
          "stale_block_table", "stream_routes_dropped", "reference_tampered", "abort_writes_final")


def active(name: str) -> bool:
    """Whether plant ``name`` is switched on (the plant file holds its name)."""
    path = os.environ.get("FDRR_LIVE_PLANT_FILE")
    if not path:
        return False
    try:
        with open(path) as handle:
            return handle.read().strip() == name
    except OSError:
        return False


def _hook(module: ModuleType) -> None:
    original = module.save_routing_to_buffer_v2

    @functools.wraps(original)
    def save_routing_to_buffer_v2(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("layer_idx") == 1 and active("hook_skips_layer"):
            return None
        return original(*args, **kwargs)

    save_routing_to_buffer_v2.fdrr_hook = True
    module.save_routing_to_buffer_v2 = save_routing_to_buffer_v2


def _step_capture(module: ModuleType) -> None:
    cls = module.StepRoutingCapturer
    original = cls.prepare_pending_save

    def prepare_pending_save(self: Any, num_tokens: int, slot_mapping_gpu: Any, position_ids_gpu: Any = None) -> None:
        if active("slot_off_by_one") and slot_mapping_gpu is not None:
            slot_mapping_gpu = slot_mapping_gpu + 1
        return original(self, num_tokens, slot_mapping_gpu, position_ids_gpu)

    cls.prepare_pending_save = prepare_pending_save


def _keys(module: ModuleType) -> None:
    choice = module.choice_rollout_id
    previous = module.previous_turn

    def choice_rollout_id(rollout: Any, index: int) -> Any:
        return rollout if active("choices_share_key") else choice(rollout, index)

    def previous_turn(rollout: Any) -> Any:
        return None if active("keep_previous_turn") else previous(rollout)

    module.choice_rollout_id = choice_rollout_id
    module.previous_turn = previous_turn


_FIRST_TABLES: dict[str, list] = {}    # request id -> the block table it first ran with
_LAST_TABLES: dict[str, list] = {}     # request id -> the last non-empty one


def _routing(module: ModuleType) -> None:
    cls = module.EngineRouting
    finish = cls.finish

    def patched_finish(self: Any, request_id: str, block_table: Any, num_tokens: int, token_ids: Any = None) -> Any:
        first = _FIRST_TABLES.pop(request_id, None)
        _LAST_TABLES.pop(request_id, None)
        if active("stale_block_table") and first is not None:
            block_table = first
        out = finish(self, request_id, block_table, num_tokens, token_ids)   # gathers the rows now
        if active("prefix_rows_wiped"):
            import numpy as np

            from fd_routing_replay.capture.slots import request_slots

            slots = request_slots(np.asarray(block_table, dtype=np.int64), num_tokens, self.block_size)
            self.cache.array[slots] = self.cache.fill_value
        return out

    cls.finish = patched_finish


def _engine(module: ModuleType) -> None:
    cls = module.EngineRoutingManager
    install_engine_side = module.install_engine_side

    def patched_install(token_processor_cls: type) -> type:
        subclass = install_engine_side(token_processor_cls)
        record_metrics = getattr(subclass, "_record_metrics", None)
        put_abort = subclass._put_abort_results

        def _record_metrics(self: Any, task: Any, *args: Any) -> Any:
            _FIRST_TABLES.setdefault(task.request_id, list(task.block_tables))
            if task.block_tables:             # an abort empties it before the last outputs arrive
                _LAST_TABLES[task.request_id] = list(task.block_tables)
            return record_metrics(self, task, *args) if record_metrics else None

        def _put_abort_results(self: Any, task: Any) -> Any:
            # FastDeploy has already recycled the task's blocks here (token_processor.py:989-990):
            # the plant uses the last table the request ran with
            table = _LAST_TABLES.pop(task.request_id, None)
            manager = getattr(self, "routing_cache_manager", None)
            if active("abort_writes_final") and isinstance(manager, cls) and table:
                from fd_routing_replay.integrations.fastdeploy.engine import forwarded_tokens

                manager.routing.finish(task.request_id, table, forwarded_tokens(task))
            return put_abort(self, task)

        subclass._record_metrics = _record_metrics
        subclass._put_abort_results = _put_abort_results
        return subclass

    module.install_engine_side = patched_install


def _stream(module: ModuleType) -> None:
    original = module.with_routes

    def with_routes(metrics: Any, text: str) -> Any:
        return metrics if active("stream_routes_dropped") else original(metrics, text)

    module.with_routes = with_routes


def _response(module: ModuleType) -> None:
    cls = module.ResponseRoutes
    deliver = cls.deliver

    def patched_deliver(self: Any, encoded: Any) -> Any:
        out = deliver(self, encoded)
        if out is not None and self.mode == module.REFERENCE and active("reference_tampered"):
            import json

            reference = json.loads(out)
            reference["checksum"] = "0" * len(reference["checksum"])
            out = json.dumps(reference).encode("ascii")
        return out

    cls.deliver = patched_deliver


def install_hang() -> None:
    """``FDRR_LIVE_HANG=worker``: the worker hangs while loading the model and ignores SIGINT
    and SIGTERM -- what a start-up that never ends looks like to the rig."""
    from tests.fdcpu.hooks import install_hooks

    def hang(gpu_worker: ModuleType) -> None:
        def load_model(self: Any) -> None:
            import signal
            import sys
            import time

            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("fdrr live rig: the worker hangs in load_model (planted)", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

        gpu_worker.GpuWorker.load_model = load_model

    install_hooks({"fastdeploy.worker.gpu_worker": [hang]})


def install() -> None:
    """Wrap the plugin's functions (before anything binds them)."""
    from tests.fdcpu.hooks import install_hooks

    install_hooks({
        "fd_routing_replay.capture.device": [_hook],
        "fd_routing_replay.capture.fd26": [_step_capture, _routing, _response],
        "fd_routing_replay.keys": [_keys],
        "fd_routing_replay.integrations.fastdeploy.engine": [_engine],
        "fd_routing_replay.integrations.fastdeploy.stream": [_stream],
    })
