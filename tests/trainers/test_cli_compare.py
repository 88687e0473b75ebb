"""``fd-rr compare KEY FILE.npy`` through the real CLI and a local store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fd_routing_replay.cli import main
from fd_routing_replay.codec import encode_record
from fd_routing_replay.store.local import LocalStore
from fd_routing_replay.trainers import compare_routing, to_sglang_routed_experts
from tests.trainers.records import make_record, random_ids


@pytest.fixture
def stored(tmp_path, seed):
    gen = np.random.default_rng(seed)
    record = make_record(gen, "exp_c:0:0", tokens=12, layers=(1, 2, 4), top_k=2,
                         num_experts=8, unrouted=(5,))
    LocalStore(tmp_path / "rr", "compare").put(record.rollout_id, encode_record(record))
    return [f"--store=local://{tmp_path / 'rr'}", "--namespace=compare"], record, gen


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_compare_prints_the_metrics(stored, tmp_path, capsys):
    opts, record, gen = stored
    recomputed = record.ids.astype(np.int64)
    recomputed[:, :4] = random_ids(gen, 3, 4, 2, 8)          # the trainer disagrees early
    path = tmp_path / "trainer.npy"
    np.save(path, recomputed)
    code, out, err = run(["compare", "exp_c:0:0", str(path), "--json", *opts], capsys)
    assert code == 0, err
    result = json.loads(out)
    expected = compare_routing(record, recomputed)
    assert result["flip_rate"] == pytest.approx(expected["flip_rate"])
    assert result["decisions"] == 3 * 11 and result["passed"] is True
    code, out, _ = run(["compare", "exp_c:0:0", str(path), *opts], capsys)
    assert code == 0 and "flip rate" in out and "mean overlap" in out
    if expected["flip_rate"] > 0:
        code, _, err = run(["compare", "exp_c:0:0", str(path), "--max-flip-rate", "0", *opts],
                           capsys)
        assert code == 1 and "above --max-flip-rate" in err


def test_compare_reads_an_sglang_style_array(stored, tmp_path, capsys):
    opts, record, _ = stored
    path = tmp_path / "sglang.npy"
    np.save(path, to_sglang_routed_experts(record, num_layers=6))   # [T, 6 layers, K]
    code, out, err = run(["compare", "exp_c:0:0", str(path), "--layout", "TLK", "--json",
                          *opts], capsys)
    assert code == 0, err
    assert json.loads(out)["flip_rate"] == 0.0


def test_compare_errors_are_one_line(stored, tmp_path, capsys):
    opts, _, _ = stored
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 12, 2), np.int64))
    code, _, err = run(["compare", "exp_c:0:0", str(bad), *opts], capsys)
    assert code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    code, _, err = run(["compare", "exp_c:0:0", str(objects), *opts], capsys)
    assert code == 1 and "not a plain NumPy array" in err
    code, _, err = run(["compare", "exp_zz:0:0", str(bad), *opts], capsys)
    assert code == 1 and "no record" in err
