"""The FastDeploy glue, tested for everything that runs without FastDeploy.

FastDeploy's own code judges the glue in ``tests/fastdeploy_contract`` (``make contract``,
all three FastDeploy versions).  Here FastDeploy's objects are plain namespaces with the
attributes the glue reads, so the pure logic (config precedence, geometry and the MoE
layer map per model family, refusals, the runner subclass's idempotence) is tested in
the main suite, and the manager the glue builds is driven through the harness engine
into a real local store through the real background writer.
"""

from __future__ import annotations

import configparser
import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fd_routing_replay.capture.fd25 import RoutingReplayManager
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.integrations import fastdeploy as glue
from fd_routing_replay.integrations.fastdeploy import setup as fd_setup

ROOT = Path(__file__).resolve().parents[2]
TABLE_API = SimpleNamespace(generation="table", hook_name="save_routing_to_buffer", original_hook=None,
                            fastdeploy_version="test", members_used=frozenset({"register_request"}))


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
        "  capacity_bytes: 16MiB\n"
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
                            ("fastdeploy.token_processor_plugins", glue.token_processor_plugin)):
        assert group in entry_points, f"setup.cfg does not declare {group}"
        lines = [line.strip() for line in entry_points[group].splitlines() if line.strip()]
        assert len(lines) == 1, lines
        name, target = (part.strip() for part in lines[0].split("=", 1))
        assert name == "fd_routing_replay"          # what FD_PLUGINS must name
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr) is function
    assert "fastdeploy.model_register_plugins" not in entry_points   # the hook is bound at start-up


def test_fastdeploy_flat_keys_and_yaml_precedence(tmp_path):
    yaml_path = write_yaml(tmp_path, "retention:\n  only_last_turn: false\ncapture:\n  fused: false\n")
    env = {"FD_ROUTING_REPLAY_CONFIG": str(yaml_path)}
    # FastDeploy keys at FastDeploy's defaults do not override the YAML
    config = fd_setup.config_from_fastdeploy_config(fd_config(), env=env)
    assert config.enabled and config.store.namespace == "glue" and config.capture.fused is False
    assert config.store.local.root == str(tmp_path / "store")
    # keys that differ from FastDeploy's defaults win
    config = fd_setup.config_from_fastdeploy_config(
        fd_config(only_last_turn=True, use_fused_put=True, local_store_dir=str(tmp_path / "x")), env=env)
    assert config.retention.only_last_turn and config.capture.fused
    assert config.store.local.root == str(tmp_path / "x")
    # "rdma" maps to the p2pstore backend; the switch is always FastDeploy's
    config = fd_setup.config_from_fastdeploy_config(
        fd_config(enable_routing_replay=False, routing_store_type="rdma",
                  rdma_store_server="redis://127.0.0.1:1/0"), env={})
    assert not config.enabled and config.store.type == "p2pstore"
    assert config.store.p2pstore.metadata_server == "redis://127.0.0.1:1/0"


def test_geometry_follows_fastdeploys_derivation():
    config = fd_config()
    geometry = fd_setup.geometry_from_fastdeploy_config(config, total_block_num=77)
    assert (geometry.num_moe_layers, geometry.top_k, geometry.num_experts,
            geometry.num_shared_experts, geometry.total_block_num) == (3, 4, 16, 1, 77)
    config.model_config.architectures = ["Glm4MoeForCausalLM"]
    config.model_config.num_experts_per_tok = 8
    config.speculative_config = SimpleNamespace(method="mtp", num_speculative_tokens=2)
    geometry = fd_setup.geometry_from_fastdeploy_config(config, total_block_num=77)
    assert geometry.top_k == 8 and geometry.num_speculative_tokens == 2


def test_unsupported_setups_are_refused_by_name():
    def sequence_parallel_chunks(c):
        c.parallel_config.enable_chunked_moe = c.parallel_config.use_sequence_parallel_moe = True

    def vl(c, **model):
        c.model_config.architectures = ["Ernie4_5_VLMoeForConditionalGeneration"]
        c.model_config.moe_num_experts = [8, 8]
        for key, value in model.items():
            setattr(c.model_config, key, value)

    def vl_tp_ep(c):
        vl(c)
        c.parallel_config.tensor_parallel_size = c.parallel_config.expert_parallel_size = 2

    cases = [
        (sequence_parallel_chunks, "table", "enable_chunked_moe with TP x EP sequence-parallel MoE"),
        (lambda c: (vl(c), setattr(c.parallel_config, "enable_chunked_moe", True)), "table",
         "enable_chunked_moe with Ernie4_5_VLMoeForConditionalGeneration's per-modality expert groups"),
        (vl_tp_ep, "table", "Ernie4_5_VLMoeForConditionalGeneration's per-modality expert groups with TP x EP"),
        (lambda c: vl(c, moe_layer_end_index=[3, 2]), "table", "list-valued .*moe_layer_end_index.*text and image"),
        (lambda c: setattr(c.model_config, "moe_num_experts", [8, 8, 8]), "table", r"\[text, image\]"),
        (lambda c: setattr(c.scheduler_config, "splitwise_role", "prefill"), "table",
         "FastDeploy 2.5 .*does not support PD disaggregation \\(splitwise_role='prefill'\\)"),
        (lambda c: setattr(c, "cache_config", SimpleNamespace(block_size=8, num_cpu_blocks=100)), "table",
         "2.5 .*does not support the CPU KV cache"),
        (lambda c: setattr(c, "cache_config", SimpleNamespace(block_size=8, kvcache_storage_backend="mooncake")),
         "table", "kvcache_storage_backend='mooncake'"),
        (lambda c: setattr(c.routing_replay_config, "debug_mode", True), "step-buffer", "debug_mode"),
        (lambda c: setattr(c.routing_replay_config, "routing_store_type", "response"), "table", "needs FastDeploy 2.6"),
        (lambda c: setattr(c.routing_replay_config, "routing_store_type", "s3"), "table", "'s3'"),
        (lambda c: setattr(c.model_config, "moe_layer_start_index", [1, 1]), "table",
         "list-valued model config moe_layer_start_index .*subtracts it from the layer index"),
    ]
    for mutate, generation, message in cases:
        config = fd_config()
        mutate(config)
        with pytest.raises(ConfigError, match=message):
            fd_setup.check_supported(config, generation=generation, env={})
    with pytest.raises(ConfigError, match="FD_PD_REORDER"):
        fd_setup.check_supported(fd_config(), generation="table", env={"FD_PD_REORDER": "1"})
    fd_setup.check_supported(fd_config(), generation="step-buffer", env={"FD_PD_REORDER": "1"})
    fd_setup.check_supported(fd_config(routing_store_type="response"), generation="step-buffer", env={})
    # Chunked MoE, EPLB, ERNIE-4.5-VL's expert groups (one end index for both) start.
    accepted = fd_config()
    accepted.parallel_config.enable_chunked_moe = accepted.parallel_config.use_ep = True
    accepted.eplb_config = SimpleNamespace(enable_eplb=True, redundant_experts_num=4)
    fd_setup.check_supported(accepted, generation="table", env={})
    vl(accepted, moe_layer_end_index=[3, 3])
    accepted.parallel_config.enable_chunked_moe = False
    fd_setup.check_supported(accepted, generation="table", env={})
    assert fd_setup.moe_layer_map(accepted.model_config) == (1, 2, 3)
    assert fd_setup.record_metadata(accepted) == {
        "expert_groups": [{"name": "text", "first": 0, "count": 8}, {"name": "image", "first": 8, "count": 8}],
        "eplb_redundant_experts": 4}
    assert fd_setup.record_metadata(fd_config()) == {}


def fastdeploy_sized(config: SimpleNamespace) -> SimpleNamespace:
    """What FastDeploy 2.6's RoutingReplayConfig.postprocess fills in (config.py:1871-1892)."""
    model = config.model_config
    rr = config.routing_replay_config
    rr.num_moe_layers = model.num_hidden_layers - model.moe_layer_start_index
    rr.moe_top_k = model.moe_k
    rr.routing_dtype = "uint8" if model.moe_num_experts + model.moe_num_shared_experts + 1 <= 255 else "uint16"
    return config


@pytest.mark.parametrize("mutate, named", [
    (lambda c: setattr(c.scheduler_config, "splitwise_role", "decode"), "splitwise_role='decode'"),
    (lambda c: setattr(c, "cache_config", SimpleNamespace(block_size=8, swap_space=4)), "swap_space=4"),
    (lambda c: setattr(c, "cache_config", SimpleNamespace(block_size=8, kvcache_storage_backend="file")),
     "kvcache_storage_backend='file'"),
])
def test_routes_moved_by_fastdeploy_need_its_view_of_our_buffer(mutate, named):
    """2.6: allowed when FastDeploy's view of the routing host buffer can hold ours -- also
    with leading dense layers that FastDeploy counts as rows (its moe_layer_start_index
    stays at 1 here while the MoE layers start at 2: our layers are its rows 1 and 2);
    refused, naming the feature and both layouts, when the top-k or dtype disagree."""
    config = fastdeploy_sized(fd_config())
    mutate(config)
    assert fd_setup.fastdeploy_view_columns(config) == (3, (0, 1, 2))
    fd_setup.check_supported(config, generation="step-buffer", env={})
    config.model_config.first_k_dense_replace = 2
    assert fd_setup.fastdeploy_view_columns(config) == (3, (1, 2))
    fd_setup.check_supported(config, generation="step-buffer", env={})
    config.routing_replay_config.routing_dtype = "uint16"
    assert fd_setup.fastdeploy_view_columns(config) is None
    with pytest.raises(ConfigError, match=named) as info:
        fd_setup.check_supported(config, generation="step-buffer", env={})
    assert "3 MoE layers x top-4 uint16" in str(info.value) and "2 MoE layers x top-4 uint8" in str(info.value)
    config.routing_replay_config.routing_dtype = "uint8"
    config.routing_replay_config.moe_top_k = 8
    with pytest.raises(ConfigError, match="top-8"):
        fd_setup.check_supported(config, generation="step-buffer", env={})


@pytest.mark.parametrize("fields, layers, rows", [
    ({"num_hidden_layers": 4, "moe_layer_start_index": 1}, (1, 2, 3), (0, 1, 2)),
    ({"num_hidden_layers": 6, "moe_layer_start_index": 0, "first_k_dense_replace": 3}, (3, 4, 5),
     (-1, -1, -1, 0, 1, 2)),
    ({"num_hidden_layers": 6, "moe_layer_start_index": 3, "first_k_dense_replace": 3}, (3, 4, 5), (0, 1, 2)),
    ({"num_hidden_layers": 6, "moe_layer_start_index": 1, "moe_layer_end_index": 4}, (1, 2, 3, 4),
     (0, 1, 2, 3)),
    ({"num_hidden_layers": 6, "moe_layer_start_index": 0, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
     (1, 5), (-1, 0, -1, -1, -1, 1)),
])
def test_moe_layer_map_per_model_family(fields, layers, rows):
    model = SimpleNamespace(architectures=["X"], **fields)
    assert fd_setup.moe_layer_map(model) == layers
    assert fd_setup.fastdeploy_layer_rows(model, layers) == rows


def test_moe_layer_map_refuses_a_model_without_moe_layers():
    with pytest.raises(ConfigError, match="no MoE layer"):
        fd_setup.moe_layer_map(SimpleNamespace(num_hidden_layers=2, moe_layer_start_index=5))


class StandInRunner:
    """The slice of FastDeploy's GPUModelRunner the subclass relies on."""

    def __init__(self, fd_config, share_inputs, num_gpu_blocks=40):
        self.fd_config = fd_config
        self.share_inputs = share_inputs
        self.routing_replay_manager = None
        self.num_gpu_blocks = num_gpu_blocks


def test_runner_subclass_installs_one_manager_and_keeps_it(tmp_path, monkeypatch):
    from fdrr_dev.harness.paddle_runtime import paddle

    monkeypatch.setenv("FD_ROUTING_REPLAY_CONFIG", str(write_yaml(tmp_path)))
    monkeypatch.setattr(glue, "bind_moe_hook", lambda api: None)     # no FastDeploy module to bind
    runner_cls = glue.make_runner_class(StandInRunner, TABLE_API)
    assert issubclass(runner_cls, StandInRunner)
    share_inputs = {"block_tables": paddle.full([16, 64], -1, dtype="int32")}
    runner = runner_cls(fd_config(), share_inputs)
    runner.initialize_routing_replay_manager()
    manager = runner.routing_replay_manager
    assert isinstance(manager, RoutingReplayManager)
    assert manager.host_cache.num_slots == 40 * 8 and manager.block_table is share_inputs["block_tables"]
    runner.initialize_routing_replay_manager()                 # idempotent: same manager kept
    assert runner.routing_replay_manager is manager
    runner.num_gpu_blocks = 20                                 # KV cache re-sized: replaced
    runner.initialize_routing_replay_manager()
    assert runner.routing_replay_manager is not manager
    assert runner.routing_replay_manager.host_cache.num_slots == 20 * 8
    runner.routing_replay_manager.close(10)


def test_runner_refuses_a_fastdeploy_that_uses_members_we_lack(tmp_path, monkeypatch):
    from fdrr_dev.harness.paddle_runtime import paddle

    monkeypatch.setenv("FD_ROUTING_REPLAY_CONFIG", str(write_yaml(tmp_path)))
    api = SimpleNamespace(**dict(vars(TABLE_API), members_used=frozenset({"register_request", "teleport"})))
    runner = glue.make_runner_class(StandInRunner, api)(
        fd_config(), {"block_tables": paddle.full([16, 64], -1, dtype="int32")})
    with pytest.raises(ConfigError, match="teleport"):
        runner.initialize_routing_replay_manager()
    assert runner.routing_replay_manager is None


def test_glue_manager_end_to_end_through_the_writer(tmp_path, monkeypatch, seed):
    """FastDeploy config → our manager → harness engine → writer → local store → fidelity."""
    from fd_routing_replay.config import load_config
    from fd_routing_replay.reader import RoutingReader
    from fdrr_dev.harness.engine import Engine, EngineConfig
    from fdrr_dev.harness.fidelity import check_results
    from fdrr_dev.harness.model import TinyMoEModel
    from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan

    yaml_path = write_yaml(tmp_path)
    monkeypatch.setenv("FD_ROUTING_REPLAY_CONFIG", str(yaml_path))
    config = fd_config(only_last_turn=True, use_fused_put=True)
    model = TinyMoEModel()
    engine_config = EngineConfig(max_num_seqs=16, block_size=8)
    managers = []

    def factory(share_inputs):
        runner = StandInRunner(config, share_inputs, engine_config.num_blocks)
        managers.append(glue.build_manager(runner, TABLE_API))
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
