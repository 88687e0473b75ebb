"""Sliced reads trust nothing they read (issue #21): corrupt headers raise RecordError with
bounded memory, a record's length must be exactly its header's, and a record replaced
between the header read and the range read gives one version's slice, never a mix.

Every case runs on the local store, on Redis (small and default chunks, single node and
cluster) and on a store
that offers only the older ``read_ranges`` capability; results are compared with numpy
slicing of the full record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.header import PREFIX, PREFIX_BYTES, align, frame_header
from fd_routing_replay.codec.rr_v1 import encode_record_parts, read_header
from fd_routing_replay.errors import RecordError
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fd_routing_replay.store.instrumented import InstrumentedStore

LAYERS = (2, 3, 5, 8, 9, 11)
EXPERTS = 64
BACKENDS = ["local", "redis", "redis_big_chunks", "redis_cluster", "ranges_only"]


class RangesOnly(InstrumentedStore):
    """A store with ``read_ranges`` but not ``open_ranges`` (a third-party store)."""

    def __getattr__(self, name):
        if name == "open_ranges":
            raise AttributeError(name)
        return super().__getattr__(name)


class ReplaceOnRead(InstrumentedStore):
    """Puts the next of ``versions`` under ``key`` right after a read of it returns: after
    the first read only (``every=False``) or after every read.  ``ranges_only``: offer
    ``read_ranges`` only, like :class:`RangesOnly`."""

    def __init__(self, inner, key, versions, *, every=False, ranges_only=False):
        super().__init__(inner)
        self.key, self.versions, self.every, self.replaced = key, list(versions), every, 0
        self.ranges_only = ranges_only

    def _after_read(self):
        if self.versions and (self.every or not self.replaced):
            value = self.versions.pop(0)
            self.inner.put(self.key, value)
            self.replaced += 1
            if self.every:
                self.versions.append(value)

    def __getattr__(self, name):
        if name == "open_ranges":
            if self.ranges_only:
                raise AttributeError(name)
            return self._open
        if name == "read_ranges":
            return self._read_ranges
        return super().__getattr__(name)

    def _read_ranges(self, key, ranges):
        parts = self.inner.read_ranges(key, ranges)
        self._after_read()
        return parts

    def _open(self, key):
        view = self.inner.open_ranges(key)
        if view is None:
            return None
        outer = self
        real_read = view.read

        def read(ranges):
            parts = real_read(ranges)
            outer._after_read()
            return parts

        view.read = read
        return view


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    kind = request.param
    if kind.startswith("redis"):
        if kind == "redis_cluster":
            server = request.getfixturevalue("redis_cluster")
            server.flushall()
        else:
            server = request.getfixturevalue("redis_server")
        options = {} if kind == "redis_big_chunks" else {"redis": {"chunk_bytes": 1000}}
        spec = {"url": server.url, "namespace": "integrity", **options}
    else:
        spec = {"url": f"local://{tmp_path}", "namespace": "integrity"}
    opened = open_store(spec)
    if kind == "ranges_only":
        opened = RangesOnly(opened.inner)
    assert (getattr(opened, "open_ranges", None) is None) == (kind == "ranges_only")
    opened.spec = spec                                 # what a subprocess opens
    yield opened
    opened.close()


def _record(gen, rollout_id, tokens, *, version=1, top_k=4):
    ids = gen.integers(0, EXPERTS, size=(len(LAYERS), tokens, top_k)).astype(np.uint16)
    return RoutingRecord(rollout_id, ids, EXPERTS, layers=LAYERS, metadata={"v": version})


def _want(record, layers, tokens):
    rows = [LAYERS.index(layer) for layer in sorted(layers)] if layers else slice(None)
    return record.ids[rows][:, tokens if tokens is not None else slice(None)]


def _wanted_slices(gen, tokens):
    out = [(None, None), ([LAYERS[0]], slice(0, 3)), ([LAYERS[-1]], slice(tokens - 2, None))]
    for _ in range(6):
        layers = sorted(gen.choice(LAYERS, size=int(gen.integers(1, len(LAYERS) + 1)),
                                   replace=False).tolist())
        start = int(gen.integers(0, tokens))
        out.append((layers, slice(start, int(gen.integers(start, tokens + 1)))))
    return out


# ----------------------------------------------------------------- item 3: record length


def test_intact_records_slice_like_numpy(store, seed):
    gen = np.random.default_rng(seed)
    record = _record(gen, "si_1:0:0", 300)
    store.put("si_1:0:0", encode_record(record))
    reader = RoutingReader(store)
    for layers, tokens in _wanted_slices(gen, 300):
        got = reader.get_slice("si_1:0:0", layers=layers, tokens=tokens)
        np.testing.assert_array_equal(got.ids, _want(record, layers, tokens))
        assert got.metadata["v"] == 1


@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_truncated_records_raise_even_where_the_slice_is_intact(store, seed, cut):
    record = _record(np.random.default_rng(seed), "si_2:0:0", 300)
    store.put("si_2:0:0", encode_record(record)[:-cut])
    reader = RoutingReader(store)
    for layers, tokens in (([LAYERS[0]], slice(0, 5)), (None, None)):  # first bytes; all
        with pytest.raises(RecordError, match="si_2:0:0.*truncated|truncated.*si_2:0:0"):
            reader.get_slice("si_2:0:0", layers=layers, tokens=tokens)


@pytest.mark.parametrize("extra", [b"\0", b"\0" * 64, bytes(range(200))])
def test_records_with_trailing_bytes_raise(store, seed, extra):
    record = _record(np.random.default_rng(seed), "si_3:0:0", 300)
    store.put("si_3:0:0", encode_record(record) + extra)
    with pytest.raises(RecordError, match="unexpected bytes after the payload"):
        RoutingReader(store).get_slice("si_3:0:0", layers=[LAYERS[1]], tokens=slice(10, 20))


# ------------------------------------------------------- item 2: corrupt headers, memory


def _huge_shape_record(rollout_id):
    """A record whose (checksummed, self-consistent) header declares [1, 2**32 - 1, 8] of
    uint16, 64 GiB, in front of a few bytes of payload."""
    small = RoutingRecord(rollout_id, np.zeros((1, 0, 8), np.uint16), EXPERTS)
    head, _ = encode_record_parts(small)
    header = read_header(head, require_payload=False)
    fields = msgpack.unpackb(head[PREFIX_BYTES:PREFIX_BYTES + header.header_length], raw=False)
    fields["sh"], fields["pl"] = [1, 2**32 - 1, 8], (2**32 - 1) * 16
    framed = frame_header(msgpack.packb(fields, use_bin_type=True))
    assert read_header(framed, require_payload=False).shape == (1, 2**32 - 1, 8)
    return framed + bytes(align(len(framed)) - len(framed)) + bytes(256)


def _flipped_header_length(value, bit):
    buffer = bytearray(value)
    magic, version, length = PREFIX.unpack_from(buffer)
    PREFIX.pack_into(buffer, 0, magic, version, length ^ (1 << bit))
    return bytes(buffer)


_UNDER_A_CAP = textwrap.dedent("""
    import json, os, resource, sys
    from fd_routing_replay.reader import RoutingReader
    from fd_routing_replay.store import open_store
    spec, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    store = open_store(spec)
    reader = RoutingReader(store)
    reader.get_slice(keys[0], layers=None)                   # warm up: an intact record
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (384 << 20), resource.RLIM_INFINITY))
    out = {}
    for key in keys[1:]:
        try:
            reader.get_slice(key)
            out[key] = "served"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[key] = type(exc).__name__ + ": " + str(exc)[:200]
    print(json.dumps(out))
""")


def test_corrupt_headers_raise_record_error_within_a_memory_cap(store, seed):
    if isinstance(store, RangesOnly):
        pytest.skip("a spec for a subprocess: the local store and Redis")
    gen = np.random.default_rng(seed)
    good = encode_record(_record(gen, "cap_0:0:0", 50))
    planted = {"cap_0:0:0": good, "cap_1:0:0": _huge_shape_record("cap_1:0:0")}
    for number, bit in enumerate((31, 30, 27, 20, 16), start=2):  # 2 GiB ... 64 KiB
        key = f"cap_{number}:0:0"
        planted[key] = _flipped_header_length(encode_record(_record(gen, key, 50)), bit)
    for key, value in planted.items():
        store.put(key, value)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _UNDER_A_CAP, json.dumps(store.spec),
                           json.dumps(list(planted))], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == set(planted) - {"cap_0:0:0"}
    for key, outcome in results.items():
        assert outcome.startswith("RecordError: "), (key, outcome)
        assert key in outcome


# ------------------------------------------- item 4: replaced between header and ranges


@pytest.mark.parametrize("old_tokens, new_tokens", [(300, 400), (400, 300), (300, 300)])
def test_a_record_replaced_mid_read_gives_one_version(store, seed, old_tokens, new_tokens):
    gen = np.random.default_rng(seed)
    old = _record(gen, "mid_1:0:0", old_tokens, version=1)
    new = _record(gen, "mid_1:0:0", new_tokens, version=2)
    for layers, tokens in _wanted_slices(gen, min(old_tokens, new_tokens)):
        store.inner.put("mid_1:0:0", encode_record(old))
        racing = ReplaceOnRead(store.inner, "mid_1:0:0", [encode_record(new)],
                               ranges_only=isinstance(store, RangesOnly))
        got = RoutingReader(racing).get_slice("mid_1:0:0", layers=layers, tokens=tokens)
        assert racing.replaced == 1                  # the put did land mid-read
        version = {1: old, 2: new}[got.metadata["v"]]
        np.testing.assert_array_equal(got.ids, _want(version, layers, tokens))
        assert got.num_experts == EXPERTS and got.layers == tuple(
            sorted(layers) if layers else LAYERS)


def test_a_record_replaced_on_every_read_is_refused_by_name(store, seed):
    gen = np.random.default_rng(seed)
    versions = [encode_record(_record(gen, "mid_2:0:0", tokens, version=number))
                for number, tokens in ((1, 300), (2, 400), (3, 350))]
    store.inner.put("mid_2:0:0", versions[0])
    racing = ReplaceOnRead(store.inner, "mid_2:0:0", versions[1:], every=True,
                           ranges_only=isinstance(store, RangesOnly))
    reader = RoutingReader(racing)
    if store.inner.scheme == "local" and not isinstance(store, RangesOnly):
        got = reader.get_slice("mid_2:0:0", layers=[3], tokens=slice(7, 99))  # one open file
        assert got.metadata["v"] == 1
        return
    with pytest.raises(RecordError, match="'mid_2:0:0' changed while being read"):
        reader.get_slice("mid_2:0:0", layers=[3], tokens=slice(7, 99))


def test_open_ranges_sees_one_version(store, seed):
    if isinstance(store, RangesOnly):
        pytest.skip("open_ranges is the capability under test")
    gen = np.random.default_rng(seed)
    old, new = gen.bytes(3500), gen.bytes(2500)
    store.put("ov_1:0:0", old)
    assert store.open_ranges("ov_9:0:0") is None
    with store.open_ranges("ov_1:0:0") as view:
        assert view.size == 3500
        assert view.read([(0, 10), (3490, 100), (4000, 5)]) == [old[:10], old[3490:], b""]
        store.put("ov_1:0:0", new)
        parts = view.read([(1000, 1500)])
        if view.unchanged():                         # local: the open file is the old one
            assert parts == [old[1000:2500]]
        else:                                        # Redis: the WATCH saw the put
            assert store.inner.scheme == "redis"
    with store.open_ranges("ov_1:0:0") as view:
        assert view.size == 2500 and view.read([(0, 2500)]) == [new] and view.unchanged()


def test_a_damaged_redis_chunk_is_never_served(store, seed):
    if store.inner.scheme != "redis" or store.inner.chunk_bytes != 1000:
        pytest.skip("the chunks of a Redis record")
    record = _record(np.random.default_rng(seed), "dc_1:0:0", 300)
    value = encode_record(record)
    for damaged in (value[1000:1990], value[1000:2000] + b"!", None):  # short, long, gone
        store.put("dc_1:0:0", value)
        pkey = store.inner.pkey("dc_1:0:0")
        if damaged is None:
            store.inner.client.hdel(pkey, "1")
        else:
            store.inner.client.hset(pkey, "1", damaged)
        with pytest.raises(RecordError, match="dc_1:0:0"):
            RoutingReader(store).get_slice("dc_1:0:0", layers=[LAYERS[0]])   # in chunk 1
