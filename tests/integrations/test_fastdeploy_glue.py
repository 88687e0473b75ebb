"""The FastDeploy glue, tested for everything that runs without FastDeploy.

FastDeploy's GPU engine is not installable here, so FastDeploy's own objects are stood in
for by minimal classes with the attributes the glue reads (``FDConfig`` fields, a runner
base class with ``update_share_input_block_num``).  The manager the glue builds is then
driven through the harness engine — FastDeploy's call order — into a real local store
through the real background writer, and checked for fidelity.
"""

from __future__ import annotations

import configparser
import importlib
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from fd_routing_replay.capture.hook import save_routing_to_buffer
from fd_routing_replay.capture.manager import RoutingReplayManager
from fd_routing_replay.capture.noop import NoopRoutingReplayManager
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.integrations import fastdeploy as glue

ROOT = Path(__file__).resolve().parents[2]


def fd_config(**routing: object) -> SimpleNamespace:
    """An FDConfig stand-in with the fields the glue reads (FastDeploy's names)."""
    defaults = dict(enable_routing_replay=True, routing_store_type="local",
                    local_store_dir="./routing_replay_output", rdma_store_server="",
                    only_last_turn=False, use_fused_put=False)
    defaults.update(routing)
    return SimpleNamespace(
        routing_replay_config=SimpleNamespace(**defaults),
        model_config=SimpleNamespace(architectures=["Ernie4_5_MoeForCausalLM"], max_model_len=512,
                                     num_hidden_layers=4, moe_layer_start_index=1, moe_k=4,
                                     moe_num_experts=16, moe_num_shared_experts=1),
        scheduler_config=SimpleNamespace(max_num_seqs=16, splitwise_role="mixed"),
        cache_config=SimpleNamespace(block_size=8),
        parallel_config=SimpleNamespace(tensor_parallel_rank=0, enable_chunked_moe=False),
        speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
    )


def write_yaml(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "rr.yaml"
    path.write_text(
        "store:\n"
        "  type: local\n"
        "  namespace: glue\n"
        f"  local:\n    root: {tmp_path / 'store'}\n"
        "writer:\n"
        "  mode: thread\n"
        f"  journal_dir: {tmp_path / 'journal'}\n"
        f"  dead_letter_dir: {tmp_path / 'dead'}\n" + extra)
    return path


def test_importing_the_glue_imports_neither_fastdeploy_nor_paddle():
    code = ("import sys, fd_routing_replay.integrations.fastdeploy as g; "
            "bad = [m for m in ('fastdeploy', 'paddle') if m in sys.modules]; "
            "assert not bad, bad; assert callable(g.model_runner_plugin)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_entry_points_are_declared_and_resolve():
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    entry_points = parser["options.entry_points"]
    for group, function in (("fastdeploy.model_runner_plugins", glue.model_runner_plugin),
                            ("fastdeploy.model_register_plugins", glue.register_model_plugin)):
        assert group in entry_points, f"setup.cfg does not declare {group}"
        lines = [line.strip() for line in entry_points[group].splitlines() if line.strip()]
        assert len(lines) == 1, lines
        name, target = (part.strip() for part in lines[0].split("=", 1))
        assert name == "fd_routing_replay"          # what FD_PLUGINS must name
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr) is function


def test_fastdeploy_flat_keys_and_yaml_precedence(tmp_path):
    yaml_path = write_yaml(tmp_path, "retention:\n  only_last_turn: false\ncapture:\n  fused: false\n")
    env = {"FD_ROUTING_REPLAY_CONFIG": str(yaml_path)}
    # FastDeploy keys at FastDeploy's defaults do not override the YAML
    config = glue.config_from_fastdeploy_config(fd_config(), env=env)
    assert config.enabled and config.store.namespace == "glue" and config.capture.fused is False
    assert config.store.local.root == str(tmp_path / "store")
    # keys that differ from FastDeploy's defaults win
    config = glue.config_from_fastdeploy_config(
        fd_config(only_last_turn=True, use_fused_put=True, local_store_dir=str(tmp_path / "x")), env=env)
    assert config.retention.only_last_turn and config.capture.fused
    assert config.store.local.root == str(tmp_path / "x")
    # "rdma" maps to the p2pstore backend; the switch is always FastDeploy's
    config = glue.config_from_fastdeploy_config(
        fd_config(enable_routing_replay=False, routing_store_type="rdma",
                  rdma_store_server="redis://127.0.0.1:1/0"), env={})
    assert not config.enabled and config.store.type == "p2pstore"
    assert config.store.p2pstore.metadata_server == "redis://127.0.0.1:1/0"


def test_geometry_follows_fastdeploys_derivation():
    config = fd_config()
    geometry = glue.geometry_from_fastdeploy_config(config, total_block_num=77)
    assert (geometry.num_moe_layers, geometry.top_k, geometry.num_experts,
            geometry.num_shared_experts, geometry.total_block_num) == (3, 4, 16, 1, 77)
    config.model_config.architectures = ["Glm4MoeForCausalLM"]
    config.model_config.num_experts_per_tok = 8
    config.speculative_config = SimpleNamespace(method="mtp", num_speculative_tokens=2)
    geometry = glue.geometry_from_fastdeploy_config(config, total_block_num=77)
    assert geometry.top_k == 8 and geometry.num_speculative_tokens == 2


def test_unsupported_setups_are_refused_by_name():
    config = fd_config()
    config.parallel_config.enable_chunked_moe = True
    with pytest.raises(ConfigError, match="enable_chunked_moe"):
        glue.check_supported(config)
    config = fd_config()
    config.scheduler_config.splitwise_role = "prefill"
    with pytest.raises(ConfigError, match="splitwise_role"):
        glue.check_supported(config)


def test_rebind_moe_hook():
    moe = types.ModuleType("fake_fastdeploy_moe")
    moe.save_routing_to_buffer = lambda **kwargs: None
    other = types.ModuleType("without_hook")
    assert glue.rebind_moe_hook([moe, other]) == ["fake_fastdeploy_moe"]
    assert moe.save_routing_to_buffer is save_routing_to_buffer


def test_register_plugin_without_fastdeploy_logs_and_returns(caplog):
    if importlib.util.find_spec("fastdeploy") is not None:
        pytest.skip("FastDeploy is installed; covered by the end-to-end test")
    glue.register_model_plugin()
    assert "not supported" in caplog.text or "cannot import" in caplog.text


class StandInRunner:
    """The slice of FastDeploy's GPUModelRunner the subclass relies on."""

    def __init__(self, fd_config, share_inputs):
        self.fd_config = fd_config
        self.share_inputs = share_inputs
        self.routing_replay_manager = None
        self.num_gpu_blocks = 0

    def update_share_input_block_num(self, num_gpu_blocks):
        self.num_gpu_blocks = num_gpu_blocks


def test_runner_subclass_installs_our_manager(tmp_path, monkeypatch):
    from fd_routing_replay.harness._paddle import paddle

    monkeypatch.setenv("FD_ROUTING_REPLAY_CONFIG", str(write_yaml(tmp_path)))
    runner_cls = glue.make_runner_class(StandInRunner)
    assert issubclass(runner_cls, StandInRunner)
    share_inputs = {"block_tables": paddle.full([16, 64], -1, dtype="int32")}
    runner = runner_cls(fd_config(), share_inputs)
    runner.update_share_input_block_num(40)
    manager = runner.routing_replay_manager
    assert isinstance(manager, RoutingReplayManager)
    assert manager.host_cache.num_slots == 40 * 8 and manager.block_table is share_inputs["block_tables"]
    runner.update_share_input_block_num(40)                 # idempotent: same manager kept
    assert runner.routing_replay_manager is manager
    manager.close(10)
    off = runner_cls(fd_config(enable_routing_replay=False), share_inputs)
    off.update_share_input_block_num(40)
    assert off.routing_replay_manager is None                # FastDeploy's own "off"
    off.initialize_routing_replay_manager()
    assert isinstance(off.routing_replay_manager, NoopRoutingReplayManager)


def test_glue_manager_end_to_end_through_the_writer(tmp_path, monkeypatch, seed):
    """FastDeploy config → our manager → harness engine → writer → local store → fidelity."""
    from fd_routing_replay.config import load_config
    from fd_routing_replay.harness.engine import Engine, EngineConfig
    from fd_routing_replay.harness.fidelity import check_results
    from fd_routing_replay.harness.model import TinyMoEModel
    from fd_routing_replay.harness.rollouts import RolloutDriver, RolloutPlan
    from fd_routing_replay.reader import RoutingReader

    yaml_path = write_yaml(tmp_path)
    monkeypatch.setenv("FD_ROUTING_REPLAY_CONFIG", str(yaml_path))
    config = fd_config(only_last_turn=True, use_fused_put=True)
    model = TinyMoEModel()
    engine_config = EngineConfig(max_num_seqs=16, block_size=8)
    managers = []

    def factory(share_inputs):
        managers.append(glue.manager_from_fastdeploy(config, share_inputs, engine_config.num_blocks))
        return managers

    engine = Engine(model, factory, engine_config)
    driver = RolloutDriver(RolloutPlan(num_rollouts=6, num_turns=2, seed=seed % 1000),
                           model.config.vocab_size, model.config.eos_token_id)
    results = driver.run(engine)
    manager = managers[0]
    assert manager.flush(30)
    manager.close(30)
    finals = {r.rollout_id.rsplit(":", 2)[0]: r.rollout_id for r in results if r.finish_reason != "abort"}
    store_config = load_config(yaml_path, env={}).store
    with RoutingReader(store_config) as reader:
        report = check_results(results, reader.get, lambda version: model,
                               expect_present=lambda r: r.rollout_id in set(finals.values()))
        assert report.passed, report.summary() + "\n".join(report.failures)
        assert sorted(reader.store.list()) == sorted(finals.values())     # only_last_turn
        record = reader.get(next(iter(finals.values())))
        assert record.metadata["engine"] == "fastdeploy"
