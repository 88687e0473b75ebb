"""The runtime wheel, as a user installs it (`make wheel-smoke`, scripts/wheel_smoke.sh).

Two steps, run by different interpreters:

``check-dist DIST``
    Any Python 3.11 (standard library only), in the checkout: ``DIST`` holds exactly one
    sdist and one wheel of this version.  The wheel is ``py3-none-any`` and holds exactly
    the checkout's ``fd_routing_replay/**/*.py`` (``git ls-files``), ``py.typed``, the op
    sources in ``fd_routing_replay/_csrc/`` and its dist-info: no ``fdrr_dev``, no tests,
    no prebuilt ``.so``, no stale module.  The sdist holds what rebuilds that wheel
    (setup.py, setup.cfg, pyproject.toml, MANIFEST.in, README.md, ``custom_ops/`` sources)
    and nothing else.

``installed WORKDIR``
    The interpreter of a fresh venv holding Paddle and the wheel with its declared
    dependencies, started outside the checkout: the package comes from that venv's
    site-packages; both compiled libraries build on first use from the shipped sources
    into a fresh cache (``FD_RR_OPS=compiled``: no fallback) and agree with NumPy and the
    ``xxhash`` package on random inputs; ``fd-rr doctor`` passes on a local store; a
    ``RoutingWriter`` (process mode) stores a record that a ``RoutingReader`` reads back
    equal, and ``fd-rr ls`` / ``show`` / ``get`` see it.

Exit status 0 only when every check passed; the first failed check is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fd_routing_replay"
# custom_ops/ files that no library is built from (the standalone CUDA device-check harness)
NOT_SHIPPED = {"cuda_harness.cu"}
SOURCE_SUFFIXES = (".cc", ".cu", ".h", ".cuh")
SDIST_TOP = {"PKG-INFO", "setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md"}


class SmokeFailure(Exception):
    """A check failed (the message says which and what was seen)."""


def check(condition: object, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def _sorted_diff(actual: set[str], expected: set[str]) -> str:
    return (f"missing {sorted(expected - actual)[:20]}, unexpected {sorted(actual - expected)[:20]}")


# -- check-dist --------------------------------------------------------------------------
def checkout_files(pattern: str) -> set[str]:
    """The checkout's files matching ``pattern`` (tracked, plus untracked not ignored)."""
    done = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", pattern],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    check(done.returncode == 0, f"git ls-files failed (check-dist needs a git checkout): "
                                f"{done.stderr.strip()}")
    return {line for line in done.stdout.splitlines() if (ROOT / line).is_file()}


def op_sources() -> set[str]:
    """The custom_ops/ sources a wheel ships (file names)."""
    names = {PurePosixPath(p).name for p in checkout_files("custom_ops/*")}
    shipped = {n for n in names if n.endswith(SOURCE_SUFFIXES)} - NOT_SHIPPED
    check({"step_ops.cc", "set_codec.cc"} <= shipped, f"custom_ops/ sources not found: {sorted(names)}")
    return shipped


def version() -> str:
    text = (ROOT / PACKAGE / "_version.py").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("__version__")), None)
    check(line is not None, "fd_routing_replay/_version.py has no __version__")
    return line.split("=", 1)[1].strip().strip("\"'")


def check_wheel(wheel: Path, modules: set[str], sources: set[str], ver: str) -> None:
    check(wheel.name == f"{PACKAGE}-{ver}-py3-none-any.whl",
          f"wheel {wheel.name}: expected {PACKAGE}-{ver}-py3-none-any.whl (pure Python: the ops "
          "build on first use)")
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = f"{PACKAGE}-{ver}.dist-info/"
    package = {n for n in names if n.startswith(f"{PACKAGE}/")}
    others = names - package - {n for n in names if n.startswith(dist_info)}
    check(not others, f"wheel {wheel.name} holds files outside {PACKAGE}/ and its dist-info "
                      f"(fdrr_dev? tests?): {sorted(others)[:20]}")
    expected = modules | {f"{PACKAGE}/py.typed"} | {f"{PACKAGE}/_csrc/{s}" for s in sources}
    check(package == expected, f"wheel {wheel.name}: package files differ from the checkout's: "
                               f"{_sorted_diff(package, expected)}")
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read(f"{dist_info}WHEEL").decode()
        entry_points = archive.read(f"{dist_info}entry_points.txt").decode()
    check("Root-Is-Purelib: true" in meta and "Tag: py3-none-any" in meta,
          f"wheel {wheel.name}: WHEEL metadata is not pure py3-none-any:\n{meta}")
    for needed in ("fd-rr = fd_routing_replay.cli:main", "[fastdeploy.model_runner_plugins]",
                   "[fastdeploy.token_processor_plugins]"):
        check(needed in entry_points, f"wheel {wheel.name}: entry point {needed!r} missing")
    print(f"ok   wheel {wheel.name}: {len(modules)} modules, {len(sources)} op sources in "
          f"{PACKAGE}/_csrc/, no fdrr_dev, no tests, no .so")


def check_sdist(sdist: Path, modules: set[str], sources: set[str], ver: str) -> None:
    check(sdist.name == f"{PACKAGE}-{ver}.tar.gz", f"sdist {sdist.name}: expected {PACKAGE}-{ver}.tar.gz")
    top = f"{PACKAGE}-{ver}/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
    names = {m.name for m in members}
    check(all(n.startswith(top) for n in names), f"sdist {sdist.name}: files outside {top}")
    files = {n[len(top):] for n in names}
    egg_info = {f for f in files if f.startswith(f"{PACKAGE}.egg-info/")}
    expected = (SDIST_TOP | modules | {f"{PACKAGE}/py.typed"}
                | {f"custom_ops/{s}" for s in sources})
    check(files - egg_info == expected, f"sdist {sdist.name}: files differ from what rebuilds the "
                                        f"wheel: {_sorted_diff(files - egg_info, expected)}")
    print(f"ok   sdist {sdist.name}: setup files, README, {len(sources)} custom_ops sources, "
          f"{len(modules)} modules, nothing else")


def check_dist(dist: Path) -> None:
    ver = version()
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    sdists = sorted(dist.glob(f"{PACKAGE}-*.tar.gz"))
    check(len(wheels) == 1 and len(sdists) == 1,
          f"{dist}: expected one wheel and one sdist, found {[p.name for p in wheels + sdists]}")
    modules = checkout_files(f"{PACKAGE}/*.py")  # a pathspec's * crosses directories
    check(f"{PACKAGE}/__init__.py" in modules, f"no {PACKAGE}/__init__.py in the checkout")
    sources = op_sources()
    check_wheel(wheels[0], modules, sources, ver)
    check_sdist(sdists[0], modules, sources, ver)


# -- installed ---------------------------------------------------------------------------
def _run_cli(work: Path, *args: str) -> subprocess.CompletedProcess:
    fd_rr = Path(sys.executable).parent / "fd-rr"
    check(fd_rr.is_file(), f"the wheel installed no fd-rr console script next to {sys.executable}")
    return subprocess.run([str(fd_rr), *args], cwd=work, capture_output=True, text=True,
                          timeout=600, check=False)


def check_origin() -> Path:
    import importlib.util
    import sysconfig

    import fd_routing_replay

    package = Path(fd_routing_replay.__file__).resolve().parent
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    print(f"     fd_routing_replay {fd_routing_replay.__version__} imported from {package}")
    check(sys.prefix != sys.base_prefix, f"{sys.executable} is not a virtual environment")
    check(package.parent == purelib, f"fd_routing_replay came from {package}, not from this "
                                     f"venv's site-packages {purelib}")
    check(str(ROOT) not in {str(Path(p or ".").resolve()) for p in sys.path},
          f"the checkout {ROOT} is on sys.path: {sys.path}")
    check(importlib.util.find_spec("fdrr_dev") is None, "fdrr_dev is importable: it must not be "
                                                        "installed with the wheel")
    check(not (package / "_ops").exists(), f"{package / '_ops'} exists: the wheel ships no prebuilt library")
    print(f"ok   installed from the wheel: {package} (site-packages of {sys.prefix}); no fdrr_dev")
    return package


def check_ops(package: Path, rng) -> None:
    """Both compiled libraries build from the shipped sources and compute what NumPy and
    the xxhash package compute."""
    import numpy as np
    import xxhash

    from fd_routing_replay.core import native

    shipped = {p.name for p in (package / "_csrc").iterdir()}
    needed = {n for lib in native.LIBRARIES for n in lib.sources + lib.headers + lib.cuda_sources}
    check(shipped == needed, f"_csrc/ is not exactly the libraries' sources: {_sorted_diff(shipped, needed)}")
    for library in native.LIBRARIES:
        check(native.sources_dir(library) == package / "_csrc",
              f"{library.name}: sources found at {native.sources_dir(library)}, not the wheel's _csrc/")
    cache = native.cache_dir()
    check(not cache.exists() or not any(cache.iterdir()), f"JIT cache {cache} is not empty")

    started = time.monotonic()
    import fd_routing_replay.ops as ops

    check(ops.ops_backend() == "compiled", f"ops backend {ops.ops_backend()}: {ops.ops_backend_reason()}")
    reason = ops.ops_backend_reason()
    check(reason.startswith("JIT build") and str(cache) in reason, f"ops not JIT-built into {cache}: {reason}")
    print(f"ok   ops built on first use in {time.monotonic() - started:.1f} s: {reason}")
    block_size, blocks, layers, top_k = 4, int(rng.integers(4, 16)), int(rng.integers(2, 9)), 8
    cache = rng.integers(0, 64, size=(blocks * block_size, layers, top_k)).astype(np.uint8)
    block_row = rng.permutation(blocks).astype(np.int64)
    length = int(rng.integers(1, blocks * block_size + 1))
    start = int(rng.integers(0, length))
    slots = [int(block_row[p // block_size]) * block_size + p % block_size for p in range(start, length)]
    packed = ops.request_packer()(cache, block_row, start, length, block_size)
    check(np.array_equal(packed, cache[slots].transpose(1, 0, 2)),
          "pack_request disagrees with NumPy indexing through the block table")

    from fd_routing_replay.codec import checksum, setcodec

    started = time.monotonic()
    check(setcodec.set_codec_backend() == "native", f"set codec {setcodec.set_codec_reason()}")
    check(setcodec.set_codec_reason().startswith("JIT build"), setcodec.set_codec_reason())
    check(checksum.checksum_backend().startswith("native"), checksum.checksum_backend())
    data = rng.integers(0, 256, size=(2 << 20) + int(rng.integers(0, 4096)), dtype=np.uint8)
    check(checksum.xxh3_64(data) == xxhash.xxh3_64_intdigest(data.tobytes()),
          "native XXH3-64 disagrees with the xxhash package")
    # K distinct experts per row (a top-k set), in random order
    ids = np.argsort(rng.random((3, 50, 64)), axis=-1)[..., :6].astype(np.uint8)
    payload = setcodec.encode_sets(ids, 64, 255)
    decoded = setcodec.decode_sets(payload, ids.shape, 64, 255, np.uint8)
    check(np.array_equal(decoded, np.sort(ids, axis=-1)), "set codec round trip lost a set")
    print(f"ok   C library built on first use in {time.monotonic() - started:.1f} s "
          f"(checksum {checksum.checksum_backend()}): {setcodec.set_codec_reason()}")


def check_doctor(work: Path) -> None:
    url = f"local://{work / 'doctor-store'}"
    done = _run_cli(work, "doctor", "--store", url, "--json")
    check(done.returncode == 0, f"fd-rr doctor --store {url} exited {done.returncode}:\n"
                                f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    status = {c["name"]: c["status"] for c in report["checks"]}
    check(not report["failed"] and all(status.get(n) == "ok" for n in ("config", "store", "roundtrip")),
          f"fd-rr doctor: {report}")
    ran = [name for name, state in status.items() if state != "skip"]
    skipped = [name for name, state in status.items() if state == "skip"]
    print(f"ok   fd-rr doctor --store {url}: {', '.join(f'{n} {status[n]}' for n in ran)}; not applicable to a local "
          f"store (skipped): {', '.join(skipped)}")


def check_round_trip(work: Path, rng) -> None:
    import numpy as np
    import xxhash

    from fd_routing_replay import RoutingReader, RoutingRecord, RoutingWriter, open_store

    url, namespace = f"local://{work / 'store'}", "wheel_smoke"
    rollout_id = f"wheel_smoke_{int(rng.integers(1 << 30))}:0:0"
    # over 1 MiB: the writer process checksums it with the C library
    ids = rng.integers(0, 64, size=(6, int(rng.integers(24_000, 32_000)), 8)).astype(np.uint8)
    metadata = {"source": "wheel-smoke", "step": int(rng.integers(1000))}
    writer = RoutingWriter({"url": url, "namespace": namespace},
                           {"mode": "process", "capacity_bytes": 16 << 20,
                            "journal_dir": str(work / "journal"),
                            "dead_letter_dir": str(work / "dead")})
    try:
        check(writer.submit_put(rollout_id, RoutingRecord(rollout_id, ids, 64, metadata=metadata)),
              "the writer dropped the record")
        check(writer.flush(timeout=120), "the writer did not store the record within 120 s")
        pid = writer.worker_pid
    finally:
        writer.close(timeout=60)
    check(pid is not None and pid != os.getpid(), f"writer ran in this process (pid {pid})")
    got = RoutingReader(open_store(url, namespace)).get(rollout_id)
    check(got is not None, f"RoutingReader found no record {rollout_id} in {url}")
    check(got.rollout_id == rollout_id and got.num_experts == 64, f"record {got.rollout_id}")
    check(np.array_equal(got.ids, ids), "the record read back differs from the one written")
    check(all(got.metadata.get(k) == v for k, v in metadata.items()),
          f"metadata {metadata} read back as {got.metadata}")
    print(f"ok   RoutingWriter (process, pid {pid}) -> {url} -> RoutingReader: {rollout_id} "
          f"{list(ids.shape)} read back equal, metadata kept")

    where = ("--store", url, "--namespace", namespace)
    listed = _run_cli(work, "ls", *where, "--json")
    check(listed.returncode == 0, f"fd-rr ls: {listed.stderr[-2000:]}")
    check(json.loads(listed.stdout)["keys"] == [rollout_id], f"fd-rr ls: {listed.stdout}")
    shown = _run_cli(work, "show", rollout_id, *where, "--json")
    check(shown.returncode == 0, f"fd-rr show: {shown.stderr[-2000:]}")
    header = json.loads(shown.stdout)["header"]
    check(header["shape"] == list(ids.shape) and header["num_experts"] == 64, f"fd-rr show: {header}")
    check(header["checksum"] == xxhash.xxh3_64_intdigest(ids.tobytes()),
          "the stored checksum is not the xxhash package's XXH3-64 of the ids")
    out = work / "routing.npy"
    fetched = _run_cli(work, "get", rollout_id, *where, "-o", str(out))
    check(fetched.returncode == 0, f"fd-rr get: {fetched.stderr[-2000:]}")
    check(np.array_equal(np.load(out), ids), "fd-rr get saved other ids")
    print("ok   fd-rr ls / show / get see the record (checksum = xxhash's XXH3-64 of its ids)")


def installed(work: Path) -> None:
    import numpy as np

    work = work.resolve()
    check(not work.is_relative_to(ROOT) and not Path.cwd().resolve().is_relative_to(ROOT),
          f"run the installed smoke outside the checkout {ROOT} (work dir {work}, cwd {Path.cwd()})")
    for name in [k for k in os.environ if k.startswith("FD_RR_OPS")]:
        del os.environ[name]
    os.environ.update(FD_RR_OPS="compiled", FD_RR_OPS_CACHE=str(work / "jit-cache"),
                      FD_RR_OPS_AOT_DIR=str(work / "no-aot"))
    seed = int(os.environ.get("WHEEL_SMOKE_SEED", "29"))
    print(f"     seed {seed} (WHEEL_SMOKE_SEED)")
    rng = np.random.default_rng(seed)
    package = check_origin()
    check_ops(package, rng)
    check_doctor(work)
    check_round_trip(work, rng)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("check-dist").add_argument("dist", type=Path)
    sub.add_parser("installed").add_argument("workdir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.step == "check-dist":
            check_dist(args.dist.resolve())
        else:
            installed(args.workdir)
    except SmokeFailure as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
