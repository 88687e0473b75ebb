"""Import Paddle once, quietly, pinned to the CPU: the harness is a CPU program.

Paddle's import prints a ccache warning from its extension utilities; it says nothing
about this package, so it is filtered here rather than shown on every ``python -m fdrr_dev demo``.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*ccache.*")
    import paddle

paddle.set_device("cpu")

__all__ = ["paddle"]
