"""The ops' dtypes and the step buffer, and which library this process uses.

Shared helpers for the ops tests live here too (``as_tensor``, ``host``, ``random_table``).
The seed of each test is printed on failure (tests/conftest.py); rerun with
FD_ROUTING_REPLAY_TEST_SEED=<seed> to reproduce.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_routing_replay import ops
from fd_routing_replay.errors import OpsError
from fd_routing_replay.ops.dtypes import NP_ROUTING

# num_experts per routing dtype: ids above 256 for uint16 and above 65535 for uint32, so a
# bfloat16 mix-up or a narrowing bug cannot hide.
EXPERTS = {np.uint8: 200, np.uint16: 40000, np.uint32: 70000}
DTYPES = list(EXPERTS)


def as_tensor(array: np.ndarray) -> paddle.Tensor:
    """A CPU tensor with exactly the numpy dtype, owned by Paddle.

    ``paddle.to_tensor`` turns uint16 into bfloat16 and rejects uint32, so those go
    through int64 and a cast to the real Paddle dtype.
    """
    array = np.asarray(array)
    if array.dtype in (np.uint16, np.uint32):
        return paddle.to_tensor(array.astype(np.int64)).cast(NP_ROUTING[array.dtype])
    return paddle.to_tensor(np.ascontiguousarray(array))


def host(t: paddle.Tensor) -> np.ndarray:
    return np.from_dlpack(t)


def random_table(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random prior content incl. fill values, so untouched cells are checked too."""
    hi = EXPERTS[dtype]
    table = rng.integers(0, hi, size=shape).astype(dtype)
    table[rng.random(shape) < 0.3] = np.iinfo(dtype).max
    return table


def test_the_compiled_library_is_in_use() -> None:
    assert ops.ops_backend() == "compiled", ops.ops_backend_reason()
    assert "fdrr_routing_ops" in ops.ops_backend_reason()


@pytest.mark.parametrize(("num_experts", "dtype"), [
    (1, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16),
    (65536, np.uint32), (2**32 - 1, np.uint32),
])
def test_routing_dtype_boundaries(num_experts: int, dtype) -> None:
    assert ops.routing_dtype(num_experts) == np.dtype(dtype)
    assert ops.fill_value(ops.routing_dtype(num_experts)) >= num_experts  # ids + fill fit


@pytest.mark.parametrize("bad", [0, -3, 2**32, True, 2.0, "8"])
def test_routing_dtype_rejects(bad) -> None:
    with pytest.raises(OpsError, match="num_experts"):
        ops.routing_dtype(bad)


def test_fill_value() -> None:
    assert ops.fill_value(np.uint8) == 255
    assert ops.fill_value("uint16") == 65535  # a numpy name: unambiguous here
    assert ops.fill_value(paddle.uint16) == 65535  # the real Paddle enum
    assert ops.fill_value(np.dtype(np.uint32)) == 2**32 - 1
    for bad in (np.int8, "float32", paddle.bfloat16, paddle.int64, object()):
        with pytest.raises(OpsError, match="dtype"):
            ops.fill_value(bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_step_buffer_is_real_dtype_and_filled(dtype) -> None:
    buffer = ops.new_step_buffer(5, 3, 4, EXPERTS[dtype], place="cpu")
    assert list(buffer.shape) == [5, 3, 4]
    assert buffer.dtype == NP_ROUTING[np.dtype(dtype)] and buffer.dtype != paddle.bfloat16
    view = host(buffer)
    assert view.dtype == dtype and view.shape == (5, 3, 4)
    assert (view == np.iinfo(dtype).max).all()


@pytest.mark.parametrize(("args", "needle"), [
    ((0, 5, 4, 10), "max_tokens"), ((3, -1, 4, 10), "num_layers"), ((3, 5, 2.0, 10), "top_k"),
    ((3, 5, True, 10), "top_k"), ((3, 5, 4, 0), "num_experts"),
])
def test_new_step_buffer_rejects(args, needle) -> None:
    with pytest.raises(OpsError, match=needle):
        ops.new_step_buffer(*args)
