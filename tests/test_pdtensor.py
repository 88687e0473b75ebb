"""FastDeploy ``.pdtensor`` files: byte-identical to ``paddle.save``, read without unpickling.

Real ``paddle.save`` / ``paddle.load`` (Paddle CPU in .venv) are the independent
reference; hostile streams must raise RecordError without running anything.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fd_routing_replay.codec.pdtensor import (
    decode_pdtensor,
    encode_pdtensor,
    fastdeploy_fill,
    pad_tokens,
    record_from_pdtensor,
    trim_padding,
)
from fd_routing_replay.errors import RecordError

paddle = pytest.importorskip("paddle", reason="paddlepaddle (CPU) is the reference for .pdtensor")

REPO = Path(__file__).resolve().parents[1]
FD_VENV_PYTHON = REPO / ".venv-fd" / "bin" / "python"

# (dtype, low, high): uint16 ids above 256 so a bfloat16 reading of the bits cannot pass.
DTYPES = [("uint8", 0, 255), ("uint16", 257, 65535), ("uint32", 65536, 2**32 - 1),
          ("int64", -1, 2**40)]


@pytest.fixture
def np_rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_array(np_rng, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    _, low, high = next(d for d in DTYPES if d[0] == dtype)
    return np_rng.integers(low, high, size=shape, endpoint=True).astype(dtype)


def paddle_bytes(array: np.ndarray, tmp_path: Path) -> bytes:
    path = tmp_path / f"ref_{array.dtype}_{'x'.join(map(str, array.shape))}.pdtensor"
    paddle.save(array, str(path))
    return path.read_bytes()


def paddle_load_numpy(path: Path) -> np.ndarray:
    return paddle.load(str(path), return_numpy=True)


SHAPES = [(0, 8), (1, 1), (3, 2), (200, 8), (9000, 8), (4, 0, 8), (2, 300, 4), (3, 3000, 8)]


@pytest.mark.parametrize("dtype", [d[0] for d in DTYPES])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_encode_is_byte_identical_to_paddle_save(np_rng, tmp_path, dtype, shape):
    # Sizes cover the pickle's short/long byte opcodes and data inside and outside frames.
    array = random_array(np_rng, dtype, shape)
    assert encode_pdtensor(array) == paddle_bytes(array, tmp_path)


@pytest.mark.parametrize("dtype", [d[0] for d in DTYPES])
def test_paddle_load_reads_what_we_wrote(np_rng, tmp_path, dtype):
    array = random_array(np_rng, dtype, (3, 57, 8))
    path = tmp_path / "ours.pdtensor"
    path.write_bytes(encode_pdtensor(array))
    loaded = paddle_load_numpy(path)
    assert loaded.dtype == array.dtype and loaded.shape == array.shape
    np.testing.assert_array_equal(loaded, array)


def test_paddle_load_default_tensors_keep_the_bits(np_rng, tmp_path):
    """Without return_numpy Paddle makes uint16 files bfloat16 tensors (same bits) and
    cannot make uint32 tensors at all: FastDeploy's own files behave the same."""
    u8 = random_array(np_rng, "uint8", (40, 8))
    u16 = random_array(np_rng, "uint16", (40, 8))
    for array in (u8, u16):
        path = tmp_path / f"{array.dtype}.pdtensor"
        path.write_bytes(encode_pdtensor(array))
        tensor = paddle.load(str(path))
        np.testing.assert_array_equal(tensor.numpy(), array)
    assert str(paddle.load(str(tmp_path / "uint16.pdtensor")).dtype) == "paddle.bfloat16"


@pytest.mark.parametrize("dtype", [d[0] for d in DTYPES])
def test_decode_round_trip_is_exact_and_zero_copy(np_rng, tmp_path, dtype):
    array = random_array(np_rng, dtype, (2, 700, 8))
    data = paddle_bytes(array, tmp_path)
    parsed = decode_pdtensor(data)
    assert parsed.array.dtype == array.dtype and parsed.array.shape == array.shape
    np.testing.assert_array_equal(parsed.array, array)
    assert not parsed.array.flags.writeable
    assert np.shares_memory(parsed.array, np.frombuffer(data, dtype=np.uint8))
    for buffer in (bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        np.testing.assert_array_equal(decode_pdtensor(buffer).array, array)


def test_decode_never_unpickles(np_rng, tmp_path, monkeypatch):
    data = paddle_bytes(random_array(np_rng, "uint16", (5, 4)), tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reader unpickled")

    for name in ("load", "loads", "Unpickler", "_load", "_loads", "_Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden, raising=False)
    assert decode_pdtensor(data).array.shape == (5, 4)


def test_package_does_not_import_paddle(tmp_path):
    script = (
        "import sys, numpy as np\n"
        "from fd_routing_replay.codec.pdtensor import encode_pdtensor, decode_pdtensor\n"
        "from fd_routing_replay.store.local.fastdeploy import FastDeployLocalStore\n"
        "from fd_routing_replay.reader import RoutingReader\n"
        f"store = FastDeployLocalStore({str(tmp_path)!r}, 'ns')\n"
        "store.put('a:0:0', encode_pdtensor(np.zeros((2, 3, 4), np.uint8)))\n"
        "assert RoutingReader(store).get('a:0:0').ids.shape == (2, 3, 4)\n"
        "assert 'paddle' not in sys.modules, 'paddle was imported'\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO)


def test_numpy1_spelling_is_accepted(np_rng, tmp_path):
    """FastDeploy runs NumPy 1, whose pickles name numpy.core.multiarray."""
    array = random_array(np_rng, "uint8", (6, 4))
    data = paddle_bytes(array, tmp_path)
    old = b"\x8c\x16numpy._core.multiarray"
    if old not in data:
        pytest.skip("this NumPy already writes the NumPy 1 spelling")
    numpy1 = data.replace(old, b"\x8c\x15numpy.core.multiarray")
    frame = struct.unpack_from("<Q", numpy1, 3)[0]
    numpy1 = numpy1[:3] + struct.pack("<Q", frame - 1) + numpy1[11:]
    path = tmp_path / "numpy1.pdtensor"
    path.write_bytes(numpy1)
    np.testing.assert_array_equal(paddle_load_numpy(path), array)  # the crafted file is valid
    np.testing.assert_array_equal(decode_pdtensor(numpy1).array, array)


@pytest.mark.skipif(not FD_VENV_PYTHON.exists(), reason=".venv-fd (FastDeploy's NumPy 1 "
                    "environment, `make fd-env`) is not built")
def test_identical_to_paddle_save_in_fastdeploys_numpy1_environment(tmp_path):
    script = (
        "import sys, numpy as np, paddle\n"
        "from fd_routing_replay.codec.pdtensor import encode_pdtensor, decode_pdtensor\n"
        "rng = np.random.default_rng(int(sys.argv[1]))\n"
        "for dtype, high in (('uint8', 255), ('uint16', 65535), ('uint32', 2**32 - 1)):\n"
        "    for shape in ((0, 8), (300, 8), (3, 9000, 8)):\n"
        "        a = rng.integers(0, high, size=shape, endpoint=True).astype(dtype)\n"
        "        path = sys.argv[2] + '/ref.pdtensor'\n"
        "        paddle.save(a, path)\n"
        "        data = open(path, 'rb').read()\n"
        "        assert b'numpy.core.multiarray' in data, data[:40]\n"
        "        assert encode_pdtensor(a) == data, (dtype, shape)\n"
        "        assert (decode_pdtensor(data).array == a).all()\n"
        "print('ok', np.__version__)\n")
    done = subprocess.run([str(FD_VENV_PYTHON), "-W", "ignore", "-c", script, "7", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok 1."), done.stdout


# -- hostile and corrupt input ---------------------------------------------------------------

class _RunsShell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _hostile_streams(marker: Path) -> dict[str, bytes]:
    command = f"touch {marker}".encode()
    return {
        # protocol-0 GLOBAL opcode inside a protocol-4 stream
        "GLOBAL os.system": (b"\x80\x04cos\nsystem\n\x8c" + bytes([len(command)]) + command
                             + b"\x85R."),
        # what pickle writes for an object whose __reduce__ is os.system
        "STACK_GLOBAL posix.system": pickle.dumps(_RunsShell(command.decode()), protocol=4),
    }


@pytest.mark.parametrize("name", ["GLOBAL os.system", "STACK_GLOBAL posix.system"])
def test_hostile_pickle_is_refused_without_running_it(tmp_path, name):
    marker = tmp_path / "pwned"
    data = _hostile_streams(marker)[name]
    with pytest.raises(RecordError, match="system") as info:
        decode_pdtensor(data, source="evil.pdtensor")
    assert "evil.pdtensor" in str(info.value)
    assert not marker.exists()


def test_global_swapped_inside_a_real_stream_is_refused(np_rng, tmp_path):
    data = paddle_bytes(random_array(np_rng, "uint8", (4, 4)), tmp_path)
    evil = data.replace(b"\x8c\x05dtype", b"\x8c\x05range")
    assert evil != data
    with pytest.raises(RecordError, match=r"numpy\.range is not allowed"):
        decode_pdtensor(evil)


def test_every_truncation_is_a_record_error(np_rng, tmp_path):
    data = paddle_bytes(random_array(np_rng, "uint16", (3, 40, 2)), tmp_path)
    for end in range(len(data)):
        with pytest.raises(RecordError):
            decode_pdtensor(data[:end], source="cut.pdtensor")


def test_trailing_bytes_are_refused(np_rng, tmp_path):
    data = paddle_bytes(random_array(np_rng, "uint8", (3, 2)), tmp_path)
    with pytest.raises(RecordError, match="1 unexpected bytes after"):
        decode_pdtensor(data + b".")


@pytest.mark.parametrize("dtype", ["float32", "int32", "int8", "uint64", "bool", ">u2", "<f2"])
def test_wrong_dtypes_are_refused(tmp_path, dtype):
    data = paddle_bytes(np.zeros((3, 2), dtype=dtype), tmp_path) if dtype != ">u2" else \
        pickle.dumps(np.zeros((3, 2), dtype=dtype), protocol=4)
    with pytest.raises(RecordError, match="dtype"):
        decode_pdtensor(data)


@pytest.mark.parametrize("shape", [(6,), (2, 2, 2, 2), ()], ids=str)
def test_other_dimensionalities_are_refused(tmp_path, shape):
    with pytest.raises(RecordError, match="shape"):
        decode_pdtensor(pickle.dumps(np.zeros(shape, np.uint8), protocol=4))


def test_dimensionality_is_checked_against_what_the_caller_expects(tmp_path):
    data = encode_pdtensor(np.zeros((2, 3, 4), np.uint8))
    with pytest.raises(RecordError, match="3 dimensions; expected 2"):
        decode_pdtensor(data, ndim=(2,))


def test_shape_and_byte_count_mismatch_is_refused(tmp_path):
    data = bytearray(encode_pdtensor(np.zeros((5, 4), np.uint8)))
    ints = [pos for op, arg, pos in pickletools.genops(bytes(data))
            if op.name == "BININT1" and arg == 5]
    data[ints[0] + 1] = 6  # shape (6, 4): 24 bytes, the data holds 20
    with pytest.raises(RecordError, match="data holds 20 bytes, but shape \\[6, 4\\] of uint8 "
                                          "needs 24"):
        decode_pdtensor(bytes(data))


def test_fortran_order_and_other_protocols_are_refused():
    fortran = pickle.dumps(np.asfortranarray(np.zeros((3, 2), np.uint8)), protocol=4)
    with pytest.raises(RecordError, match="C order"):
        decode_pdtensor(fortran)
    for protocol in (2, 3, 5):
        with pytest.raises(RecordError):
            decode_pdtensor(pickle.dumps(np.zeros((3, 2), np.uint8), protocol=protocol))


def test_a_stream_of_many_opcodes_is_cut_short():
    stream = b"\x80\x04" + b"\x8c\x01a\x94" * 10_000 + b"."
    with pytest.raises(RecordError):
        decode_pdtensor(stream)


@pytest.mark.parametrize("value", [b"", b"\x89R3R", b"not a pickle", b"\x80\x04"])
def test_junk_is_a_record_error(value):
    with pytest.raises(RecordError, match="not a FastDeploy routing .pdtensor"):
        decode_pdtensor(value)


def test_what_is_no_contiguous_byte_buffer_is_refused_naming_the_source(np_rng):
    for value, problem in ((None, "expected a bytes-like buffer, got NoneType"),
                           ("text", "expected a bytes-like buffer, got str"),
                           (np.zeros((4, 4), np.uint8)[:, ::2], "buffer is not contiguous")):
        with pytest.raises(RecordError, match=f"^fused.pdtensor: {problem}"):
            decode_pdtensor(value, source="fused.pdtensor")
    data = encode_pdtensor(np_rng.integers(0, 255, (2, 5, 4), dtype=np.uint8))
    two_d = np.frombuffer(data, np.uint8).reshape(1, -1)   # any contiguous buffer is read as bytes
    assert decode_pdtensor(two_d).array.shape == (2, 5, 4)


def test_encode_refuses_what_fastdeploy_never_writes():
    for bad in (np.zeros((2,), np.uint8), np.zeros((2, 2), np.float32),
                np.zeros((2, 2), ">u2"), [[1, 2]]):
        with pytest.raises(RecordError):
            encode_pdtensor(bad)  # type: ignore[arg-type]


# -- padding and records -----------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [0, 1, 37, 64])
def test_pad_tokens_is_fastdeploys_padding(np_rng, tokens):
    ids = random_array(np_rng, "uint16", (3, tokens, 4))
    padded = pad_tokens(ids, 64)
    # FastDeploy: np.concatenate with np.full(-1) cast to the dtype (NumPy 1 semantics).
    expected = np.concatenate([ids, np.full((3, 64 - tokens, 4), 65535, np.uint16)], axis=1)
    assert padded.dtype == np.uint16
    np.testing.assert_array_equal(padded, expected)
    np.testing.assert_array_equal(trim_padding(padded), ids[:, :tokens] if tokens else ids[:, :0])


def test_pad_tokens_maps_another_fill_and_refuses_overlong():
    ids = np.array([[[3, 200]]], np.uint8)
    np.testing.assert_array_equal(pad_tokens(ids, 2, fill_value=200), [[[3, 255], [255, 255]]])
    with pytest.raises(RecordError, match="do not fit max_model_len 0"):
        pad_tokens(ids, 0)


def test_trim_keeps_inner_unrouted_tokens_and_uses_every_layer():
    ids = np.full((2, 6, 2), 255, np.uint8)
    ids[0, 0] = [1, 2]
    ids[1, 3] = [4, 255]  # last routed token: 3, routed in layer 1 only
    assert trim_padding(ids).shape == (2, 4, 2)
    assert fastdeploy_fill(np.dtype("int64")) == -1


@pytest.mark.parametrize("tokens", [0, 5, 16])
def test_record_from_pdtensor_trims_and_describes(np_rng, tokens):
    ids = random_array(np_rng, "uint8", (2, tokens, 4))
    ids[ids == 255] = 254
    data = encode_pdtensor(pad_tokens(ids, 16))
    record, header = record_from_pdtensor(data, "exp:0:0")
    assert record.rollout_id == "exp:0:0" and record.fill_value == 255
    np.testing.assert_array_equal(record.ids, ids)
    assert record.ids.flags.c_contiguous and not record.ids.flags.writeable
    assert record.metadata == {"format": "fastdeploy-raw", "num_tokens": tokens,
                               "max_model_len": 16}
    assert header["format"] == "fastdeploy-raw" and header["layout"] == "fused"
    assert header["stored_shape"] == [2, 16, 4] and header["shape"] == [2, tokens, 4]
    layer, _ = record_from_pdtensor(encode_pdtensor(pad_tokens(ids[1], 16)), "exp:0:0", layer=1)
    np.testing.assert_array_equal(layer.ids, ids[1:2])
    assert layer.metadata["layer"] == 1


def test_int64_debug_files_are_read_with_fill_minus_one():
    ids = np.array([[5, 9], [-1, -1]], np.int64)
    record, _ = record_from_pdtensor(encode_pdtensor(ids), "dbg:0:0", layer=0)
    assert record.fill_value == -1 and record.ids.tolist() == [[[5, 9]]]
    with pytest.raises(RecordError, match="-7"):
        record_from_pdtensor(encode_pdtensor(np.array([[-7, 1]], np.int64)), "dbg:0:0", layer=0)
