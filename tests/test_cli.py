"""fd-rr end to end on a real local store: in-process for speed, once via the entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.store.local import LocalStore
from fdrr_dev.testing.process import free_port
from fdrr_dev.testing.redis import redis_server_binary


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


def test_stats_prints_the_store_calls_the_command_made(filled, capsys):
    opts, records, _ = filled
    code, out, err = run(["--stats", "show", "exp_1:0:0", *opts], capsys)
    assert code == 0
    line, = [text for text in err.splitlines() if text.startswith("store calls to ")]
    size = len(encode_record(records["exp_1:0:0"]))
    assert "namespace cli" in line and re.search(r"\bget 1 \(errors 0, p50 [0-9.]+ ms", line)
    assert f"read {size} B, written 0 B" in line
    code, _, err = run(["ls", *opts], capsys)          # without --stats: nothing extra
    assert code == 0 and "store calls" not in err


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
    assert re.search(r"^shape +\[2, 6, 4\]", out, re.M)


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
    from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore

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
    assert re.search(r"^format +fastdeploy-raw$", out, re.M)
    assert re.search(r"^shape +\[3, 10, 4\]", out, re.M)
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


# -- validation as the reader does it -------------------------------------------------------------

_LIMITED = """
import resource, sys
limit = 3 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from fd_routing_replay.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_limited(argv: list[str]) -> subprocess.CompletedProcess:
    """fd-rr in a child whose address space is capped at 3 GiB (no 32 GiB allocation)."""
    import os

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _LIMITED, *argv], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture
def crafted(tmp_path):
    """A uint32 record whose num_experts is 16 but holds the id 4e9 (not the fill)."""
    store = LocalStore(tmp_path / "rr", "cli")
    ids = np.zeros((2, 3, 2), dtype=np.uint32)
    ids[1, 2, 1] = 4_000_000_000
    store.put("bad_1:0:0", encode_record(RoutingRecord("bad_1:0:0", ids, 16)))
    return [f"--store=local://{tmp_path / 'rr'}", "--namespace=cli"], store


def test_show_of_out_of_range_ids_is_one_error_line(crafted):
    opts, _ = crafted
    done = run_limited(["show", "bad_1:0:0", *opts])
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert "expert id 4000000000 at [layer 1, token 2, k 1]" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_get_refuses_out_of_range_ids(crafted, tmp_path, capsys):
    opts, _ = crafted
    target = tmp_path / "out.npy"
    code, out, err = run(["get", "bad_1:0:0", "-o", str(target), *opts], capsys)
    assert code == 1 and "expert id 4000000000" in err and out == ""
    assert not target.exists()


def test_get_refuses_a_record_of_another_rollout(filled, tmp_path, capsys):
    opts, records, store = filled
    store.put("exp_9:0:0", encode_record(records["exp_1:0:0"]))   # stored under the wrong key
    code, _, err = run(["get", "exp_9:0:0", "-o", str(tmp_path / "x.npy"), *opts], capsys)
    assert code == 1 and "belongs to rollout 'exp_1:0:0'" in err


def test_huge_but_valid_expert_ids_are_summarised_in_bounded_memory(tmp_path):
    store = LocalStore(tmp_path / "rr", "cli")
    ids = np.zeros((2, 3, 2), dtype=np.uint32)
    ids[0, 0, 0] = 3_999_999_999
    store.put("big_1:0:0", encode_record(RoutingRecord("big_1:0:0", ids, 4_000_000_000)))
    done = run_limited(["show", "big_1:0:0", "--json", f"--store=local://{tmp_path / 'rr'}",
                        "--namespace=cli"])
    assert done.returncode == 0, done.stderr
    load = json.loads(done.stdout)["expert_load"]
    assert load["experts_used"] == 2 and load["unused_experts"] == 4_000_000_000 - 2
    assert load["min"] == 0 and load["max"] == 11 and load["highest_id"] == 3_999_999_999


def test_fastdeploy_file_with_huge_ids_is_summarised_in_bounded_memory(tmp_path):
    from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore

    store = FastDeployLocalStore(tmp_path / "fd", "cli")
    ids = np.full((2, 3, 2), 7, dtype=np.uint32)
    ids[1, 1, 1] = 4_000_000_000
    store.put("fdb_1:0:0", encode_record(RoutingRecord("fdb_1:0:0", ids, 2**32 - 1)))
    done = run_limited(["show", "fdb_1:0:0", "--json",
                        f"--store=local://{tmp_path / 'fd'}?layout=fastdeploy", "--namespace=cli"])
    assert done.returncode == 0, done.stderr
    load = json.loads(done.stdout)["expert_load"]
    assert load["num_experts"] is None and load["highest_id"] == 4_000_000_000
    assert load["experts_used"] == 2 and load["max"] == 11


# -- show: numbers and layout ------------------------------------------------------------------

def test_expert_load_minimum_is_the_least_used_expert(tmp_path, capsys):
    store = LocalStore(tmp_path / "rr", "cli")
    ids = np.tile(np.arange(16, dtype=np.uint8), 6).reshape(2, 12, 4)   # every expert 6 times
    ids[0, 0, 0] = 1                                                     # expert 0: 5, expert 1: 7
    store.put("all_1:0:0", encode_record(RoutingRecord("all_1:0:0", ids, 16, created=0.0)))
    opts = [f"--store=local://{tmp_path / 'rr'}", "--namespace=cli"]
    code, out, _ = run(["show", "all_1:0:0", "--json", *opts], capsys)
    load = json.loads(out)["expert_load"]
    assert (load["min"], load["max"], load["unused_experts"]) == (5, 7, 0)
    assert load["mean"] == 6.0


def test_show_text_aligns_labels_and_prints_created_in_utc(filled, capsys, tmp_path):
    store = LocalStore(tmp_path / "t", "cli")
    ids = np.zeros((3, 4, 2), dtype=np.uint8)
    store.put("t_1:0:0", encode_record(RoutingRecord("t_1:0:0", ids, 8, created=1700000000.25,
                                                     metadata={"weights_version": 3})))
    code, out, _ = run(["show", "t_1:0:0", f"--store=local://{tmp_path / 't'}",
                        "--namespace=cli"], capsys)
    assert code == 0
    assert re.search(r"^created +2023-11-14T22:13:20\.250Z$", out, re.M), out
    columns = set()
    for line in out.splitlines():
        match = re.match(r"^( *\S+(?: \S+)*?)( {2,})\S", line)
        assert match or line.strip() in ("header",), f"label runs into its value: {line!r}"
        if match:
            columns.add(len(match.group(1)) + len(match.group(2)))
    assert len(columns) == 1, out          # every value starts in the same column
    assert re.search(r"^  token_convention +forwarded$", out, re.M)
    code, out, _ = run(["show", "t_1:0:0", "--json", f"--store=local://{tmp_path / 't'}",
                        "--namespace=cli"], capsys)
    assert json.loads(out)["created_utc"] == "2023-11-14T22:13:20.250Z"


def test_show_one_layer(filled, capsys):
    opts, records, _ = filled
    ids = records["exp_1:0:0"].ids
    code, out, _ = run(["show", "exp_1:0:0", "--layer", "1", "--json", *opts], capsys)
    summary = json.loads(out)
    load = np.bincount(ids[1].ravel(), minlength=16)
    assert summary["layer"] == 1 and summary["decoder_layer"] == 1
    assert summary["expert_load"]["max"] == load.max()
    assert summary["expert_load"]["unused_experts"] == int((load == 0).sum())
    code, out, _ = run(["show", "exp_1:0:0", "--layer", "1", *opts], capsys)
    assert re.search(r"^expert load +layer row 1 \(decoder layer 1\)$", out, re.M)
    code, _, err = run(["show", "exp_1:0:0", "--layer", "2", *opts], capsys)
    assert code == 1 and err.startswith("error: --layer 2: the record has 2 layer row(s)")


def test_get_says_the_path_it_really_wrote(filled, capsys, tmp_path):
    opts, records, _ = filled
    code, out, _ = run(["get", "exp_2:0:0", "-o", str(tmp_path / "out"), *opts], capsys)
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'out.npy'}: [2, 6, 4] uint8")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), records["exp_2:0:0"].ids)


# -- ls: say what was read ---------------------------------------------------------------------

def test_ls_of_an_empty_namespace_says_which_store_and_namespace(filled, capsys):
    opts, _, store = filled
    code, out, err = run(["ls", opts[0], "--namespace=nosuch"], capsys)
    assert code == 0 and out == ""
    assert f"local://{store.root} (namespace nosuch)" in err and "empty or absent" in err
    code, out, err = run(["ls", "exp_7", *opts], capsys)
    assert code == 0 and out == "" and "no records under prefix 'exp_7'" in err
    assert "(namespace cli)" in err


def test_ls_of_a_missing_root_says_so(tmp_path, capsys):
    code, out, err = run(["ls", f"--store=local://{tmp_path / 'nowhere'}"], capsys)
    assert code == 0 and out == ""
    assert "namespace routing_replay" in err and f"{tmp_path / 'nowhere'} does not exist" in err
    assert not (tmp_path / "nowhere").exists()


class _ListingMemoryStore:
    """A memory store that can list its namespaces (the optional capability)."""

    @staticmethod
    def open(store_config):
        from urllib.parse import urlsplit

        from fd_routing_replay.store import memory

        class Listing(memory.MemoryStore):
            def supports_list_namespaces(self) -> bool:
                return True

            def list_namespaces(self) -> list[str]:
                return sorted(ns for (name, ns), space in memory._SPACES.items()
                              if name == self.name and space.values)

        return Listing(urlsplit(store_config.url).netloc, store_config.namespace)


@pytest.fixture
def listing_store():
    from fd_routing_replay.store import open_store, register_store

    register_store("listing-memory", _ListingMemoryStore.open)
    url = "listing-memory://cli-ns-test"
    for namespace in ("alpha", "beta"):
        open_store(url, namespace).put("k_1:0:0", b"x")
    return url


def test_ls_namespaces(listing_store, capsys):
    code, out, _ = run(["ls", "--namespaces", "--store", listing_store], capsys)
    assert code == 0 and out.split() == ["alpha", "beta"]
    code, out, _ = run(["ls", "--namespaces", "--json", "--store", listing_store], capsys)
    assert json.loads(out)["namespaces"] == ["alpha", "beta"]
    code, out, err = run(["ls", "--store", listing_store, "--namespace", "gamma"], capsys)
    assert code == 0 and "namespaces there: alpha, beta (use --namespace)" in err
    with pytest.raises(SystemExit) as info:
        main(["ls", "k", "--namespaces", "--store", listing_store])
    assert info.value.code == 2     # a prefix and --namespaces exclude each other


def test_ls_namespaces_on_the_local_store(filled, capsys):
    opts, _, store = filled
    code, out, _ = run(["ls", "--namespaces", *opts], capsys)
    assert code == 0 and out.split() == ["cli"]


def test_ls_namespaces_on_a_store_that_cannot_list_them(filled, capsys, monkeypatch):
    from fd_routing_replay.store.local import LocalStore

    monkeypatch.setattr(LocalStore, "supports_list_namespaces", lambda self: False)
    monkeypatch.setattr(LocalStore, "list_namespaces", lambda self: (_ for _ in ()).throw(
        NotImplementedError(f"{self.describe()} cannot list its namespaces")))
    opts, _, store = filled
    code, _, err = run(["ls", "--namespaces", *opts], capsys)
    assert code == 1 and err.startswith(f"error: local://{store.root}")
    assert "cannot list its namespaces" in err


# -- JSON output -------------------------------------------------------------------------------

def test_ls_json(filled, capsys):
    opts, records, store = filled
    code, out, _ = run(["ls", "exp_1", "--json", *opts], capsys)
    assert json.loads(out) == {"store": store.describe(), "namespace": "cli", "prefix": "exp_1",
                               "count": 2, "partial": 0, "keys": ["exp_1:0:0", "exp_1:1:0"]}


def test_rm_json(filled, capsys, monkeypatch):
    opts, _, store = filled
    code, out, _ = run(["rm", "exp_2:0:0", "exp_2:9:0", "--json", *opts], capsys)
    assert json.loads(out) == {"store": store.describe(), "keys": ["exp_2:0:0", "exp_2:9:0"],
                               "deleted": 1}
    code, out, _ = run(["rm", "--prefix", "exp_1", "exp_3", "--yes", "--json", *opts], capsys)
    assert json.loads(out) == {"store": store.describe(), "prefixes": {"exp_1": 2, "exp_3": 0},
                               "deleted": 2, "aborted": False}
    # the confirmation question goes to stderr, so stdout stays one JSON document
    monkeypatch.setattr(sys, "stdin", _Tty("n\n"))
    code, out, err = run(["rm", "--prefix", "exp_10", "--json", *opts], capsys)
    assert code == 1 and json.loads(out)["aborted"] is True and "[y/N]" in err
    assert store.list() == ["exp_10:0:0"]


class _Tty:
    def __init__(self, text: str) -> None:
        self.text = text

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.text


def test_config_check_json(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("store:\n  type: redis\n  redis:\n    url: redis://u:pw-url@h:6379/0\n"
                    "    password: pw-field\n")
    code, out, _ = run(["config", "check", str(good), "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["valid"] is True and result["store_type"] == "redis"
    assert result["config"]["store"]["redis"] == {**result["config"]["store"]["redis"],
                                                  "url": "redis://u:***@h:6379/0",
                                                  "password": "***"}
    assert "pw-" not in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  redis:\n    url: redis://u:pw-url@h:notaport/0\n")
    code, out, err = run(["config", "check", str(bad), "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and result["valid"] is False
    assert result["error"].startswith("store.redis.url: invalid port 'notaport'")
    assert "pw-" not in out + err and err.startswith("error: store.redis.url: ")


# -- config check: passwords and store types --------------------------------------------------------

def test_config_check_masks_passwords_inside_urls(tmp_path, capsys):
    path = tmp_path / "urls.yaml"
    path.write_text("store:\n  type: p2pstore\n  url: p2pstore://u:pw-1@h:6379/0\n"
                    "  redis:\n    url: redis://u:pw-2@h:6379/0\n"
                    "  p2pstore:\n    metadata_server: redis+sentinel://pw-3@h1:26379,h2:26379/m\n")
    code, out, err = run(["config", "check", str(path)], capsys)
    assert code == 0, err
    assert "pw-" not in out + err
    assert "p2pstore://u:***@h:6379/0" in out and "redis+sentinel://***@h1:26379" in out


@pytest.mark.parametrize("text,key", [
    ("store:\n  type: nosuch\n", "store.type"),
    ("store:\n  url: nosuch://bucket/x\n", "store.url"),
])
def test_config_check_rejects_unknown_store_types(tmp_path, capsys, text, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, out, err = run(["config", "check", str(path)], capsys)
    assert code == 1 and out == ""
    assert err.startswith(f"error: {key}: unknown store type 'nosuch'; known types: ")
    assert all(name in err for name in ("local", "memory", "redis", "p2pstore"))


def test_config_check_accepts_registered_store_types(tmp_path, capsys, listing_store):
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  type: listing-memory\n")
    code, _, err = run(["config", "check", str(path)], capsys)
    assert code == 0 and "valid (store type listing-memory)" in err


# -- errors: malformed URLs, passwords ------------------------------------------------------------

@pytest.mark.parametrize("url", ["redis://u:pw-x@h:notaport/0", "redis://u:pw-x@h:99999/0",
                                 "redis://u:pw-x@[::1/0"])
def test_malformed_store_url_is_one_error_line(capsys, url):
    code, out, err = run(["ls", "--store", url], capsys)
    assert code == 1 and err.startswith("error: store.url: ") and "pw-x" not in err
    assert len(err.splitlines()) == 1


def test_error_lines_never_show_passwords(capsys, monkeypatch):
    import dataclasses

    from fd_routing_replay.cli import app
    from fd_routing_replay.errors import StoreError

    def failing(args):
        raise StoreError("cannot reach redis://alice:hunter2@h:6379/0: refused")

    commands = [dataclasses.replace(c, run=failing) if c.name == "ls" else c
                for c in app.SUBCOMMANDS]
    monkeypatch.setattr(app, "SUBCOMMANDS", commands)
    code, _, err = run(["ls"], capsys)
    assert code == 1 and err == "error: cannot reach redis://alice:***@h:6379/0: refused\n"


# -- the parser ----------------------------------------------------------------------------------

def test_version(capsys):
    from fd_routing_replay import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"fd-rr {__version__}"


def test_every_subcommand_has_a_description_and_an_example(capsys):
    from fd_routing_replay.cli.app import SUBCOMMANDS

    for argv in [[c.name] for c in SUBCOMMANDS] + [["config", "check"]]:
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert info.value.code == 0
        assert re.search(r"^examples?:\n  fd-rr ", out, re.M), (argv, out)
        description = out.split("\n\n")[1]
        assert len(description.split()) >= 8, (argv, description)


@pytest.mark.parametrize("argv", [["ls", "--coun"], ["ls", "--names"], ["--deb", "ls"],
                                  ["show", "k", "--js"], ["rm", "k", "--ye"]])
def test_long_options_cannot_be_abbreviated(filled, capsys, argv):
    opts, _, _ = filled
    with pytest.raises(SystemExit) as info:
        main([*argv, *opts])
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_fsck_that_cannot_check_exits_3_not_2(filled, capsys):
    opts, _, store = filled
    code, _, err = run(["fsck", *opts], capsys)
    assert code == 3, err
    assert err.startswith(f"error: fsck of local://{store.root}") and "no 'index'" in err
    code, _, err = run(["fsck", "--config", "/nonexistent/fdrr.yaml"], capsys)
    assert code == 3 and err.startswith("error: cannot open the store: config file not found")
    with pytest.raises(SystemExit) as info:
        main(["fsck", "--batch", "0", *opts])
    assert info.value.code == 2


needs_redis = pytest.mark.skipif(redis_server_binary() is None,
                                 reason="redis-server binary not found (Debian redis-server)")


@pytest.mark.redis
@needs_redis
def test_fsck_json_and_exit_codes(redis_server_clean, capsys):
    from fd_routing_replay.store import open_store

    url = redis_server_clean.url
    store = open_store({"url": url, "namespace": "fj"})
    for i in range(3):
        store.put(f"f_{i}:0:0", b"x")
    store.index.remove(["f_1:0:0"])                     # a payload the index lost
    args = ["fsck", "--json", "--store", url, "--namespace", "fj"]
    code, out, _ = run(args, capsys)
    report = json.loads(out)
    assert code == 1 and report["consistent"] is False and report["unindexed"] == ["f_1:0:0"]
    assert report["namespace"] == "fj" and report["payloads"] == 3 and report["indexed"] == 2
    code, out, _ = run([*args, "--repair"], capsys)
    assert code == 0 and json.loads(out)["repaired"] is True
    code, out, _ = run(args, capsys)
    assert code == 0 and json.loads(out)["consistent"] is True
    store.close()
    down = f"redis://127.0.0.1:{free_port()}/0"
    code, out, err = run(["fsck", "--json", "--store", down], capsys)
    assert code == 3 and out == "" and err.startswith("error: fsck of redis")
