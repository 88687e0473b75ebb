"""``fd-rr doctor`` against a live Redis store, a P2PStore store, the local store and an
unreachable Redis."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from fd_routing_replay.cli import main
from fd_routing_replay.cli.doctor import doctor_rollout_id
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.store import open_store
from fdrr_dev.testing.process import free_port
from fdrr_dev.testing.redis import redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="redis-server binary not found (Debian redis-server)")
P2P_MISSING = [n for n in ("p2pstore", "mooncake") if importlib.util.find_spec(n) is None]


def doctor(capsys, *argv: str) -> tuple[int, str]:
    code = main(["doctor", *argv])
    return code, capsys.readouterr().out


def status_of(output: str) -> dict[str, str]:
    """check name -> label, from the text report."""
    found = {}
    for line in output.splitlines():
        if line.startswith("[") and "]" in line:
            label, rest = line[1:].split("]", 1)
            found[rest.split()[0]] = label.strip()
    return found


def test_doctor_rollout_id_is_valid_and_unique():
    first, second = doctor_rollout_id(), doctor_rollout_id()
    assert first != second
    parsed = parse_rollout_id(first)
    assert parsed.base.startswith("_doctor_") and (parsed.turn, parsed.segment) == (0, 0)


@pytest.mark.redis
@needs_redis
def test_redis_store_healthy(redis_server, capsys):
    store = open_store(redis_server.url, "doc")
    keys = [f"exp_{i}:0:0" for i in range(5)]
    for key in keys:
        store.put(key, b"payload")
    code, out = doctor(capsys, "--store", redis_server.url, "--namespace", "doc")
    assert code == 0, out
    assert status_of(out) == {"config": "OK", "rdma": "SKIP", "redis": "OK", "store": "OK",
                              "roundtrip": "OK", "index": "OK"}
    assert "Redis 7" in out or "Redis " in out
    assert "sampled 5 of 5 entries: all have their payloads" in out
    assert "verified and deleted" in out and out.rstrip().endswith("(0 failure(s), 0 warning(s))")
    assert store.list() == keys  # the test record is gone, the rest untouched
    store.clear()
    store.close()


@pytest.mark.redis
@needs_redis
def test_dangling_index_entry_fails(redis_server, capsys):
    from fd_routing_replay.store.redis import payload_key

    store = open_store(redis_server.url, "dangle")
    store.put("d_1:0:0", b"x")
    store.put("d_2:0:0", b"y")
    redis_server.command("DEL", payload_key("dangle", "d_2:0:0"))  # lost behind our back
    code, out = doctor(capsys, "--store", redis_server.url, "--namespace", "dangle")
    assert code == 1
    assert status_of(out)["index"] == "FAIL"
    assert "1 without payload" in out and "d_2:0:0" in out and "fd-rr fsck --repair" in out
    store.clear()
    store.close()


@pytest.mark.redis
@pytest.mark.p2pstore
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
@needs_redis
@pytest.mark.skipif(bool(P2P_MISSING), reason=f"not installed: {P2P_MISSING}")
def test_p2pstore_from_config_file(redis_server, capsys, tmp_path):
    config = tmp_path / "rr.yaml"
    config.write_text(yaml.safe_dump({"store": {
        "type": "p2pstore", "namespace": "docp2p",
        "p2pstore": {"metadata_server": redis_server.url, "protocol": "tcp",
                     "log_dir": str(tmp_path / "logs")}}}))
    code, out = doctor(capsys, "--config", str(config), "--json")
    report = json.loads(out)
    assert code == 0 and report["failed"] is False, out
    checks = {check["name"]: check for check in report["checks"]}
    assert [c["status"] for c in report["checks"]] == ["ok"] * 6
    assert checks["store"]["summary"].startswith("opened p2pstore(namespace=docp2p")
    assert "protocol is tcp" in checks["rdma"]["summary"]


def test_local_store_healthy(tmp_path, capsys):
    code, out = doctor(capsys, "--store", f"local://{tmp_path / 'root'}", "--namespace", "loc")
    assert code == 0, out
    assert status_of(out) == {"config": "OK", "rdma": "SKIP", "redis": "SKIP", "store": "OK",
                              "roundtrip": "OK", "index": "SKIP"}
    assert list((tmp_path / "root").rglob("*@*")) == []  # nothing left behind


def test_local_store_in_fastdeploy_layout_healthy(tmp_path, capsys):
    url = f"local://{tmp_path / 'fd'}?layout=fastdeploy"
    code, out = doctor(capsys, "--store", url, "--namespace", "loc")
    assert code == 0, out
    assert status_of(out)["roundtrip"] == "OK"
    assert [p.name for p in (tmp_path / "fd").iterdir()] == [".fdrr-namespace"]


@pytest.mark.parametrize("scheme", ["redis", "p2pstore"])
def test_unreachable_redis_fails_clearly(capsys, scheme):
    url = f"{scheme}://127.0.0.1:{free_port()}/0"
    code, out = doctor(capsys, "--store", url, "--timeout", "2")
    assert code == 1
    statuses = status_of(out)
    assert statuses["redis"] == "FAIL"
    assert [statuses[name] for name in ("store", "roundtrip", "index")] == ["SKIP"] * 3
    assert f"cannot reach Redis at redis://127.0.0.1:{url.rsplit(':', 1)[1]}" in out
    assert "Connection refused" in out and "result: FAILED" in out


def test_bad_config_fails(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("store:\n  type: p2pstore\n")  # p2pstore without a metadata server
    code, out = doctor(capsys, "--config", str(config))
    assert code == 1
    assert status_of(out) == {"config": "FAIL"} and "metadata_server" in out


@pytest.mark.parametrize("scheme", ["redis", "p2pstore"])
def test_passwords_never_reach_the_report(capsys, scheme):
    url = f"{scheme}://alice:hunter2@127.0.0.1:{free_port()}/0"
    code, out = doctor(capsys, "--store", url, "--timeout", "1")
    assert code == 1 and "hunter2" not in out, out
    assert "alice:***@127.0.0.1" in out
    code, out = doctor(capsys, "--store", url, "--timeout", "1", "--json")
    assert code == 1 and "hunter2" not in out


def test_malformed_redis_url_is_a_failed_config_check(capsys):
    code, out = doctor(capsys, "--store", "redis://alice:hunter2@127.0.0.1:notaport/0")
    assert code == 1 and status_of(out) == {"config": "FAIL"}
    assert "store.url: invalid port 'notaport'" in out and "hunter2" not in out
