"""The built wheel works on its own: its sources build both compiled libraries just in time.

Builds the wheel from this checkout, installs it (without dependencies) into an empty
target directory, and imports it in a child interpreter whose ``sys.path`` puts that
directory first, with no ahead-of-time build and a fresh JIT cache: the ops must compile
from the sources the wheel ships (``fd_routing_replay/_csrc``); so must the Paddle-free C
library (set codec, checksum, unrouted count), never falling back to NumPy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, numpy as np, fd_routing_replay, fd_routing_replay.ops as ops
from fd_routing_replay.codec import checksum, setcodec
cache = np.random.default_rng(0).integers(0, 64, size=(8, 3, 4)).astype(np.uint8)
packed = ops.request_packer()(cache, np.array([1, 0], np.int64), 1, 7, 4)   # positions 1..6
slots = [5, 6, 7, 0, 1, 2]     # positions 0-3 sit in block 1 (slots 4-7), 4-7 in block 0
print(json.dumps({"file": fd_routing_replay.__file__, "backend": ops.ops_backend(),
                  "reason": ops.ops_backend_reason(), "set_codec": setcodec.set_codec_backend(),
                  "checksum": checksum.checksum_backend(), "c_reason": setcodec.set_codec_reason(),
                  "ok": bool((packed == cache[slots].transpose(1, 0, 2)).all())}))
"""


@pytest.mark.slow
def test_installed_wheel_builds_its_ops_from_shipped_sources(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("fd_routing_replay-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # every op source the library is built from (the standalone CUDA harness is not part of it)
    sources = {p.name for p in (ROOT / "custom_ops").iterdir()
               if p.suffix in (".cc", ".cu", ".h", ".cuh") and p.name != "cuda_harness.cu"}
    assert {"step_ops.cc", "step_ledger.cc", "step_ops.cu", "routing_kernels.cuh", "unrouted.cc"} <= sources
    for source in sorted(sources):
        assert f"fd_routing_replay/_csrc/{source}" in names, source
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_RR_OPS")}
    env.update(PYTHONPATH=str(site), FD_RR_OPS="compiled", FD_RR_OPS_AOT_DIR=str(tmp_path / "no-aot"),
               FD_RR_OPS_CACHE=str(tmp_path / "jit-cache"))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve().is_relative_to(site.resolve()), report
    assert report["backend"] == "compiled", report["reason"]
    assert report["set_codec"] == "native" and report["checksum"].startswith("native"), report
    assert report["c_reason"].startswith("JIT build"), report
    assert report["ok"]
