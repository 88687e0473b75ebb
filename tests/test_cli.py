"""fd-rr end to end on a real local store: in-process for speed, once via the entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.store.local import LocalStore


@pytest.fixture
def filled(tmp_path, seed):
    rng = np.random.default_rng(seed)
    store = LocalStore(tmp_path / "rr", "cli")
    records = {}
    for rid in ["exp_1:0:0", "exp_1:1:0", "exp_10:0:0", "exp_2:0:0"]:
        ids = rng.integers(0, 16, size=(2, 6, 4)).astype(np.uint8)
        records[rid] = RoutingRecord(rollout_id=rid, ids=ids, num_experts=16)
        store.put(rid, encode_record(records[rid]))
    return [f"--store=local://{tmp_path / 'rr'}", "--namespace=cli"], records, store


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_all_and_by_prefix(filled, capsys):
    opts, records, _ = filled
    code, out, _ = run(["ls", *opts], capsys)
    assert code == 0 and out.split() == sorted(records)
    code, out, _ = run(["ls", "exp_1", *opts], capsys)
    assert out.split() == ["exp_1:0:0", "exp_1:1:0"]


def test_show_prints_header_and_usage(filled, capsys):
    opts, records, _ = filled
    code, out, _ = run(["show", "exp_1:0:0", "--json", *opts], capsys)
    assert code == 0
    summary = json.loads(out)
    assert summary["header"]["rollout_id"] == "exp_1:0:0"
    load = np.bincount(records["exp_1:0:0"].ids.ravel(), minlength=16)
    assert summary["expert_load"]["max"] == load.max()
    assert summary["expert_load"]["unused_experts"] == int((load == 0).sum())
    code, out, _ = run(["show", "exp_1:0:0", *opts], capsys)
    assert "shape        [2, 6, 4]" in out


def test_get_writes_npy(filled, capsys, tmp_path):
    opts, records, _ = filled
    target = tmp_path / "out.npy"
    code, _, _ = run(["get", "exp_2:0:0", "-o", str(target), *opts], capsys)
    assert code == 0
    np.testing.assert_array_equal(np.load(target), records["exp_2:0:0"].ids)


def test_rm_keys_and_prefixes(filled, capsys):
    opts, _, store = filled
    code, out, _ = run(["rm", "exp_2:0:0", "exp_2:9:0", *opts], capsys)
    assert code == 0 and "deleted 1 of 2" in out
    code, out, _ = run(["rm", "--prefix", "exp_1", "--yes", *opts], capsys)
    assert code == 0 and "exp_1\t2" in out
    assert store.list() == ["exp_10:0:0"]


def test_rm_prefix_without_yes_refuses_when_not_interactive(filled, capsys, monkeypatch):
    opts, _, store = filled
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))
    code, _, err = run(["rm", "--prefix", "exp_1", *opts], capsys)
    assert code == 1 and "--yes" in err
    assert len(store.list()) == 4


@pytest.mark.parametrize("argv, message", [
    (["show", "exp_9:0:0"], "no record under key 'exp_9:0:0'"),
    (["ls", "bad/prefix"], "'/'"),
    (["get", "..x:0:0", "-o", "/tmp/x.npy"], "'..'"),
])
def test_failures_are_one_clear_line(filled, capsys, argv, message):
    opts, _, _ = filled
    code, out, err = run([*argv, *opts], capsys)
    assert code == 1
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_corrupt_record_is_reported(filled, capsys):
    opts, _, store = filled
    store.put("exp_3:0:0", b"not a record at all")
    code, _, err = run(["show", "exp_3:0:0", *opts], capsys)
    assert code == 1 and "error:" in err


def test_config_check(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("store:\n  type: local\n  local:\n    root: /data/rr\n")
    code, out, _ = run(["config", "check", str(good)], capsys)
    assert code == 0 and "/data/rr" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  tpye: local\n")
    code, _, err = run(["config", "check", str(bad)], capsys)
    assert code == 1 and "tpye" in err and "type" in err


def test_console_script_is_installed(filled):
    opts, records, _ = filled
    done = subprocess.run([sys.executable, "-m", "fd_routing_replay.cli", "ls", *opts],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == sorted(records)


def test_config_check_redacts_passwords(tmp_path, capsys):
    path = tmp_path / "secret.yaml"
    path.write_text("store:\n  type: redis\n  redis:\n    url: redis://127.0.0.1:6379/0\n"
                    "    password: hunter2-secret\n")
    code, out, _ = run(["config", "check", str(path)], capsys)
    assert code == 0 and "hunter2-secret" not in out and "***" in out


# -- FastDeploy's local layout ----------------------------------------------------------------------

@pytest.fixture
def fd_layout(tmp_path, seed):
    from fd_routing_replay.store.fastdeploy_local import FastDeployLocalStore

    rng = np.random.default_rng(seed)
    store = FastDeployLocalStore(tmp_path / "fd", "cli", max_model_len=24)
    ids = rng.integers(300, 60000, size=(3, 10, 4)).astype(np.uint16)
    store.put("fd_1:0:0", encode_record(RoutingRecord("fd_1:0:0", ids, 60000)))
    for layer in range(3):
        store.put(f"fd_2:0:0_{layer}", encode_record(RoutingRecord(
            "fd_2:0:0", np.ascontiguousarray(ids[layer:layer + 1]), 60000)))
    return [f"--store=local://{tmp_path / 'fd'}?layout=fastdeploy", "--namespace=cli"], ids, store


@pytest.mark.parametrize("key", ["fd_1:0:0", "fd_2:0:0"], ids=["fused", "per-layer"])
def test_show_and_get_read_fastdeploy_files(fd_layout, capsys, tmp_path, key):
    opts, ids, _ = fd_layout
    code, out, err = run(["show", key, "--json", *opts], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["format"] == "fastdeploy-raw" and summary["header"]["format"] == "fastdeploy-raw"
    assert summary["header"]["shape"] == [3, 10, 4] and summary["header"]["max_model_len"] == 24
    assert summary["expert_load"]["num_experts"] is None
    assert summary["expert_load"]["max"] == np.bincount(ids.ravel()).max()
    code, out, _ = run(["show", key, *opts], capsys)
    assert "format       fastdeploy-raw" in out and "shape        [3, 10, 4]" in out
    target = tmp_path / f"{key}.npy"
    code, _, _ = run(["get", key, "-o", str(target), *opts], capsys)
    assert code == 0
    np.testing.assert_array_equal(np.load(target), ids)


def test_ls_and_show_of_one_layer(fd_layout, capsys):
    opts, ids, _ = fd_layout
    code, out, _ = run(["ls", *opts], capsys)
    assert out.split() == ["fd_1:0:0", "fd_2:0:0_0", "fd_2:0:0_1", "fd_2:0:0_2"]
    code, out, _ = run(["show", "fd_2:0:0_1", "--json", *opts], capsys)
    assert json.loads(out)["header"]["shape"] == [1, 10, 4]


def test_hostile_pdtensor_is_an_error_line(fd_layout, capsys, tmp_path):
    opts, _, store = fd_layout
    marker = tmp_path / "pwned"
    command = f"touch {marker}".encode()
    evil = b"\x80\x04cos\nsystem\n\x8c" + bytes([len(command)]) + command + b"\x85R."
    store.path_of("fd_1:0:0").write_bytes(evil)
    code, _, err = run(["show", "fd_1:0:0", *opts], capsys)
    assert code == 1 and err.startswith("error: ") and "GLOBAL" in err
    assert not marker.exists()
