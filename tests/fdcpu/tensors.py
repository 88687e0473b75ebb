"""Reading and writing Paddle CPU tensors from the NumPy stand-ins.

The CUDA kernels update their inputs in place (``SetInplaceMap``), often through views
(``share_inputs["seq_lens_this_time"]`` is a slice of ``seq_lens_this_time_buffer``,
gpu_model_runner.py:1073), so a stand-in reads a tensor into NumPy, computes, and writes
the result back with ``Tensor.copy_``, which writes through a view into its base.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["read", "write", "require_none"]


def read(tensor: Any) -> np.ndarray:
    """A NumPy copy of ``tensor`` (a Paddle tensor, or anything ``np.asarray`` takes)."""
    if hasattr(tensor, "numpy"):
        return np.array(tensor.numpy())
    return np.asarray(tensor)


def write(tensor: Any, values: np.ndarray) -> None:
    """Write ``values`` into ``tensor`` in place (same shape and dtype; through views)."""
    import paddle

    array = np.ascontiguousarray(np.asarray(values).reshape(tensor.shape))
    source = paddle.to_tensor(array).astype(tensor.dtype)
    tensor.copy_(source, False)


def require_none(op: str, **optional: Any) -> None:
    """The stand-ins cover FastDeploy's non-speculative, unquantized paths: refuse, by name,
    an optional input only another path passes."""
    given = [name for name, value in optional.items() if value is not None]
    if given:
        raise NotImplementedError(f"{op}: the CPU stand-in covers the path without {', '.join(given)} "
                                  "(speculative decoding / quantization are not stood in)")
