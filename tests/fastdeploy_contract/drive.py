"""One request driven through FastDeploy's step code around our manager, with any forward.

What ``test_capture.run_request`` does for its stand-in MoE layers, for a caller-given
forward pass (FastDeploy's MoE layers with EPLB or chunked MoE, ERNIE-4.5-VL's MoE, a whole
FastDeploy model): per step the ``ForwardMeta`` fields the MoE layers read, then FastDeploy's
real ``post_process_normal`` (its routing block runs against our manager; the two compiled
ops around it stood in) and, with 2.6, ``flush_pending_save`` and the engine's
``_finalize_routing`` through FastDeploy's token processor.  Each call site is cited where
the runner makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fdctx
import numpy as np
import paddle

from fd_routing_replay import RoutingReader, open_store
from fd_routing_replay.integrations.fastdeploy import api as fd_api

STEP = fdctx.GENERATION == fd_api.STEP_BUFFER
UUID = "0f8fad5b-d9cb-469f-a165-70867728950e"
EOS = 2


@dataclass
class Request:
    """A request of ``prompt_len`` tokens generating ``new_tokens``, prefilled in ``chunks``
    (chunked prefill: the prompt's split points), in slot 0; ``cached`` leading tokens are a
    prefix-cache hit (their KV blocks, ``blocks``' first ones, hold another request's rows)."""

    prompt_len: int
    new_tokens: int
    rollout_id: str = "exp_1:7:0:0"
    chunks: tuple[int, ...] = ()
    blocks: np.ndarray | None = None
    cached: int = 0
    expected: list[np.ndarray] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return f"chatcmpl-{self.rollout_id}-{UUID}_0"

    def steps(self) -> list[tuple[int, int]]:
        """``(tokens this step, tokens already in the cache)`` per step."""
        cuts = [self.cached, *self.chunks, self.prompt_len]
        prefill = [(b - a, a) for a, b in zip(cuts, cuts[1:], strict=False)]
        return prefill + [(1, self.prompt_len + i) for i in range(self.new_tokens - 1)]


def start(env, **config: Any) -> tuple[Any, Any, Any]:
    """FDConfig, runner and (2.6) engine side; ``loaded_model`` (a ``paddle.nn.Layer``, or a
    function of the FDConfig that builds one) becomes the runner's loaded model before
    ``GpuWorker.initialize_cache`` installs our manager; ``prepare(fd_config)`` runs first."""
    model = config.pop("loaded_model", None)
    prepare = config.pop("prepare", None)
    fd_config = fdctx.make_fd_config(env, **config)
    if prepare is not None:
        prepare(fd_config)
    return install(fd_config, model(fd_config) if callable(model) else model)


def install(fd_config: Any, model: Any) -> tuple[Any, Any, Any]:
    """Our manager installed by FastDeploy for ``fd_config`` with ``model`` loaded: the
    runner and (2.6) the engine side."""
    from fd_routing_replay.integrations.fastdeploy.engine import EngineRoutingManager

    runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=64)
    runner.model = model
    engine = EngineRoutingManager(fd_config, 64) if STEP else None
    fdctx.make_worker(runner, fd_config).initialize_cache(64)       # gpu_worker.py:182-189
    return fd_config, runner, engine


def run(env, monkeypatch, fd_config, runner, request: Request,
        forward: Callable[[Any, int, int, int], np.ndarray], *, seed: int = 0,
        between: Callable[[int], None] | None = None) -> None:
    """Every step of ``request``: ``forward(meta, step, tokens, cached)`` runs the MoE and
    returns the top-k it computed ``[L, tokens, K]``; ``between(step)`` runs before a step."""
    from test_capture import post_process

    rng = np.random.default_rng(seed)
    manager = runner.routing_replay_manager
    block_size = fd_config.cache_config.block_size
    if request.blocks is None:
        request.blocks = rng.permutation(64)[: (request.prompt_len + request.new_tokens) // block_size + 1].astype("int32")
    share = runner.share_inputs
    bsz = share["block_tables"].shape[0]
    share["block_tables"][0, : len(request.blocks)] = paddle.to_tensor(request.blocks)
    if not STEP:
        manager.register_request(batch_id=0, request_id=request.request_id)        # gpu_model_runner.py:825
    steps = request.steps()
    for step, (n, cached) in enumerate(steps):
        if between is not None:
            between(step)
        if not STEP and 0 < cached < request.prompt_len:
            manager.register_request(batch_id=0, request_id=request.request_id)    # the next prefill chunk
        buffer = manager.get_device_routing_buffer() if STEP else manager.get_routing_table()
        meta, _, positions = fdctx.forward_meta(buffer, lens_this_time=[n], lens_decoder=[cached])
        if not STEP:   # gpu_model_runner.py:2316-2320
            manager.pending_update_positions = manager.get_token_positions(
                seq_lens_decoder=paddle.to_tensor(np.array([cached] + [0] * (bsz - 1), dtype="int32")),
                seq_lens_this_time=paddle.to_tensor(np.array([n] + [0] * (bsz - 1), dtype="int32")))
        request.expected.append(forward(meta, step, n, cached))
        share["step_seq_lens_decoder"] = paddle.zeros([bsz, 1], dtype="int32")
        share["prompt_lens"] = paddle.to_tensor(np.array([[request.prompt_len]] + [[0]] * (bsz - 1), dtype="int64"))
        # Stand-in for get_position_ids_and_slot_mapping (a GPU op, gpu_model_runner.py:1334):
        slots = request.blocks[positions // block_size].astype("int64") * block_size + positions % block_size
        share["slot_mapping_buffer"] = paddle.to_tensor(slots)
        share["position_ids_buffer"] = paddle.to_tensor(positions)
        share["ids_remove_padding"] = paddle.zeros([n], dtype="int64")
        last = step == len(steps) - 1
        post_process(monkeypatch, manager, share, sampled=EOS if last else 7, n=n, decoded=cached,
                     block_size=block_size)
        if STEP:       # after post_process_event.synchronize(): gpu_model_runner.py:2328-2329
            manager.flush_pending_save()


def finish(env, fd_config, runner, engine, request: Request, *, close: bool = True) -> Any:
    """Finish the request (2.6: on the engine, through FastDeploy's token processor) and read
    its record back with :class:`RoutingReader`; ``close``: the engine side and manager too
    (else the record is read once the writer has stored it)."""
    if STEP:
        from test_capture import finish_on_engine

        finish_on_engine(runner, engine, request.request_id, request.prompt_len, request.new_tokens,
                         request.blocks)
        if close:
            engine.close()
        elif not engine.flush(60):
            raise AssertionError("the engine's writer did not store the record in 60 s")
    if close:
        runner.routing_replay_manager.close()
    elif not STEP and not runner.routing_replay_manager.flush(60):
        raise AssertionError("the manager's writer did not store the record in 60 s")
    return RoutingReader(open_store(f"local://{env / 'store'}")).get(request.rollout_id)


def expected_rows(request: Request) -> np.ndarray:
    """The top-k the forward passes computed, ``[L, prompt + generated - 1, K]``."""
    return np.concatenate(request.expected, axis=1)
