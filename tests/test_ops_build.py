"""Building and loading the compiled ops, and the fallback to the numpy reference.

Backend selection happens once per process, at import, so every scenario runs in a
child interpreter with its own environment (FD_RR_OPS, FD_RR_OPS_AOT_DIR,
FD_RR_OPS_CACHE, FD_RR_OPS_JIT).  No scenario compiles: `make ops` (custom_ops/build.py)
is the build these tests inspect, and a JIT cache hit is staged from its output.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.core import native
from tests.test_ops import as_tensor

REPO = Path(__file__).resolve().parent.parent
AOT_LIBRARY = native.aot_dir() / native.OPS.file_name

CHILD = r"""
import json, sys, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from fd_routing_replay import ops
    from fd_routing_replay.ops.dtypes import NP_ROUTING
mine = [str(w.message) for w in caught if "fd_routing_replay" in str(w.message)]
if len(sys.argv) > 1:  # run every op on the inputs in the npz, save the outputs
    import paddle
    data = np.load(sys.argv[1])
    def t(a):  # a Paddle-owned copy in the real dtype (to_tensor makes uint16 bfloat16)
        return paddle.to_tensor(a.astype(np.int64)).cast(NP_ROUTING[a.dtype]) if a.dtype == np.uint16 else paddle.to_tensor(a)
    table, errors = t(data["table"]), paddle.zeros([1], "int64")
    ops.record_routing(table, t(data["ids"]), t(data["batch"]), t(data["cu"]), t(data["dec"]), 1,
                       errors, num_experts=int(data["experts"]))
    rows = np.from_dlpack(ops.gather_routing_rows(table, data["b"], data["p"])).copy()
    packed = ops.pack_routing(data["source"], data["slots"])
    packed_t = np.from_dlpack(ops.pack_routing(t(data["source"]), t(data["slots"]))).copy()
    ops.clear_routing_rows(table, data["b"][:1])
    np.savez(sys.argv[2], table=np.from_dlpack(table), errors=errors.numpy(), rows=rows,
             packed=packed, packed_t=packed_t)
print(json.dumps({"backend": ops.ops_backend(), "reason": ops.ops_backend_reason(), "warnings": mine}))
"""


def run_child(env_updates: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    env.update(env_updates)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True,
                          text=True, timeout=300)


def child_report(env_updates: dict[str, str], *args: str) -> dict:
    done = run_child(env_updates, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built() -> Path:
    if ops.ops_backend() != "compiled" or not AOT_LIBRARY.exists():
        pytest.fail(f"the ahead-of-time build is missing or unused ({ops.ops_backend_reason()}); run `make ops`")
    return AOT_LIBRARY


def test_build_is_idempotent(built: Path) -> None:
    """`make ops` twice: the second build recognises its digest and touches nothing (both
    libraries: the ops and the Paddle-free C library)."""
    for library in native.LIBRARIES:
        path = native.aot_dir() / library.file_name
        before = path.stat().st_mtime_ns
        assert native.build(library, native.aot_dir()) == path
        assert path.stat().st_mtime_ns == before  # not rebuilt, not even copied again
        assert native.built_digest(native.aot_dir(), library) == native.source_digest(library)
    assert (native.aot_dir() / native.STAMP_NAME).exists()


def test_forced_reference_warns_once_and_computes_the_same(built: Path, tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts = 40000  # uint16, values above 256
    table = rng.integers(0, experts, (4, 12, 3, 2)).astype(np.uint16)
    inputs = {
        "table": table,
        "ids": rng.integers(-2, experts + 2, (7, 2)).astype(np.int64),
        "batch": np.array([0, 0, 0, 2, 3, 3, -1], np.int32),
        "cu": np.array([0, 3, 3, 4, 6], np.int32),
        "dec": rng.integers(0, 12, 4).astype(np.int32),
        "experts": np.array(experts),
        "b": rng.integers(0, 4, 5), "p": rng.integers(0, 12, 5),
        "source": rng.integers(0, experts, (30, 3, 2)).astype(np.uint16),
        "slots": rng.integers(0, 30, 11),
    }
    np.savez(tmp_path / "in.npz", **inputs)
    report = child_report({"FD_RR_OPS": "reference"}, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    assert report["backend"] == "reference"
    assert len(report["warnings"]) == 1 and "FD_RR_OPS=reference" in report["warnings"][0]
    got = np.load(tmp_path / "out.npz")
    # the same calls here, on the compiled backend
    t = as_tensor
    mine, errors = t(table.copy()), paddle.zeros([1], "int64")
    ops.record_routing(mine, t(inputs["ids"]), t(inputs["batch"]), t(inputs["cu"]), t(inputs["dec"]), 1,
                       errors, num_experts=experts)
    np.testing.assert_array_equal(got["rows"], np.from_dlpack(mine)[inputs["b"], inputs["p"]])
    ops.clear_routing_rows(mine, inputs["b"][:1])
    np.testing.assert_array_equal(got["table"], np.from_dlpack(mine))
    assert int(got["errors"][0]) == int(errors.numpy()[0])
    expected_pack = inputs["source"][inputs["slots"]].transpose(1, 0, 2)
    np.testing.assert_array_equal(got["packed"], expected_pack)
    np.testing.assert_array_equal(got["packed_t"], expected_pack)


def test_missing_build_without_jit_falls_back_with_reason(tmp_path: Path) -> None:
    report = child_report({"FD_RR_OPS_AOT_DIR": str(tmp_path / "none"), "FD_RR_OPS_JIT": "0"})
    assert report["backend"] == "reference"
    assert "no ahead-of-time build" in report["reason"] and "FD_RR_OPS_JIT=0" in report["reason"]
    assert len(report["warnings"]) == 1 and report["reason"] in report["warnings"][0]


def test_forced_compiled_without_a_build_fails_at_import(tmp_path: Path) -> None:
    done = run_child({"FD_RR_OPS": "compiled", "FD_RR_OPS_AOT_DIR": str(tmp_path), "FD_RR_OPS_JIT": "0"})
    assert done.returncode != 0
    assert "OpsError" in done.stderr and "FD_RR_OPS=compiled" in done.stderr


def test_unknown_mode_is_rejected() -> None:
    done = run_child({"FD_RR_OPS": "fastest"})
    assert done.returncode != 0 and "FD_RR_OPS='fastest'" in done.stderr


def test_stale_build_is_not_loaded(built: Path, tmp_path: Path) -> None:
    shutil.copy(built, tmp_path / built.name)
    (tmp_path / f"{native.OPS.name}.json").write_text(json.dumps({"digest": "0" * 64}))
    report = child_report({"FD_RR_OPS_AOT_DIR": str(tmp_path), "FD_RR_OPS_JIT": "0"})
    assert report["backend"] == "reference" and "stale" in report["reason"]


def test_jit_cache_is_used_when_the_ahead_of_time_build_is_missing(built: Path, tmp_path: Path) -> None:
    info = f"{native.OPS.name}.json"
    cache = tmp_path / "cache" / native.jit_dir(native.OPS, native.source_digest(native.OPS)).name
    cache.mkdir(parents=True)
    shutil.copy(built, cache / built.name)
    shutil.copy(native.aot_dir() / info, cache / info)
    report = child_report({"FD_RR_OPS_AOT_DIR": str(tmp_path / "none"),
                           "FD_RR_OPS_CACHE": str(tmp_path / "cache")})
    assert report["backend"] == "compiled", report["reason"]
    assert report["reason"].startswith("JIT build") and report["warnings"] == []


def test_device_scripts_parse(tmp_path: Path) -> None:
    for script in ("scripts/cuda_compile_check.sh", "scripts/device_check.sh"):
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    for script in ("scripts/device_check.py", "custom_ops/build.py"):  # bytecode to tmp_path:
        # a __pycache__ in custom_ops/ would look like a source change to the Makefile
        py_compile.compile(str(REPO / script), cfile=str(tmp_path / "x.pyc"), doraise=True)
