"""Tests for fd_routing_replay.config: defaults, sources and precedence, every error path,
FastDeploy's flat JSON, the example configs and the generated docs table."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from fd_routing_replay.config import (
    CONFIG_ENV_VAR,
    RoutingReplayConfig,
    StoreConfig,
    WriterConfig,
    config_from_dict,
    config_from_fastdeploy,
    config_to_dict,
    env_var_name,
    iter_fields,
    load_config,
    render_config_doc,
)
from fd_routing_replay.core import parsing as _parse
from fd_routing_replay.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
GiB, MiB = 2**30, 2**20


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and key != "options":
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


# ---------------------------------------------------------------------------- defaults


def test_defaults_match_the_contract():
    cfg = load_config(env={})
    assert cfg == RoutingReplayConfig()
    assert cfg.enabled is False
    assert (cfg.store.type, cfg.store.url, cfg.store.namespace) == ("local", None, "routing_replay")
    assert cfg.store.local.root == "./routing_replay_output" and cfg.store.local.fsync is False
    assert cfg.store.options == {}
    assert cfg.store.p2pstore.protocol == "rdma" and cfg.store.p2pstore.device == "auto"
    assert cfg.store.p2pstore.max_delete_batch == 1000
    assert cfg.store.redis.url.startswith("redis://") and cfg.store.redis.chunk_bytes == MiB
    assert (cfg.writer.mode, cfg.writer.full_policy) == ("process", "spill")
    assert cfg.writer.capacity_bytes == GiB and cfg.writer.metrics_port == 0
    assert cfg.writer.clear_on_start is False
    assert cfg.writer.journal_dir == "" and cfg.writer.dead_letter_dir == ""  # derived per rank
    assert cfg.capture.record_format == "rr-v1" and cfg.capture.fused is True
    assert cfg.capture.pad_to_max_model_len is False
    assert cfg.retention.only_last_turn is False


@pytest.mark.parametrize("path", [
    "enabled", "store.type", "store.url", "store.namespace", "store.options",
    "store.local.root", "store.local.fsync", "store.redis.url", "store.redis.username",
    "store.redis.password", "store.redis.chunk_bytes", "store.redis.socket_timeout_s",
    "store.redis.cluster", "store.p2pstore.metadata_server", "store.p2pstore.protocol",
    "store.p2pstore.device", "store.p2pstore.local_host", "store.p2pstore.log_dir",
    "store.p2pstore.max_delete_batch",
    "writer.mode", "writer.capacity_bytes", "writer.full_policy", "writer.block_timeout_s",
    "writer.journal_dir", "writer.dead_letter_dir", "writer.retry_deadline_s",
    "writer.retry_initial_backoff_s", "writer.retry_max_backoff_s", "writer.close_timeout_s",
    "writer.metrics_port", "writer.clear_on_start", "capture.record_format", "capture.fused",
    "capture.pad_to_max_model_len", "retention.only_last_turn",
])
def test_contract_attribute_paths_exist(path):
    node = load_config(env={})
    for part in path.split("."):
        node = getattr(node, part)
    assert path in {item.path for item in iter_fields()}


def test_configs_are_frozen_and_validated_on_replace():
    cfg = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.enabled = True  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"store\.namespace: must match"):
        dataclasses.replace(cfg.store, namespace="../escape")
    assert dataclasses.replace(cfg.store, namespace="exp_2").namespace == "exp_2"


def test_direct_construction_coerces_and_validates():
    assert WriterConfig(capacity_bytes="512MiB").capacity_bytes == 512 * MiB
    assert WriterConfig(block_timeout_s=3).block_timeout_s == 3.0
    with pytest.raises(ConfigError, match=r"writer\.full_policy: invalid value 'never'"):
        WriterConfig(full_policy="never")
    with pytest.raises(ConfigError, match=r"store: expected StoreConfig"):
        RoutingReplayConfig(store={"type": "local"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="store.p2pstore.metadata_server is required"):
        RoutingReplayConfig(store=StoreConfig(type="p2pstore"))


# ---------------------------------------------------------------------------- precedence


def test_precedence_file_env_overrides(tmp_path):
    cfg_file = write(tmp_path, "rr.yaml", """
enabled: true
store:
  namespace: from_file
  local: {root: /file/root, fsync: true}
writer: {capacity_bytes: 1GiB, full_policy: block, metrics_port: 9000}
""")
    env = {"FD_RR_STORE__LOCAL__ROOT": "/env/root", "FD_RR_WRITER__CAPACITY_BYTES": "2GiB",
           "FD_RR_WRITER__METRICS_PORT": "9100", "PATH": "/usr/bin"}
    overrides = {"writer": {"capacity_bytes": "3GiB"}}

    only_file = load_config(cfg_file, env={})
    assert (only_file.store.local.root, only_file.writer.capacity_bytes) == ("/file/root", GiB)

    file_env = load_config(cfg_file, env=env)
    assert file_env.store.local.root == "/env/root"              # env beats file
    assert file_env.writer.capacity_bytes == 2 * GiB
    assert file_env.writer.metrics_port == 9100
    assert file_env.store.namespace == "from_file"               # file beats default
    assert file_env.store.local.fsync is True
    assert file_env.writer.full_policy == "block"
    assert file_env.writer.mode == "process"                     # default survives

    everything = load_config(cfg_file, overrides, env=env)
    assert everything.writer.capacity_bytes == 3 * GiB           # overrides beat env
    assert everything.store.local.root == "/env/root"
    assert everything.enabled is True


def test_config_file_from_env_var(tmp_path):
    named = write(tmp_path, "named.yaml", "store: {namespace: named}\n")
    explicit = write(tmp_path, "explicit.yaml", "store: {namespace: explicit}\n")
    assert load_config(env={CONFIG_ENV_VAR: str(named)}).store.namespace == "named"
    assert load_config(explicit, env={CONFIG_ENV_VAR: str(named)}).store.namespace == "explicit"
    assert load_config(env={CONFIG_ENV_VAR: ""}).store.namespace == "routing_replay"
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(env={CONFIG_ENV_VAR: str(missing)})
    assert str(missing) in str(info.value) and CONFIG_ENV_VAR in str(info.value)


def test_process_environment_is_the_default(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("FD_RR_") or n == CONFIG_ENV_VAR]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(write(tmp_path, "c.yaml", "enabled: true\n")))
    monkeypatch.setenv("FD_RR_STORE__NAMESPACE", "from_env")
    cfg = load_config()
    assert cfg.enabled is True and cfg.store.namespace == "from_env"


def test_empty_file_and_null_section_keep_defaults(tmp_path):
    assert load_config(write(tmp_path, "empty.yaml", "# nothing\n"), env={}) == RoutingReplayConfig()
    cfg = load_config(write(tmp_path, "s.yaml", "store:\n  # local: ...\nenabled: true\n"), env={})
    assert cfg.enabled is True and cfg.store == StoreConfig()


def test_nested_json_file(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"store": {"type": "memory"}, "enabled": True}))
    cfg = load_config(path, env={})
    assert cfg.store.type == "memory" and cfg.enabled is True


# ---------------------------------------------------------------------------- environment


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False),
])
def test_env_bool_words(text, expected):
    assert load_config(env={"FD_RR_ENABLED": text}).enabled is expected


@pytest.mark.parametrize("text", ["on", "off", "y", "2", "", "truee", "enabled"])
def test_env_bool_rejects_other_words(text):
    with pytest.raises(ConfigError, match=r"enabled: invalid boolean .*FD_RR_ENABLED"):
        load_config(env={"FD_RR_ENABLED": text})


def test_env_values_parsed_by_field_type():
    cfg = load_config(env={
        "FD_RR_STORE__REDIS__CHUNK_BYTES": "1MiB",
        "FD_RR_STORE__REDIS__SOCKET_TIMEOUT_S": "2.5",
        "FD_RR_STORE__REDIS__PASSWORD": "s3cret",
        "FD_RR_STORE__P2PSTORE__MAX_DELETE_BATCH": "250",
        "FD_RR_STORE__P2PSTORE__LOG_DIR": "",           # empty -> null for optional keys
        "FD_RR_STORE__URL": "",
        "FD_RR_STORE__OPTIONS": '{"pool": 4, "tier": "ssd"}',
        "FD_RR_CAPTURE__RECORD_FORMAT": "fastdeploy-raw",
        "FD_RR_STORE__LOCAL__LAYOUT": "fastdeploy",
    })
    assert cfg.store.redis.chunk_bytes == MiB and cfg.store.redis.socket_timeout_s == 2.5
    assert cfg.store.redis.password == "s3cret"
    assert cfg.store.p2pstore.max_delete_batch == 250 and cfg.store.p2pstore.log_dir is None
    assert cfg.store.url is None
    assert cfg.store.options == {"pool": 4, "tier": "ssd"}
    assert cfg.capture.record_format == "fastdeploy-raw" and cfg.store.local.layout == "fastdeploy"


def test_fastdeploy_raw_on_the_local_store_needs_fastdeploys_layout():
    with pytest.raises(ConfigError, match="store.local.layout: fastdeploy"):
        load_config(env={"FD_RR_CAPTURE__RECORD_FORMAT": "fastdeploy-raw"})
    load_config(env={"FD_RR_CAPTURE__RECORD_FORMAT": "fastdeploy-raw", "FD_RR_STORE__TYPE": "redis"})


@pytest.mark.parametrize("name,text,message", [
    ("FD_RR_WRITER__METRICS_PORT", "9464.0", "invalid integer"),
    ("FD_RR_WRITER__METRICS_PORT", "0x10", "invalid integer"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", "nan", "invalid number"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", "1e999", "out of range"),
    ("FD_RR_WRITER__CAPACITY_BYTES", "lots", "invalid size"),
    ("FD_RR_STORE__OPTIONS", "[1, 2]", "expected a JSON object"),
    ("FD_RR_STORE__OPTIONS", "{pool: 4}", "Expecting property name"),
    ("FD_RR_WRITER__MODE", "Process", "allowed: 'process', 'thread'"),
])
def test_env_bad_values_name_variable(name, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(env={name: text})
    assert message in str(info.value) and name in str(info.value)


def test_unknown_fd_rr_variable_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config(env={"FD_RR_STORE__LOCL__ROOT": "/data"})
    assert "FD_RR_STORE__LOCL__ROOT" in str(info.value)
    assert "did you mean 'FD_RR_STORE__LOCAL__ROOT'" in str(info.value)
    with pytest.raises(ConfigError, match="unknown environment variable FD_RR_STORE"):
        load_config(env={"FD_RR_STORE": "local"})
    load_config(env={"FD_RRX": "1", "fd_rr_enabled": "maybe"})  # other prefixes are not ours


def test_package_variables_that_are_not_keys_are_left_alone():
    env = {"FD_RR_STATE_DIR": "/var/lib/fdrr", "FD_RR_OPS": "compiled", "FD_RR_OPS_AOT_DIR": "/x",
           "FD_RR_OPS_CACHE": "/y", "FD_RR_OPS_JIT": "0"}
    assert load_config(env=env) == RoutingReplayConfig()
    with pytest.raises(ConfigError, match="unknown environment variable FD_RR_STATE_DIRS"):
        load_config(env={"FD_RR_STATE_DIRS": "/x"})
    with pytest.raises(ConfigError, match="unknown environment variable FD_RR_OPS_THREADS"):
        load_config(env={"FD_RR_OPS_THREADS": "2"})      # the threaded table pack is gone


def test_every_key_has_a_distinct_env_var():
    names = [item.env_var for item in iter_fields()]
    assert len(names) == len(set(names))
    for item in iter_fields():
        assert re.fullmatch(r"FD_RR_[A-Z0-9_]+", item.env_var)
        assert env_var_name(item.path) == item.env_var


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("yaml_text,path,suggestion", [
    ("enabeld: true\n", "enabeld", "enabled"),
    ("stor: {}\n", "stor", "store"),
    ("store: {namspace: x}\n", "store.namspace", "store.namespace"),
    ("store: {locl: {root: /x}}\n", "store.locl", "store.local"),
    ("store: {local: {rot: /x}}\n", "store.local.rot", "store.local.root"),
    ("store: {p2pstore: {metadata_servr: redis://h:1}}\n", "store.p2pstore.metadata_servr",
     "store.p2pstore.metadata_server"),
    ("writer: {capacity: 1GiB}\n", "writer.capacity", "writer.capacity_bytes"),
    ("root: /x\n", "root", "store.local.root"),       # right key, wrong section
])
def test_unknown_key_names_path_suggestion_and_file(tmp_path, yaml_text, path, suggestion):
    cfg_file = write(tmp_path, "bad.yaml", yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg_file, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: unknown key")
    assert f"did you mean '{suggestion}'" in message
    assert str(cfg_file) in message


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"capture": {"zzzz": 1}}, env={})
    assert "capture.zzzz: unknown key" in str(info.value)
    assert "valid keys here: record_format, fused, pad_to_max_model_len" in str(info.value)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("overrides,path,value,expected", [
    ({"enabled": "yes"}, "enabled", "'yes'", "expected bool"),
    ({"enabled": 1}, "enabled", "1", "expected bool"),
    ({"writer": {"metrics_port": 80.0}}, "writer.metrics_port", "80.0", "expected int"),
    ({"writer": {"metrics_port": True}}, "writer.metrics_port", "True", "expected int"),
    ({"writer": {"close_timeout_s": "30"}}, "writer.close_timeout_s", "'30'", "expected float"),
    ({"store": {"type": 3}}, "store.type", "3", "expected str"),
    ({"store": {"url": ["redis://h"]}}, "store.url", "['redis://h']", "expected str or null"),
    ({"store": {"options": ["a"]}}, "store.options", "['a']", "expected dict"),
    ({"writer": {"capacity_bytes": True}}, "writer.capacity_bytes", "True", "expected a size"),
    ({"writer": {"capacity_bytes": 1.5}}, "writer.capacity_bytes", "1.5", "expected a size"),
    ({"store": {"local": {"root": None}}}, "store.local.root", "null", "expected str"),
])
def test_wrong_type_names_field_value_and_type(overrides, path, value, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message and value in message
    assert "(from overrides)" in message


def test_section_given_a_scalar():
    with pytest.raises(ConfigError, match=r"^store: is a section and needs a mapping"):
        load_config(overrides={"store": "local"}, env={})
    with pytest.raises(ConfigError, match="configuration must be a mapping"):
        load_config(overrides=["enabled"], env={})  # type: ignore[arg-type]


@pytest.mark.parametrize("path,value,allowed", [
    ("writer.mode", "proces", "'process', 'thread'"),
    ("writer.full_policy", "SPILL", "'spill', 'block', 'drop'"),
    ("capture.record_format", "rr-v2", "'rr-v1', 'fastdeploy-raw'"),
    ("store.p2pstore.protocol", "roce", "'rdma', 'tcp'"),
])
def test_bad_enum_lists_allowed_values(path, value, allowed):
    section, *rest = path.split(".")
    tree: dict = {rest[-1]: value}
    for part in reversed([section, *rest[:-1]]):
        tree = {part: tree}
    with pytest.raises(ConfigError) as info:
        load_config(overrides=tree, env={})
    assert str(info.value).startswith(f"{path}: invalid value {value!r}; allowed: {allowed}")


@pytest.mark.parametrize("text", [
    "12 parsecs", "1 gib", "GiB", "", "-1GiB", "1e3MB", "1.5B", "0.3KiB", "1,024", "1GiB 2MiB",
    "Mb", "1_000",
])
def test_bad_size_strings(tmp_path, text):
    cfg_file = write(tmp_path, "c.yaml", yaml.safe_dump({"writer": {"capacity_bytes": text}}))
    with pytest.raises(ConfigError) as info:
        load_config(cfg_file, env={})
    assert str(info.value).startswith("writer.capacity_bytes: ")
    assert repr(text) in str(info.value) and str(cfg_file) in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    ({"writer": {"capacity_bytes": -1}}, "writer.capacity_bytes: size must be >= 0, got -1"),
    ({"writer": {"capacity_bytes": 0}}, "writer.capacity_bytes: must be >= 1, got 0"),
    ({"writer": {"block_timeout_s": -0.5}}, "writer.block_timeout_s: must be >= 0, got -0.5"),
    ({"writer": {"retry_deadline_s": -1}}, "writer.retry_deadline_s: must be >= 0"),
    ({"writer": {"close_timeout_s": -1}}, "writer.close_timeout_s: must be >= 0"),
    ({"writer": {"retry_initial_backoff_s": 0}}, "writer.retry_initial_backoff_s: must be > 0"),
    ({"store": {"redis": {"socket_timeout_s": 0}}}, "store.redis.socket_timeout_s: must be > 0"),
    ({"store": {"redis": {"chunk_bytes": "1GiB"}}}, "store.redis.chunk_bytes: must be <= 536870912"),
    ({"writer": {"close_timeout_s": float("inf")}}, "writer.close_timeout_s: must be a finite"),
    ({"writer": {"metrics_port": 70000}}, "writer.metrics_port: must be <= 65535"),
    ({"writer": {"metrics_addr": "127.0.0.1:9000"}}, "writer.metrics_addr: must be an IP address"),
    ({"writer": {"metrics_addr": "[::1]"}}, "writer.metrics_addr: must be an IP address"),
    ({"writer": {"metrics_addr": "300.1.1.1"}}, "writer.metrics_addr: must be an IP address"),
    ({"writer": {"metrics_addr": ""}}, "writer.metrics_addr: must be an IP address"),
    ({"store": {"p2pstore": {"max_delete_batch": 1001}}},
     "store.p2pstore.max_delete_batch: must be <= 1000"),
    ({"store": {"p2pstore": {"max_delete_batch": 0}}},
     "store.p2pstore.max_delete_batch: must be >= 1"),
    ({"writer": {"retry_initial_backoff_s": 9, "retry_max_backoff_s": 2}},
     "writer.retry_initial_backoff_s (9.0) must be <= writer.retry_max_backoff_s (2.0)"),
])
def test_out_of_range_values(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, env={})
    assert message in str(info.value)


@pytest.mark.parametrize("overrides,path", [
    ({"store": {"namespace": "a/b"}}, "store.namespace"),
    ({"store": {"namespace": ".hidden"}}, "store.namespace"),
    ({"store": {"namespace": "x" * 65}}, "store.namespace"),
    ({"store": {"type": "my store"}}, "store.type"),
    ({"store": {"url": "/data/rr"}}, "store.url"),
    ({"store": {"local": {"root": ""}}}, "store.local.root"),
    ({"store": {"redis": {"url": "http://h:6379"}}}, "store.redis.url"),
    ({"store": {"p2pstore": {"metadata_server": "10.0.0.1:6379"}}}, "store.p2pstore.metadata_server"),
    ({"store": {"p2pstore": {"local_host": "host:0"}}}, "store.p2pstore.local_host"),
    ({"store": {"p2pstore": {"local_host": "a b"}}}, "store.p2pstore.local_host"),
    ({"store": {"p2pstore": {"device": "mlx5_0 mlx5_1"}}}, "store.p2pstore.device"),
])
def test_malformed_values(overrides, path):
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: "):
        load_config(overrides=overrides, env={})


def test_valid_addresses_and_devices():
    cfg = load_config(overrides={"store": {
        "p2pstore": {"metadata_server": "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0",
                     "local_host": "[fe80::1]:17800", "device": "mlx5_0,mlx5_1"},
        "redis": {"url": "rediss://rr:pw@redis.internal:6380/2"},
    }}, env={})
    assert cfg.store.p2pstore.device == "mlx5_0,mlx5_1"
    assert cfg.store.redis.url == "rediss://rr:pw@redis.internal:6380/2"
    cluster = load_config(env={"FD_RR_STORE__REDIS__URL": "redis+cluster://n1:7000"})
    assert cluster.store.redis.url == "redis+cluster://n1:7000"


def test_p2pstore_needs_a_metadata_server():
    with pytest.raises(ConfigError, match="store.p2pstore.metadata_server is required"):
        load_config(overrides={"store": {"type": "p2pstore"}}, env={})
    cfg = load_config(overrides={"store": {"type": "p2pstore", "url": "p2pstore://h:6379"}}, env={})
    assert cfg.store.url == "p2pstore://h:6379"


def test_secret_is_hidden_in_errors_repr_and_redacted_dump():
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"store": {"redis": {"password": 12345}}}, env={})
    assert "12345" not in str(info.value) and "'***'" in str(info.value)
    cfg = load_config(env={"FD_RR_STORE__REDIS__PASSWORD": "hunter2"})
    assert "hunter2" not in repr(cfg)
    assert config_to_dict(cfg, redact=True)["store"]["redis"]["password"] == "***"
    assert config_to_dict(cfg)["store"]["redis"]["password"] == "hunter2"


@pytest.mark.parametrize("name,text,message", [
    ("bad.yaml", "store:\n  local: [unclosed\n", "invalid YAML"),
    ("bad.yaml", "enabled: true\n  store: x\n", "invalid YAML"),
    ("tabs.yml", "store:\n\tlocal: {}\n", "invalid YAML"),
    ("dup.yaml", "enabled: true\nenabled: false\n", "duplicate key 'enabled'"),
    ("dup2.yaml", "store:\n  namespace: a\n  namespace: b\n", "duplicate key 'namespace'"),
    ("bad.json", '{"enabled": true,}', "invalid JSON"),
    ("dup.json", '{"enabled": true, "enabled": false}', "duplicate key 'enabled'"),
    ("list.yaml", "- enabled\n", "must be a mapping"),
    ("intkey.yaml", "1: true\n", "keys must be strings"),
])
def test_malformed_files_raise_config_error_naming_the_file(tmp_path, name, text, message):
    cfg_file = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg_file, env={})
    assert message in str(info.value) and str(cfg_file) in str(info.value)
    assert not isinstance(info.value, yaml.YAMLError)
    error = info.value  # no chained yaml/json traceback under the message
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    text = "base: &b {root: /a, fsync: true}\n"
    cfg_text = "store:\n  local:\n    <<: {root: /a, fsync: true}\n    root: /b\n"
    assert yaml.safe_load(text)  # sanity: plain anchors parse
    cfg = load_config(write(tmp_path, "m.yaml", cfg_text), env={})
    assert cfg.store.local.root == "/b" and cfg.store.local.fsync is True


def test_unreadable_file(tmp_path):
    cfg_file = tmp_path / "binary.yaml"
    cfg_file.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(cfg_file, env={})


# ---------------------------------------------------------------------------- FastDeploy


FLAT_FULL = {
    "enable_routing_replay": True,
    "routing_store_type": "rdma",
    "local_store_dir": "/data/fd_rr",
    "rdma_store_server": "redis://10.0.0.5:6379/0",
    "only_last_turn": True,
    "use_fused_put": False,
}


def test_fastdeploy_mapping_of_every_key():
    assert config_from_fastdeploy(FLAT_FULL) == {
        "enabled": True,
        "store": {"type": "p2pstore", "local": {"root": "/data/fd_rr"},
                  "p2pstore": {"metadata_server": "redis://10.0.0.5:6379/0"}},
        "retention": {"only_last_turn": True},
        "capture": {"fused": False},
    }
    cfg = load_config(overrides=FLAT_FULL, env={})
    assert cfg.enabled and cfg.store.type == "p2pstore" and cfg.store.local.root == "/data/fd_rr"
    assert cfg.store.p2pstore.metadata_server == "redis://10.0.0.5:6379/0"
    assert cfg.retention.only_last_turn is True and cfg.capture.fused is False
    assert config_from_dict(FLAT_FULL) == cfg
    assert config_from_fastdeploy({"routing_store_type": "local"}) == {"store": {"type": "local"}}


@pytest.mark.parametrize("key", sorted(FLAT_FULL))
def test_fastdeploy_none_string_means_unset(key):
    flat = {"enable_routing_replay": True, key: "None"}
    if key == "enable_routing_replay":
        flat = {key: "None"}
    cfg = load_config(overrides=flat, env={"FD_RR_STORE__LOCAL__ROOT": "/from/env"})
    default = RoutingReplayConfig()
    tree_path = {"enable_routing_replay": "enabled", "routing_store_type": "store.type",
                 "local_store_dir": "store.local.root",
                 "rdma_store_server": "store.p2pstore.metadata_server",
                 "only_last_turn": "retention.only_last_turn", "use_fused_put": "capture.fused"}[key]
    expected = flatten(config_to_dict(default))[tree_path]
    if tree_path == "store.local.root":
        expected = "/from/env"    # "None" leaves the lower source's value in place
    assert flatten(config_to_dict(cfg))[tree_path] == expected
    assert key not in flatten(config_from_fastdeploy({key: "None"}))
    assert config_from_fastdeploy({key: None}) == {}


def test_none_string_is_ordinary_outside_flat_keys():
    with pytest.raises(ConfigError, match=r"writer\.mode: invalid value 'None'"):
        load_config(overrides={"writer": {"mode": "None"}}, env={})
    with pytest.raises(ConfigError, match="enabled: expected bool, got str 'None'"):
        load_config(overrides={"enabled": "None"}, env={})


def test_fastdeploy_errors():
    with pytest.raises(ConfigError, match=r"routing_store_type \(store.type\): invalid value "
                                          r"'redis'; allowed: 'local', 'rdma'"):
        load_config(overrides={"routing_store_type": "redis"}, env={})
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"enable_routing_replay": True, "use_fusd_put": True}, env={})
    assert "'use_fusd_put'" in str(info.value) and "did you mean 'use_fused_put'" in str(info.value)
    with pytest.raises(ConfigError, match="cannot be mixed"):
        load_config(overrides={"enable_routing_replay": True, "store": {"type": "local"}}, env={})
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"enable_routing_replay": "true"}, env={})
    assert "enabled: expected bool" in str(info.value)
    assert "FastDeploy key 'enable_routing_replay'" in str(info.value)
    with pytest.raises(ConfigError, match="store.p2pstore.metadata_server is required"):
        load_config(overrides={"routing_store_type": "rdma", "rdma_store_server": "None"}, env={})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        config_from_fastdeploy(["enable_routing_replay"])  # type: ignore[arg-type]


def test_fastdeploy_json_file_then_env_override(tmp_path):
    path = write(tmp_path, "fd.json", json.dumps(FLAT_FULL))
    cfg = load_config(path, env={"FD_RR_CAPTURE__FUSED": "true", "FD_RR_STORE__NAMESPACE": "e1"})
    assert cfg.store.type == "p2pstore" and cfg.capture.fused is True
    assert cfg.store.namespace == "e1"
    bad = write(tmp_path, "bad.json", json.dumps({**FLAT_FULL, "only_last_turn": "yes"}))
    with pytest.raises(ConfigError) as info:
        load_config(bad, env={})
    assert str(bad) in str(info.value) and "retention.only_last_turn" in str(info.value)


# ---------------------------------------------------------------------------- round trips


def test_dict_round_trip(tmp_path):
    cfg = load_config(REPO / "configs" / "redis.yaml",
                      overrides={"store": {"options": {"a": [1, 2]}}},
                      env={"FD_RR_STORE__REDIS__PASSWORD": "pw"})
    as_dict = config_to_dict(cfg)
    assert config_from_dict(as_dict) == cfg
    dumped = write(tmp_path, "dump.yaml", yaml.safe_dump(as_dict))
    assert load_config(dumped, env={}) == cfg
    as_dict["store"]["options"]["a"].append(3)          # a copy, not a view
    assert cfg.store.options == {"a": [1, 2]}


def test_iter_fields_covers_every_leaf_with_its_default():
    items = list(iter_fields())
    defaults = flatten(config_to_dict(RoutingReplayConfig()))
    assert [item.path for item in items] == list(defaults)
    for item in items:
        path, type_name, default, doc = item          # a 4-tuple, as documented
        assert default == defaults[path], path
        assert doc and "\n" not in doc and doc.endswith("."), path
        assert type_name


# ---------------------------------------------------------------------------- parsers


def test_parse_size_against_integer_reference(rng):
    factors = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    for _ in range(500):
        number = rng.randrange(0, 10**6)
        unit = rng.choice(sorted(factors))
        space = rng.choice(["", " "])
        assert _parse.parse_size(f"{number}{space}{unit}") == number * factors[unit]
        assert _parse.parse_size(str(number)) == number
        assert _parse.parse_size(number) == number
    assert _parse.parse_size("1.5GiB") == 3 << 29
    assert _parse.parse_size("0.5KB") == 500


def test_format_size_round_trips(rng):
    for _ in range(500):
        n = rng.choice([rng.randrange(0, 1 << 50), rng.randrange(1, 4096) << rng.choice([10, 20, 30])])
        assert _parse.parse_size(_parse.format_size(n)) == n
    assert _parse.format_size(3 << 30) == "3GiB" and _parse.format_size(1000) == "1000"


# ---------------------------------------------------------------------------- examples + docs


EXPECTED_CONFIGS = {
    "local.yaml": {"enabled": True, "store.type": "local", "store.local.root": "/data/routing_replay",
                   "writer.capacity_bytes": 2 * GiB, "writer.full_policy": "spill"},
    "redis.yaml": {"store.type": "redis", "store.redis.url": "redis://10.0.0.5:6379/0",
                   "store.redis.password": None, "store.redis.chunk_bytes": MiB,
                   "retention.only_last_turn": True, "writer.metrics_port": 9464},
    "p2pstore-rdma.yaml": {"store.type": "p2pstore", "store.p2pstore.protocol": "rdma",
                           "store.p2pstore.device": "auto",
                           "store.p2pstore.metadata_server": "redis://10.0.0.5:6379/0",
                           "writer.capacity_bytes": 8 * GiB, "writer.full_policy": "block"},
    "p2pstore-tcp.yaml": {"store.type": "p2pstore", "store.p2pstore.protocol": "tcp",
                          "store.p2pstore.local_host": "127.0.0.1:17800", "writer.mode": "thread"},
    "fastdeploy-compat.json": {"enabled": True, "store.type": "p2pstore",
                               "store.local.root": "./routing_replay_output",  # "None" = unset
                               "store.p2pstore.metadata_server": "redis://10.0.0.5:6379/0",
                               "retention.only_last_turn": True, "capture.fused": True},
}


@pytest.mark.parametrize("path", sorted((REPO / "configs").iterdir()), ids=lambda p: p.name)
def test_example_config_loads(path):
    assert path.name in EXPECTED_CONFIGS, f"add expectations for {path.name} to EXPECTED_CONFIGS"
    values = flatten(config_to_dict(load_config(path, env={})))
    for key, expected in EXPECTED_CONFIGS[path.name].items():
        assert values[key] == expected, f"{path.name}: {key}"


def test_every_expected_example_exists():
    assert sorted(p.name for p in (REPO / "configs").iterdir()) == sorted(EXPECTED_CONFIGS)


def test_docs_config_table_is_in_sync():
    begin = "<!-- BEGIN GENERATED: config keys (scripts/gen_config_doc.py) -->\n"
    end = "<!-- END GENERATED: config keys -->"
    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert begin in text and end in text, "docs/config.md lost its BEGIN/END GENERATED markers"
    committed = text.split(begin, 1)[1].split(end, 1)[0]
    assert committed == render_config_doc(), (
        "docs/config.md is out of date with fd_routing_replay/config/__init__.py; regenerate it with "
        "`.venv/bin/python scripts/gen_config_doc.py`"
    )
    for item in iter_fields():
        assert f"| `{item.path}` |" in committed


# ---------------------------------------------------------------------------- hostile input
# Every problem below is one ConfigError line naming the key: no traceback, no RecursionError,
# no password, no value that passes load and fails later.

def _one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("path,value", [
    ("store.redis.url", "redis://alice:hunter2@h:notaport/0"),
    ("store.redis.url", "redis://alice:hunter2@h:99999/0"),
    ("store.redis.url", "redis://:hunter2@[::1/0"),
    ("store.url", "redis://alice:hunter2@h:notaport/0"),
    ("store.url", "rediss://alice:hunter2@[::1"),
    ("store.url", "p2pstore://alice:hunter2@h:99999/0"),
    ("store.p2pstore.metadata_server", "redis://alice:hunter2@h:notaport/0"),
    ("store.p2pstore.metadata_server", "redis+sentinel://hunter2@h1:26379,h2:99999/mymaster"),
])
def test_malformed_urls_fail_at_load_naming_the_key_without_the_password(path, value):
    section, *rest = path.split(".")
    tree: dict = {}
    node = tree
    for part in [section, *rest][:-1]:
        node = node.setdefault(part, {})
    node[path.rsplit(".", 1)[1]] = value
    message = _one_line_error(load_config, overrides=tree, env={})
    assert message.startswith(f"{path}: ") and "hunter2" not in message, message
    message = _one_line_error(load_config, env={env_var_name(path): value})
    assert message.startswith(f"{path}: ") and "hunter2" not in message, message


@pytest.mark.parametrize("value,problem", [
    ("redis://h:notaport/0", "invalid port 'notaport'"),
    ("redis://h:99999/0", "invalid port '99999'"),
    ("redis://h:0/0", "invalid port '0'"),
    ("redis://[::1/0", "unclosed '['"),
    ("redis://::1:6379/0", "must be in brackets"),
    ("redis:///0", "no host"),
    ("redis://h/zero", "invalid database path '/zero'"),
    ("redis://u:pa/ss@h/0", "percent-encode"),
])
def test_redis_url_problems_are_named(value, problem):
    message = _one_line_error(load_config, overrides={"store": {"redis": {"url": value}}}, env={})
    assert problem in message, message


def test_well_formed_urls_still_load():
    cfg = load_config(overrides={"store": {
        "url": "p2pstore://u:pw@[fe80::1]:6379/1?protocol=tcp",
        "redis": {"url": "redis://[::1]:6379/0"},
        "p2pstore": {"metadata_server": "redis+sentinel://pw@h1:26379,h2:26379/mymaster/2"},
    }}, env={})
    assert cfg.store.redis.url == "redis://[::1]:6379/0"
    for url in ("p2pstore://h:6379", "local:///data/rr", "memory://", "mystore://bucket/x?opt=1"):
        assert load_config(overrides={"store": {"url": url}}, env={}).store.url == url


def test_a_url_without_what_its_backend_requires_fails_at_load():
    with pytest.raises(ConfigError, match="store.p2pstore.metadata_server is required"):
        load_config(overrides={"store": {"url": "p2pstore://"}}, env={})


def test_redacted_dump_hides_passwords_inside_urls_and_options():
    cfg = load_config(overrides={"store": {
        "url": "p2pstore://alice:pw-url@h:6379/0",
        "redis": {"url": "redis://bob:pw-redis@h:6379/0", "password": "pw-field"},
        "p2pstore": {"metadata_server": "redis://:pw-meta@h:6379/0"},
        "options": {"password": "pw-opt", "endpoint": "s3://k:pw-s3@bucket", "pool": 4},
    }}, env={})
    dumped = json.dumps(config_to_dict(cfg, redact=True))
    assert "pw-" not in dumped, dumped
    redacted = config_to_dict(cfg, redact=True)["store"]
    assert redacted["url"] == "p2pstore://alice:***@h:6379/0"
    assert redacted["redis"]["url"] == "redis://bob:***@h:6379/0"
    assert redacted["options"] == {"password": "***", "endpoint": "s3://k:***@bucket", "pool": 4}
    assert config_to_dict(cfg)["store"]["redis"]["url"] == "redis://bob:pw-redis@h:6379/0"


def test_a_bad_value_next_to_a_password_in_a_url_is_shown_redacted():
    message = _one_line_error(load_config, overrides={"store": {"options": {
        "k": 1, 2: "redis://u:pw-x@h"}}}, env={})
    assert message.startswith("store.options: keys must be strings")
    message = _one_line_error(load_config, overrides={"store": {"local": {
        "root": ["redis://u:pw-x@h/0"]}}}, env={})
    assert "pw-x" not in message and "u:***@h" in message, message


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_deeply_nested_file_is_one_error_naming_the_file(tmp_path, suffix):
    depth = 20000
    if suffix == ".json":
        text = '{"store": {"options": {"x": ' + "[" * depth + "]" * depth + "}}}"
    else:
        text = "store:\n  options:\n    x: " + "[" * depth + "]" * depth + "\n"
    cfg_file = write(tmp_path, f"deep{suffix}", text)
    message = _one_line_error(load_config, cfg_file, env={})
    assert str(cfg_file) in message and "nest too deeply" in message, message


def test_nesting_that_parses_is_bounded_at_the_key(tmp_path):
    deep = "[" * 200 + "]" * 200
    cfg_file = write(tmp_path, "deep.yaml", f"store:\n  options:\n    x: {deep}\n")
    message = _one_line_error(load_config, cfg_file, env={})
    assert message.startswith("store.options: nests more than 32 levels"), message
    message = _one_line_error(load_config, env={"FD_RR_STORE__OPTIONS": '{"x": ' + deep + "}"})
    assert message.startswith("store.options: ") and "FD_RR_STORE__OPTIONS" in message
    too_deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"   # json.loads itself recurses
    message = _one_line_error(load_config, env={"FD_RR_STORE__OPTIONS": too_deep})
    assert message.startswith("store.options: nests more than") and "FD_RR_STORE__OPTIONS" in message
    message = _one_line_error(load_config, write(tmp_path, "root.yaml",
                                                 f"store:\n  local:\n    root: {deep}\n"), env={})
    assert message.startswith("store.local.root: expected str, got list"), message
    message = _one_line_error(load_config, write(tmp_path, "sec.yaml", f"store: {deep}\n"), env={})
    assert message.startswith("store: is a section"), message
    ok = "[" * 31 + "]" * 31
    assert load_config(write(tmp_path, "ok.yaml", f"store:\n  options:\n    x: {ok}\n"), env={})


def test_recursive_yaml_alias_in_options(tmp_path):
    cfg_file = write(tmp_path, "loop.yaml", "store:\n  options:\n    x: &a [*a]\n")
    message = _one_line_error(load_config, cfg_file, env={})
    assert message.startswith("store.options: contains itself"), message


@pytest.mark.parametrize("name,text", [
    ("FD_RR_WRITER__METRICS_PORT", "٣"),       # Arabic-Indic digit
    ("FD_RR_WRITER__METRICS_PORT", "１"),       # full-width digit
    ("FD_RR_WRITER__METRICS_PORT", "+80"),
    ("FD_RR_WRITER__METRICS_PORT", " 80"),
    ("FD_RR_WRITER__METRICS_PORT", "80 "),
    ("FD_RR_WRITER__METRICS_PORT", "8_0"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", "+1"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", " 1.5"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", "١.5"),
    ("FD_RR_WRITER__CLOSE_TIMEOUT_S", "1_0"),
    ("FD_RR_WRITER__CAPACITY_BYTES", "１GiB"),
    ("FD_RR_WRITER__CAPACITY_BYTES", " 1GiB"),
    ("FD_RR_WRITER__CAPACITY_BYTES", "1\u3000GiB"),   # ideographic space
    ("FD_RR_WRITER__CAPACITY_BYTES", "٣MiB"),
])
def test_env_numbers_accept_ascii_decimal_only(name, text):
    message = _one_line_error(load_config, env={name: text})
    assert name in message and repr(text) in message, message


def test_env_numbers_that_are_fine():
    cfg = load_config(env={"FD_RR_WRITER__METRICS_PORT": "9464",
                           "FD_RR_WRITER__CLOSE_TIMEOUT_S": "1e-3",
                           "FD_RR_WRITER__CAPACITY_BYTES": "512 MiB"})
    assert cfg.writer.metrics_port == 9464 and cfg.writer.close_timeout_s == 0.001
    assert cfg.writer.capacity_bytes == 512 * MiB
    message = _one_line_error(load_config, env={"FD_RR_WRITER__METRICS_PORT": "-1"})
    assert "must be >= 0" in message


@pytest.mark.parametrize("path,text", [
    ("writer.capacity_bytes", "9999999TiB"),
    ("writer.capacity_bytes", "2TiB"),
    ("store.redis.chunk_bytes", 2**64),
])
def test_sizes_are_bounded_at_load(path, text):
    section, *middle, leaf = path.split(".")
    tree: dict = {section: {}}
    node = tree[section]
    for part in middle:
        node = node.setdefault(part, {})
    node[leaf] = text
    message = _one_line_error(load_config, overrides=tree, env={})
    assert message.startswith(f"{path}: "), message
    assert "too large" in message or "must be <=" in message, message


def test_size_bounds_allow_real_values():
    cfg = load_config(overrides={"writer": {"capacity_bytes": "1TiB"}}, env={})
    assert cfg.writer.capacity_bytes == 2**40
    with pytest.raises(ValueError, match="too large"):
        _parse.parse_size(2**63)
    assert _parse.parse_size(2**63 - 1) == 2**63 - 1


# ---------------------------------------------------------------------------- backend sections


def test_backend_sections_come_from_their_modules_and_keep_their_old_names():
    """store.<backend> sections live in the backends' light declarations (config/stores/);
    the old import path still finds them and a config still pickles."""
    import pickle

    from fd_routing_replay import config as config_module
    from fd_routing_replay.store.backend import backends

    sections = {name: b.config_section for name, b in backends().items() if b.config_section}
    assert {"local", "redis", "p2pstore", "mooncake"} <= set(sections)
    store_fields = [f.name for f in dataclasses.fields(StoreConfig)]
    assert store_fields == ["type", "url", "namespace", "options", "metrics", *sections]
    for name, section in sections.items():
        assert section.__module__ == f"fd_routing_replay.config.stores.{name}", name
        assert getattr(config_module, section.__name__) is section
        assert section._path == f"store.{name}"
    with pytest.raises(AttributeError, match="NoSuchStoreConfig"):
        config_module.NoSuchStoreConfig  # noqa: B018
    cfg = load_config(overrides={"store": {"redis": {"password": "pw"}}}, env={})
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_fastdeploy_flat_keys_come_from_the_backends():
    cfg = load_config(overrides={"routing_store_type": "rdma", "rdma_store_server":
                                 "redis://10.0.0.5:6379/0", "local_store_dir": "/d"}, env={})
    assert (cfg.store.type, cfg.store.p2pstore.metadata_server, cfg.store.local.root) == \
        ("p2pstore", "redis://10.0.0.5:6379/0", "/d")
    with pytest.raises(ConfigError, match="known flat keys: enable_routing_replay, "
                       "routing_store_type, local_store_dir, rdma_store_server, "
                       "only_last_turn, use_fused_put"):
        load_config(overrides={"enable_routing_replay": True, "routing_store_typ": "rdma"}, env={})
