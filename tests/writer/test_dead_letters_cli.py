"""``fd-rr dead-letters ls|replay|drop`` (fd_routing_replay.cli.dead_letters), called as
functions on parsed arguments and a config (issue 10, item 6)."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from fd_routing_replay.cli import dead_letters as dl
from fd_routing_replay.config import load_config
from fd_routing_replay.writer.journal import DeadLetters, entry_name
from tests.writer.conftest import make_record

pytestmark = pytest.mark.parametrize("mode", ["thread"])


def _config(rig, *, only_last_turn: bool = False, **store_options):
    return load_config(overrides={"store": rig.store_config(**store_options),
                                  "writer": rig.writer_config(),
                                  "retention": {"only_last_turn": only_last_turn}}, env={})


def _args(**values) -> argparse.Namespace:
    defaults = {"dir": None, "dp_rank": None, "tp_rank": None, "device_id": None, "json": False,
                "names": [], "all": False, "yes": False, "journal_dir": None, "timeout": 30.0}
    defaults.update(values)
    return argparse.Namespace(**defaults)


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def _dead_letter_a_put(rig, np_rng, key: str = "poison_1:0:0", **writer_options):
    writer = rig.writer(store_options={"poison": "poison"}, **writer_options)
    record = make_record(np_rng, key)
    writer.submit_put(key, record)
    assert writer.flush(timeout=60)
    writer.close()
    assert writer.stats()["dead_lettered"] == 1
    return record


def test_ls_lists_dead_letters_with_keys_and_reasons_escaped(rig, np_rng, capsys):
    _dead_letter_a_put(rig, np_rng)
    DeadLetters(rig.dead_dir).add(entry_name(7), {"op": "delete", "keys": ["evil\x1b[2J\nkey"]},
                                  "reason\twith\x07 bell", error=ValueError("line1\nline2"))
    assert dl.cmd_ls(_args(), _config(rig)) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2
    assert "\x1b" not in out and "\x07" not in out
    evil = next(line for line in lines if line.startswith(entry_name(7)))
    assert "evil\\x1b[2J\\x0akey" in evil and "reason\\x09with\\x07 bell" in evil
    assert "line1\\x0aline2" in evil
    put = next(line for line in lines if "poison_1:0:0" in line)
    assert put.split("\t")[1:3] == ["put", "poison_1:0:0"] and "\trecord\t" in put
    assert "poisoned" in put

    assert dl.cmd_ls(_args(json=True), _config(rig)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["directory"] == str(rig.dead_dir)
    targets = sorted(row["target"] for row in listed["dead_letters"])
    assert targets == ["evil\x1b[2J\nkey", "poison_1:0:0"]


def test_replay_after_the_cause_is_fixed_writes_and_cleans_up(rig, np_rng, capsys):
    record = _dead_letter_a_put(rig, np_rng)
    (name,) = DeadLetters(rig.dead_dir).names()
    assert dl.cmd_replay(_args(all=True), _config(rig)) == 0
    out = capsys.readouterr().out
    assert f"replayed\t{name}\tpoison_1:0:0" in out
    assert rig.read("poison_1:0:0").ids.tobytes() == record.ids.tobytes()
    assert _files(rig.dead_dir) == []  # .json, .rr and .reason all gone
    assert [p for p in rig.dead_dir.iterdir()] == []  # and no scratch directory left


def test_replay_rejected_again_keeps_one_dead_letter_with_the_new_reason(rig, np_rng, capsys):
    _dead_letter_a_put(rig, np_rng)
    (name,) = DeadLetters(rig.dead_dir).names()
    assert dl.cmd_replay(_args(names=[name]), _config(rig, poison="poison")) == 1
    out = capsys.readouterr().out
    assert f"failed\t{name}\tpoison_1:0:0" in out
    assert _files(rig.dead_dir) == [f"{name}.json", f"{name}.reason", f"{name}.rr"]
    reason = (rig.dead_dir / f"{name}.reason").read_text()
    assert "replay failed" in reason and "poisoned" in reason
    sidecar = json.loads((rig.dead_dir / f"{name}.json").read_text())
    assert "replay_failed_at" in sidecar and sidecar["key"] == "poison_1:0:0"
    assert rig.reader.list() == []


def test_replay_goes_through_only_last_turn(rig, np_rng, capsys):
    """A dead-lettered turn 0 replayed after turn 1 is stored does not come back."""
    _dead_letter_a_put(rig, np_rng, key="poison_t:0:0")
    rig.reader.put("poison_t:1:0", b"turn 1, stored meanwhile")
    assert dl.cmd_replay(_args(all=True), _config(rig, only_last_turn=True)) == 0
    assert rig.reader.list() == ["poison_t:1:0"]
    assert _files(rig.dead_dir) == []


def test_drop_removes_record_sidecar_and_reason(rig, np_rng, capsys):
    _dead_letter_a_put(rig, np_rng)
    DeadLetters(rig.dead_dir).add(entry_name(3), {"op": "delete", "keys": ["k:0:0"]}, "x")
    names = DeadLetters(rig.dead_dir).names()
    assert dl.cmd_drop(_args(names=[names[0]], yes=True), _config(rig)) == 0
    assert DeadLetters(rig.dead_dir).names() == names[1:]
    assert not list(rig.dead_dir.glob(f"{names[0]}.*"))
    assert dl.cmd_drop(_args(all=True, yes=True), _config(rig)) == 0
    assert _files(rig.dead_dir) == []


@pytest.mark.parametrize("command", [dl.cmd_drop, dl.cmd_replay])
@pytest.mark.parametrize("names, all_", [([], False), (["../../etc/passwd"], False),
                                         ([entry_name(99)], False), ([entry_name(1)], True)])
def test_bad_selections_are_usage_errors_and_touch_nothing(rig, np_rng, capsys, command,
                                                          names, all_):
    _dead_letter_a_put(rig, np_rng)
    before = _files(rig.dead_dir)
    assert command(_args(names=names, all=all_, yes=True), _config(rig)) == dl.EXIT_USAGE
    assert "error:" in capsys.readouterr().err
    assert _files(rig.dead_dir) == before


def test_drop_without_a_terminal_needs_yes(rig, np_rng, monkeypatch):
    _dead_letter_a_put(rig, np_rng)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    from fd_routing_replay.errors import RoutingReplayError

    with pytest.raises(RoutingReplayError, match="--yes"):
        dl.cmd_drop(_args(all=True), _config(rig))
    assert len(DeadLetters(rig.dead_dir).names()) == 1


def test_run_parses_its_arguments_and_reads_the_config_file(rig, np_rng, tmp_path, capsys):
    _dead_letter_a_put(rig, np_rng)
    config_file = tmp_path / "rr.yaml"
    config_file.write_text(yaml.safe_dump({"store": rig.store_config(),
                                           "writer": rig.writer_config()}))
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--store")
    parser.add_argument("--namespace")
    dl.add_arguments(parser)
    assert dl.run(parser.parse_args(["--config", str(config_file), "ls"])) == 0
    assert "poison_1:0:0" in capsys.readouterr().out
    assert dl.run(parser.parse_args(["ls", "--config", str(config_file), "--json"])) == 0
    assert "poison_1:0:0" in capsys.readouterr().out
    assert dl.run(parser.parse_args(["--config", str(config_file), "replay", "--all"])) == 0
    assert rig.reader.list() == ["poison_1:0:0"]


def test_replay_builds_an_engines_rows_as_first_described(rig, np_rng, capsys):
    """A dead-lettered put of an engine's rows (per-layer keys, padded to max_model_len, a
    position without routing) is replayed as the record the engine asked for, not as the
    raw rows its ``.rr`` file holds."""
    import numpy as np

    from fd_routing_replay.writer.operation import Operation

    rollout_id, layers, tokens, top_k, pad_to, fill = "poison_r:0:0", 3, 7, 4, 12, 255
    rows = np_rng.integers(0, 64, size=(layers, tokens, top_k)).astype(np.uint8)
    rows[1, 5] = fill                                       # one position of one layer unrouted
    op = Operation.for_rows(rollout_id, shape=rows.shape, dtype=rows.dtype, num_experts=64,
                            fill_value=fill, layers=(1, 3, 5), fmt="rr-v1",
                            metadata={"request_id": "chatcmpl-poison_r:0:0-x"}, provenance={},
                            per_layer=True, pad_to=pad_to)
    writer = rig.writer(store_options={"poison": "poison"})
    writer.submit(op, lambda out: np.copyto(out, rows))
    assert writer.flush(timeout=60)
    writer.close()
    assert writer.stats()["dead_lettered"] == 1 and rig.reader.list() == []

    assert dl.cmd_replay(_args(all=True), _config(rig)) == 0
    assert sorted(rig.reader.list()) == [f"{rollout_id}_{layer}" for layer in range(layers)]
    for layer in range(layers):
        record = rig.read(f"{rollout_id}_{layer}")
        expected = np.full((1, pad_to, top_k), fill, np.uint8)
        expected[0, :tokens] = rows[layer]
        assert np.array_equal(record.ids, expected)
        assert record.layer_map == ((1, 3, 5)[layer],)
        assert record.metadata["layer"] == layer and record.metadata["num_layers"] == layers
        assert record.metadata["num_tokens"] == tokens and record.metadata["missing_tokens"] == 1
    assert _files(rig.dead_dir) == []


def test_replay_refuses_a_malformed_sidecar_and_keeps_it(rig, capsys):
    dead = DeadLetters(rig.dead_dir)
    dead.add(entry_name(3), {"op": "put", "key": 7}, "hand-made")
    assert dl.cmd_replay(_args(all=True), _config(rig)) == 1
    out = capsys.readouterr().out
    assert f"failed\t{entry_name(3)}" in out and "'key'" in out
    assert dead.names() == [entry_name(3)]
