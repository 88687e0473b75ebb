"""Building and loading the compiled ops library, and what happens without it.

The library is loaded once per process, at import, so every scenario runs in a child
interpreter with its own environment (FD_RR_OPS, FD_RR_OPS_AOT_DIR, FD_RR_OPS_CACHE,
FD_RR_OPS_JIT).  No scenario compiles: `make ops` (custom_ops/build.py) is the build these
tests inspect, and a JIT cache hit is staged from its output.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fd_routing_replay import ops
from fd_routing_replay.core import native

REPO = Path(__file__).resolve().parent.parent
AOT_LIBRARY = native.aot_dir() / native.OPS.file_name

CHILD = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from fd_routing_replay import ops
mine = [str(w.message) for w in caught if "fd_routing_replay" in str(w.message)]
report = {"backend": ops.ops_backend(), "reason": ops.ops_backend_reason(), "warnings": mine}
from paddle.base import core
report["paddle_ops"] = sorted(name for name in core.get_all_op_names() if name.startswith("fdrr"))
print(json.dumps(report))
"""

# Without the library: what still works (dtypes, the buffer), and what raises, once, naming why.
FIRST_USE = r"""
import json, numpy as np, paddle
from fd_routing_replay import ops
from fd_routing_replay.capture.device import StepBuffer
from fd_routing_replay.errors import OpsError
buffer = ops.new_step_buffer(4, 2, 2, 16)
errors = {}
calls = {
    "bind_step_recorder": lambda: ops.bind_step_recorder(
        buffer, paddle.zeros([3], "int64"), num_experts=16, host_rows=np.zeros((4, 2, 2), np.uint8),
        host_counters=np.zeros(3, np.int64), host_extra=np.zeros(0, np.uint8)),
    "bind_step_flush": lambda: ops.bind_step_flush(cache=None, staging=None, extra=None,
                                                   host_counters=None, seen=None, delta=None),
    "bind_step_ledger": lambda: ops.bind_step_ledger(),
    "request_packer": ops.request_packer,
    "StepBuffer": lambda: StepBuffer(max_tokens=4, num_layers=2, top_k=2, num_experts=16),
}
for name, call in calls.items():
    try:
        call()
        errors[name] = None
    except OpsError as exc:
        errors[name] = str(exc)
print(json.dumps({"backend": ops.ops_backend(), "reason": ops.ops_backend_reason(),
                  "buffer": np.from_dlpack(buffer).tolist(), "errors": errors}))
"""


def run_child(env_updates: dict[str, str], code: str = CHILD) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    env.update(env_updates)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def child_report(env_updates: dict[str, str], code: str = CHILD) -> dict:
    done = run_child(env_updates, code)
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


def test_the_library_loads_and_registers_no_paddle_op(built: Path) -> None:
    """One implementation, reached through its pybind11 module: no custom op is registered
    with Paddle (its dispatch is what the bound entry points avoid), no warning."""
    report = child_report({})
    assert report["backend"] == "compiled" and report["reason"].startswith("ahead-of-time build")
    assert report["paddle_ops"] == [] and report["warnings"] == []


def test_without_the_library_the_first_bind_raises_naming_why(tmp_path: Path) -> None:
    """No build and no JIT: importing works, the buffer is made, and every bound entry point
    -- hence the first capture constructor -- raises OpsError with the reason; no fallback."""
    report = child_report({"FD_RR_OPS_AOT_DIR": str(tmp_path / "none"), "FD_RR_OPS_JIT": "0"}, FIRST_USE)
    assert report["backend"] == "unavailable"
    assert "no ahead-of-time build" in report["reason"] and "FD_RR_OPS_JIT=0" in report["reason"]
    assert report["buffer"] == [[[255, 255]] * 2] * 4
    for name, error in report["errors"].items():
        assert error is not None, name
        assert error.startswith("routing replay needs its compiled ops library"), (name, error)
        assert report["reason"] in error, (name, error)


def test_forced_compiled_without_a_build_fails_at_import(tmp_path: Path) -> None:
    done = run_child({"FD_RR_OPS": "compiled", "FD_RR_OPS_AOT_DIR": str(tmp_path), "FD_RR_OPS_JIT": "0"})
    assert done.returncode != 0
    assert "OpsError: FD_RR_OPS=compiled but the compiled routing ops cannot load" in done.stderr
    assert "FD_RR_OPS_JIT=0" in done.stderr


def test_unknown_mode_is_rejected() -> None:
    for value in ("fastest", "reference"):         # the NumPy reference backend is gone
        done = run_child({"FD_RR_OPS": value})
        assert done.returncode != 0 and f"FD_RR_OPS={value!r}" in done.stderr


def test_stale_build_is_not_loaded(built: Path, tmp_path: Path) -> None:
    shutil.copy(built, tmp_path / built.name)
    (tmp_path / f"{native.OPS.name}.json").write_text(json.dumps({"digest": "0" * 64}))
    report = child_report({"FD_RR_OPS_AOT_DIR": str(tmp_path), "FD_RR_OPS_JIT": "0"})
    assert report["backend"] == "unavailable" and "stale" in report["reason"]


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
