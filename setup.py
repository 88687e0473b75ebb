"""Build hook only (metadata lives in setup.cfg): ship the custom-op sources in the wheel.

The sources live in custom_ops/ at the top of the checkout (DESIGN.md's layout); a wheel
copies them into fd_routing_replay/_csrc/ so an installed package can build the ops just
in time (fd_routing_replay/core/native.py looks there when custom_ops/ is absent, for the
Paddle custom-op library and the Paddle-free C library alike).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

OP_SOURCES = ("step_ops.cc", "step_ledger.cc", "step_ops.cu", "bound_args.h", "routing_kernels.h",
              "routing_kernels.cuh", "set_codec.cc", "set_codec_tables.h", "xxh3.cc", "unrouted.cc")


class BuildPyWithOpSources(build_py):
    def run(self) -> None:
        # setuptools builds in ./build and keeps what an earlier build left in build/lib: a
        # module since deleted or moved would ship again (`pip install .`, `pip wheel .`).
        # Start each build from an empty package directory (never the sources themselves).
        built = Path(self.build_lib) / "fd_routing_replay"
        if built.resolve() != Path("fd_routing_replay").resolve():
            shutil.rmtree(built, ignore_errors=True)
        super().run()
        target = Path(self.build_lib) / "fd_routing_replay" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in OP_SOURCES:
            self.copy_file(str(Path("custom_ops") / name), str(target / name))


setup(cmdclass={"build_py": BuildPyWithOpSources})
