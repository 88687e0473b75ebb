"""Start-up and lifecycle, driven by FastDeploy's own loader, worker and runner code."""

from __future__ import annotations

import importlib

import pytest

fdctx = pytest.importorskip("fdctx", reason="FastDeploy is not importable (see conftest)")

from fd_routing_replay.capture.fd25 import RoutingReplayManager  # noqa: E402
from fd_routing_replay.capture.fd26 import StepRoutingCapturer  # noqa: E402
from fd_routing_replay.errors import ConfigError  # noqa: E402
from fd_routing_replay.integrations.fastdeploy import api as fd_api  # noqa: E402
from fd_routing_replay.integrations.fastdeploy.engine import EngineRoutingManager  # noqa: E402

OURS = StepRoutingCapturer if fdctx.GENERATION == fd_api.STEP_BUFFER else RoutingReplayManager


def started(env, **kwargs):
    """FastDeploy's GpuWorker.initialize_cache on the runner its plugin loader returns."""
    fd_config = fdctx.make_fd_config(env, **kwargs)
    cls = fdctx.runner_class()
    runner = fdctx.make_runner(cls, fd_config, num_blocks=64)
    engine = None
    if fdctx.GENERATION == fd_api.STEP_BUFFER:      # 2.6: the engine creates the slot cache first
        engine = EngineRoutingManager(fd_config, 64)
    worker = fdctx.make_worker(runner, fd_config)
    worker.initialize_cache(64)
    return fd_config, runner, worker, engine


def test_plugin_loader_returns_our_runner(env):
    from fastdeploy.worker.gpu_model_runner import GPUModelRunner

    cls = fdctx.runner_class()
    assert issubclass(cls, GPUModelRunner) and cls is not GPUModelRunner
    assert "initialize_routing_replay_manager" in vars(cls)
    assert "update_share_input_block_num" not in vars(cls)     # the double-manager fallback is gone


def test_loader_loads_nothing_without_fd_plugins(env, monkeypatch):
    from fastdeploy.plugins.utils import load_plugins_by_group

    monkeypatch.delenv("FD_PLUGINS")
    assert load_plugins_by_group("fastdeploy.model_runner_plugins") == {}


def test_initialize_cache_installs_exactly_one_manager(env, monkeypatch):
    from fd_routing_replay import writer as writer_module

    made = []
    original = writer_module.RoutingWriter.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(writer_module.RoutingWriter, "__init__", counting)
    fd_config, runner, worker, engine = started(env)
    try:
        manager = runner.routing_replay_manager
        assert isinstance(manager, OURS)
        expected_writers = 1 if fdctx.GENERATION == fd_api.STEP_BUFFER else 1   # engine's, or the worker's
        assert len(made) == expected_writers
        worker.initialize_cache(64)                        # again, same KV size: kept
        assert runner.routing_replay_manager is manager
        assert len(made) == expected_writers
        worker.initialize_cache(32)                        # re-sized: replaced, old one closed
        assert runner.routing_replay_manager is not manager
        from fd_routing_replay.capture.device import _BINDINGS
        old_buffer = (manager.get_device_routing_buffer() if OURS is StepRoutingCapturer
                      else manager.get_routing_table())
        assert id(old_buffer) not in _BINDINGS             # the old buffer is released by the hook
    finally:
        runner.routing_replay_manager.close()
        if engine is not None:
            engine.close()


def test_disabled_routing_replay_installs_nothing(env):
    moe = importlib.import_module(fd_api.MOE_MODULE)
    before = getattr(moe, fdctx.API.hook_name)
    fd_config = fdctx.make_fd_config(env, routing={"enable_routing_replay": False})
    runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=64)
    fdctx.make_worker(runner, fd_config).initialize_cache(64)
    assert runner.routing_replay_manager is None
    assert getattr(moe, fdctx.API.hook_name) is before


def test_every_manager_member_fastdeploy_uses_exists(env):
    used = fd_api.manager_members_used(fd_api.runner_sources())
    if fdctx.GENERATION == fd_api.STEP_BUFFER:
        assert {"get_device_routing_buffer", "prepare_pending_save", "flush_pending_save",
                "clear", "tp_rank", "debug_mode", "token_num_overlap"} <= used
    else:
        assert {"register_request", "clear_request", "get_token_positions", "compute_slot_mapping",
                "update_host_cache", "put_finished_batch", "get_routing_table", "clear_all_request",
                "pending_update_positions"} <= used
    fd_config, runner, worker, engine = started(env)
    try:
        missing = sorted(name for name in used if not hasattr(runner.routing_replay_manager, name))
        assert missing == []
    finally:
        runner.routing_replay_manager.close()
        if engine is not None:
            engine.close()


def test_a_manager_lacking_a_member_is_refused_by_name():
    class Partial:
        pass

    with pytest.raises(ConfigError, match="prepare_pending_save"):
        fd_api.check_manager_covers(Partial(), {"prepare_pending_save"})


def test_clear_requests_reaches_our_manager(env):
    fd_config, runner, worker, engine = started(env)
    manager = runner.routing_replay_manager
    calls = []
    name = "clear" if fdctx.GENERATION == fd_api.STEP_BUFFER else "clear_all_request"
    original = getattr(manager, name)
    setattr(manager, name, lambda: (calls.append(name), original())[1])
    try:
        runner.clear_requests()                            # FastDeploy's own method
        assert calls == [name]
        assert bool(runner.share_inputs["stop_flags"].all())
    finally:
        manager.close()
        if engine is not None:
            engine.close()


def test_unsupported_interface_is_refused_naming_the_version():
    import types

    moe = types.ModuleType("moe")
    moe.save_routing_to_buffer = lambda table, ids: None
    with pytest.raises(ConfigError, match="does not support the routing replay interface of FastDeploy"):
        fd_api.detect_api(types.ModuleType("cache"), moe)


def test_xpu_worker_keeps_its_own_runner(env, monkeypatch):
    from fastdeploy.platforms import current_platform
    from fastdeploy.plugins.model_runner import load_model_runner_plugins

    monkeypatch.setattr(type(current_platform), "is_xpu", lambda self: True)
    # xpu_worker.py wraps this call in try/except and falls back to XPUModelRunner.
    with pytest.raises(ConfigError, match="runs on xpu"):
        load_model_runner_plugins()


def test_fastdeploy_flag_json_is_parsed_by_fastdeploy_then_us(env):
    from fd_routing_replay.integrations.fastdeploy.setup import config_from_fastdeploy_config

    fd_config = fdctx.make_fd_config(env, routing={"only_last_turn": True, "use_fused_put": True,
                                                   "unknown_key": 1, "rdma_store_server": "None"})
    ours = config_from_fastdeploy_config(fd_config, env={})
    assert ours.enabled and ours.retention.only_last_turn
    assert ours.store.type == "local"
    assert ours.store.local.root == str(env / "store")


@pytest.mark.parametrize("setting", [{"cache": {"swap_space": 1}}, {"role": "prefill"}])
def test_kv_moving_features_start_only_where_fastdeploy_moves_the_routing(env, setting):
    """CPU KV cache and PD disaggregation: FastDeploy 2.6 moves routing rows with the KV
    blocks through its view of the routing host buffer, so they start there when that view
    reads our slot cache exactly; 2.5 has no such path and refuses them at start-up."""
    def start(model=None):
        fd_config = fdctx.make_fd_config(env, cache=setting.get("cache"), model=model)
        fd_config.scheduler_config.splitwise_role = setting.get("role", "mixed")
        runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=64)
        engine = EngineRoutingManager(fd_config, 64) if fdctx.GENERATION == fd_api.STEP_BUFFER else None
        try:
            fdctx.make_worker(runner, fd_config).initialize_cache(64)
            return runner.routing_replay_manager
        finally:
            if runner.routing_replay_manager is not None:
                runner.routing_replay_manager.close()
            if engine is not None:
                engine.close()

    named = "swap_space=1" if "cache" in setting else "splitwise_role='prefill'"
    if fdctx.GENERATION != fd_api.STEP_BUFFER:
        with pytest.raises(ConfigError, match=f"FastDeploy 2.5 .*does not support .*{named}"):
            start()
        return
    assert start() is not None
    # DeepSeek-style leading dense layers: FastDeploy sizes its view with moe_layer_start_index 0
    # (5 rows); the slot cache takes that layout, our 3 MoE layers in rows 2..4
    assert start(model={"moe_layer_start_index": 0, "first_k_dense_replace": 2}) is not None
    fd_config = fdctx.make_fd_config(env, model={"moe_layer_start_index": 0, "first_k_dense_replace": 2})
    fd_config.routing_replay_config.moe_top_k = 8            # a view that cannot hold ours
    fd_config.scheduler_config.splitwise_role = setting.get("role", "mixed")
    if "cache" in setting:
        fd_config.cache_config.swap_space = 1
    with pytest.raises(ConfigError, match=f"{named}.*5 MoE layers x top-8 uint16 while this model's "
                                          "routing is 3 MoE layers x top-4"):
        EngineRoutingManager(fd_config, 64)


def test_list_valued_moe_layer_start_index_is_a_config_error(env):
    from fd_routing_replay.integrations.fastdeploy.setup import check_supported

    fd_config = fdctx.make_fd_config(env)
    fd_config.model_config.moe_layer_start_index = [1, 1]      # multimodal ERNIE-VL style
    with pytest.raises(ConfigError, match="list-valued"):
        check_supported(fd_config, generation=fdctx.GENERATION, env={})


@pytest.mark.skipif(fdctx.GENERATION == fd_api.STEP_BUFFER, reason="2.6 writes from the engine, one per DP rank")
def test_two_dp_ranks_on_one_host_get_their_own_writer(env):
    managers = []
    try:
        for dp_rank in (0, 1):
            fd_config = fdctx.make_fd_config(env)
            fd_config.parallel_config.data_parallel_rank = dp_rank
            runner = fdctx.make_runner(fdctx.runner_class(), fd_config, num_blocks=64)
            fdctx.make_worker(runner, fd_config).initialize_cache(64)
            managers.append(runner.routing_replay_manager)
        journals = {m.writer.stats()["journal_dir"] for m in managers}
        assert len(journals) == 2
        assert not any(p.name == "routing_replay_output" for p in env.iterdir())   # nothing in cwd
    finally:
        for manager in managers:
            manager.close()


def test_plugin_log_lines_reach_fastdeploys_log(env):
    import logging
    import os
    from pathlib import Path

    from fastdeploy.utils import get_logger

    from fd_routing_replay.integrations.fastdeploy import route_logs_to_fastdeploy

    route_logs_to_fastdeploy(get_logger("gpu_worker", "gpu_worker.log"))
    logging.getLogger("fd_routing_replay.capture.fd25").info("fd-routing-replay: probe line 8361")
    for handler in logging.getLogger("fd_routing_replay").handlers:
        handler.flush()
    logs = "".join(p.read_text(errors="replace") for p in Path(os.environ["FD_LOG_DIR"]).rglob("*")
                   if p.is_file())
    assert "probe line 8361" in logs
