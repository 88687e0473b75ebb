"""Build the compiled set codec: ``custom_ops/set_codec.cc`` → a plain C shared library.

No Paddle and no Python headers: one C++17 file (and its header ``set_codec_tables.h``)
compiled with the system's C++ compiler
(``$CXX``, else ``g++``, else ``c++``) with portable flags (``-march=x86-64-v2`` on x86-64,
never ``-march=native``: the library may be shipped or shared between machines).  The
library embeds the digest of its source and flags (``fdrr_set_source_digest()``), so a
stale build is recognised without a sidecar file.

Where builds live (mirroring :mod:`fd_routing_replay.ops.loader`, which the codec floor
may not import): ahead of time in ``fd_routing_replay/_ops/`` (``$FD_RR_OPS_AOT_DIR``),
written by ``custom_ops/build.py`` (``make ops``); just in time in ``$FD_RR_OPS_CACHE``
(default ``~/.cache/fd_routing_replay/ops``), one sub-directory per digest.  The sources
are the checkout's ``custom_ops/``, else the copy a wheel ships in ``fd_routing_replay/_csrc/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

__all__ = ["HEADER_NAMES", "LIBRARY_NAME", "SOURCE_NAME", "aot_dir", "build_library", "built_digest",
           "cache_dir", "compile_flags", "jit_dir", "source_digest", "sources_dir"]

SOURCE_NAME = "set_codec.cc"
HEADER_NAMES = ("set_codec_tables.h",)
LIBRARY_NAME = "fdrr_setcodec.so"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
_BUILD_TIMEOUT_S = 600


def sources_dir() -> Path | None:
    """The directory holding ``set_codec.cc`` (checkout, else the wheel's copy), or None."""
    for candidate in (PACKAGE_DIR.parent / "custom_ops", PACKAGE_DIR / "_csrc"):
        if (candidate / SOURCE_NAME).is_file():
            return candidate
    return None


def aot_dir() -> Path:
    """Where the ahead-of-time build lives ($FD_RR_OPS_AOT_DIR, else the package's _ops/)."""
    return Path(os.environ.get("FD_RR_OPS_AOT_DIR") or PACKAGE_DIR / "_ops")


def cache_dir() -> Path:
    """Root of the just-in-time build cache ($FD_RR_OPS_CACHE or ~/.cache/...)."""
    env = os.environ.get("FD_RR_OPS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fd_routing_replay" / "ops"


def jit_dir(digest: str) -> Path:
    """The just-in-time build directory for sources of ``digest``."""
    return cache_dir() / f"setcodec-{digest[:16]}"


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def compile_flags() -> tuple[str, ...]:
    """Optimisation and ABI flags; ``-march=x86-64-v2`` (SSE4.2, popcnt) on x86-64 only."""
    flags: tuple[str, ...] = ("-O3", "-std=c++17", "-fPIC", "-shared")
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += ("-march=x86-64-v2",)
    return flags


def source_digest(directory: Path) -> str:
    """Digest of what determines the library: the sources and the flags."""
    h = hashlib.sha256()
    for name in (SOURCE_NAME, *HEADER_NAMES):
        h.update(name.encode() + b"\0" + (directory / name).read_bytes() + b"\0")
    h.update(repr(compile_flags()).encode())
    return h.hexdigest()


def built_digest(library: Path) -> str | None:
    """The source digest embedded in ``library`` (read from its bytes, not loaded), or None."""
    try:
        data = library.read_bytes()
    except OSError:
        return None
    marker = data.find(b"fdrr-set-digest:")
    if marker < 0:
        return None
    return data[marker + 16:marker + 16 + 64].decode("ascii", "replace")


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise builds into ``directory`` across processes (e.g. data-loader workers)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".setcodec.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_library(out_dir: Path, *, force: bool = False, sources: Path | None = None) -> Path:
    """Compile ``set_codec.cc`` into ``out_dir/fdrr_setcodec.so`` and return its path.

    Idempotent: a library there built from the same digest is kept.  The result is moved
    into place atomically, so a concurrent loader never sees half a file.  RuntimeError
    (with the compiler's output) when there are no sources, no compiler, or it fails.
    """
    sources = sources or sources_dir()
    if sources is None:
        raise RuntimeError(f"no {SOURCE_NAME} to build from (neither custom_ops/ nor the "
                           f"wheel's fd_routing_replay/_csrc/)")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set $CXX, or install g++)")
    digest = source_digest(sources)
    out_dir = Path(out_dir)
    target = out_dir / LIBRARY_NAME
    with _locked(out_dir):
        if not force and built_digest(target) == digest:
            return target
        tmp = out_dir / f".{LIBRARY_NAME}.tmp{os.getpid()}"
        command = [cxx, *compile_flags(), f'-DFDRR_SET_DIGEST="fdrr-set-digest:{digest}"',
                   "-o", str(tmp), str(sources / SOURCE_NAME)]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE_NAME} failed: {exc}") from exc
        if done.returncode != 0 or not tmp.exists():
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE_NAME} failed (exit {done.returncode}): "
                               f"{' '.join(command)}\n{(done.stdout + done.stderr)[-4000:]}")
        os.replace(tmp, target)
    return target
