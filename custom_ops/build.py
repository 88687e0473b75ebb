#!/usr/bin/env python
"""Build fd-routing-replay's compiled code ahead of time (the Makefile's `ops` target).

Builds both libraries of fd_routing_replay/core/native.py into fd_routing_replay/_ops/:
the routing ops with paddle.utils.cpp_extension (package-private module name
`fdrr_routing_ops`; CUDA kernels too when Paddle is a CUDA build and nvcc is on PATH), and
the Paddle-free C library (set codec, XXH3-64 checksum) with the C++ compiler
(`fdrr_native.so`); checks that a fresh interpreter loads both (the "compiled" ops
backend, the "native" set codec and checksum), and writes the stamp
fd_routing_replay/_ops/.built.  Idempotent: up-to-date builds (same sources, flags,
Paddle) are kept, so re-running costs ~3 s.

    .venv/bin/python custom_ops/build.py [--force] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_CHECK = """
import warnings
warnings.simplefilter("error", RuntimeWarning)  # a reference fallback fails the check
import fd_routing_replay.ops as ops
from fd_routing_replay.codec import checksum, setcodec
assert ops.ops_backend() == "compiled", ops.ops_backend_reason()
assert setcodec.set_codec_backend() == "native", setcodec.set_codec_reason()
assert checksum.checksum_backend().startswith("native"), checksum.checksum_backend()
print(ops.ops_backend_reason())
print(setcodec.set_codec_reason(), checksum.checksum_backend())
"""


def main(argv: list[str] | None = None) -> int:
    """Build, verify in a child interpreter, stamp; return the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--verbose", action="store_true", help="show the compiler output")
    args = parser.parse_args(argv)

    from fd_routing_replay.core import native
    from fd_routing_replay.errors import OpsError

    started = time.monotonic()
    stamp = native.aot_dir() / native.STAMP_NAME
    stamp.unlink(missing_ok=True)
    try:
        library, c_library = [native.build(lib, native.aot_dir(), force=args.force, verbose=args.verbose)
                              for lib in native.LIBRARIES]
    except (RuntimeError, OpsError) as exc:
        print(f"custom_ops/build.py: {exc}", file=sys.stderr)
        return 1
    env = dict(os.environ, FD_RR_OPS="compiled", FD_RR_OPS_JIT="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    check = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"custom_ops/build.py: built {library} and {c_library} but they do not load:\n"
              f"{check.stderr[-4000:]}",
              file=sys.stderr)
        return 1
    stamp.write_text(f"{library}\n")
    print(f"routing ops ready: {library}; set codec and checksum ready: {c_library} "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
