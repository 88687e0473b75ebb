"""The host side of capture: the slot cache, where each step's rows land, and the geometry.

Why by KV slot and not by request: a position's routing is a property of the KV entry the
forward pass produced for it.  When a later request hits that block in the prefix cache, or
a preempted request is recomputed into other blocks, or a chunk of a long prompt is
prefilled in an earlier step, the slot cache already holds (or receives) exactly the routing
that goes with that KV -- the record is gathered from the request's slots at finish
(:mod:`fd_routing_replay.capture.handoff`), whatever path each position took.

* :class:`HostSlotCache`: ``[num_slots, num_layers, top_k]`` plain NumPy (a pinned buffer is
  what a GPU engine copies into anyway);
* :class:`SharedSlotCache`: the same in POSIX shared memory, shared by FastDeploy 2.6's
  engine (which creates and owns it) and its workers (which attach by name and publish
  their capture counters after the slots, since they run no writer);
* :class:`CaptureGeometry`: the sizes a capture allocates for, read once from FastDeploy's
  ``FDConfig`` and the KV cache;
* a request's KV slots through its block-table row (:func:`request_slots`);
* :class:`StepLedger`: the table API's per-step bookkeeping, compiled
  (custom_ops/step_ledger.cc) and bound once: each FastDeploy 2.5 runner method that moves a
  step along is one call that reads the step's integer inputs in place (:class:`HostInts`)
  and writes into scratch it owns -- ``plan`` lays out the step's tracked tokens (slot,
  position, step-buffer row, KV slot: a :class:`PlannedStep`), ``commit`` copies the step's
  rows into the slot cache (with speculative decoding only accepted tokens), ``finished``
  lists the slots that finished and their lengths.  No loop over sequences and no allocation
  in Python; the tests' NumPy oracle is ``tests/capture/step_oracle.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.codec import routing_dtype
from fd_routing_replay.errors import ConfigError, OpsError

__all__ = ["CaptureGeometry", "HostInts", "HostSlotCache", "PlannedStep", "STAT_FIELDS", "SharedSlotCache",
           "StepLedger", "as_numpy", "checked_layer_columns", "host_block_table", "request_slots",
           "shared_slots_name"]


@dataclass(frozen=True)
class CaptureGeometry:
    """Sizes the manager allocates for (FastDeploy reads them from its FDConfig)."""

    max_num_seqs: int
    max_model_len: int
    num_moe_layers: int
    top_k: int
    num_experts: int
    block_size: int
    total_block_num: int
    num_shared_experts: int = 0
    num_speculative_tokens: int = 0
    layer_map: tuple[int, ...] = ()     # global decoder-layer index of each row; () = 0..L-1
    max_num_batched_tokens: int = 0     # step buffer rows; 0 = derived (see step_tokens)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "num_moe_layers", "top_k", "num_experts",
                     "block_size", "total_block_num"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise OpsError(f"capture geometry: {name} must be a positive int, got {value!r}")
        if self.layer_map and len(self.layer_map) != self.num_moe_layers:
            raise OpsError(f"capture geometry: layer_map has {len(self.layer_map)} layers but "
                           f"num_moe_layers is {self.num_moe_layers}")

    @property
    def layers(self) -> tuple[int, ...]:
        """The layer map, defaulting to ``0 .. num_moe_layers - 1``."""
        return tuple(self.layer_map) or tuple(range(self.num_moe_layers))

    @property
    def step_tokens(self) -> int:
        """Rows of the step buffer: FastDeploy's ``max_num_batched_tokens`` when given,
        else the most a step can forward without it (one full prompt, or every sequence
        decoding with all its draft tokens)."""
        if self.max_num_batched_tokens > 0:
            return int(self.max_num_batched_tokens)
        return max(self.max_model_len, self.max_num_seqs * (1 + self.num_speculative_tokens))

    @property
    def dtype(self) -> np.dtype:
        """Narrowest dtype for the ids, as FastDeploy sizes it (routed + shared + fill)."""
        return routing_dtype(self.num_experts + self.num_shared_experts)


class HostSlotCache:
    """``[num_slots, num_layers, top_k]`` routing ids, ``fill_value`` where unknown.

    ``layer_columns``: when the array is laid out for someone else too (FastDeploy 2.6's
    view counts leading dense layers as rows), the array's row of each of our layers;
    :meth:`write` and :meth:`read` then take and return our ``L`` layers only, and the
    other rows stay at the fill value.  None: the array's rows are our layers.
    """

    def __init__(self, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 fill_value: int, *, layer_columns: Sequence[int] | None = None) -> None:
        if num_slots <= 0 or num_layers <= 0 or top_k <= 0:
            raise OpsError(
                f"host slot cache needs positive sizes, got num_slots={num_slots}, "
                f"num_layers={num_layers}, top_k={top_k}")
        self.dtype = np.dtype(dtype)
        self.fill_value = int(fill_value)
        self.layer_columns = checked_layer_columns(layer_columns, num_layers)
        self.array = np.full((num_slots, num_layers, top_k), self.fill_value, dtype=self.dtype)

    @property
    def num_slots(self) -> int:
        return int(self.array.shape[0])

    @property
    def num_layers(self) -> int:
        """Our layers (the rows :meth:`write` takes)."""
        columns = self.layer_columns
        return int(self.array.shape[1]) if columns is None else len(columns)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Scatter ``rows[i]`` (``[N, L, K]``) into ``slots[i]`` in one vectorized store."""
        expected = (self.num_layers, self.array.shape[2])
        if rows.shape[1:] != expected:
            raise OpsError(
                f"rows of shape {rows.shape} do not fit the host cache rows {expected} (num_layers, top_k)")
        if self.layer_columns is None:
            self.array[slots] = rows
        else:
            self.array[np.asarray(slots)[:, None], self.layer_columns[None, :]] = rows

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Gather ``[T, L, K]`` rows for ``slots`` (a copy)."""
        rows = self.array[slots]
        return rows if self.layer_columns is None else rows[:, self.layer_columns]

    def invalidate(self, slots: np.ndarray) -> None:
        """Forget the routing held for ``slots``."""
        self.array[slots] = self.fill_value

    def clear(self) -> None:
        """Forget everything (e.g. after an RL weight update the cached rows are stale)."""
        self.array.fill(self.fill_value)


def checked_layer_columns(layer_columns: Sequence[int] | None,
                          num_rows: int) -> np.ndarray | None:
    """``layer_columns`` as an index array after checking they are distinct rows in
    ``[0, num_rows)``; None when absent or the identity (no reordering needed)."""
    if layer_columns is None:
        return None
    columns = np.asarray(layer_columns, dtype=np.int64)
    if (columns.ndim != 1 or not len(columns) or columns.min() < 0 or columns.max() >= num_rows
            or len(np.unique(columns)) != len(columns)):
        raise OpsError(f"host slot cache layer_columns must be distinct rows in [0, {num_rows}), "
                       f"got {list(layer_columns)}")
    if np.array_equal(columns, np.arange(num_rows)):
        return None
    return columns


logger = logging.getLogger(__name__)


_PREFIX = "fdrr_routing_slots."


#: The worker-side capture counters a worker publishes (StepRoutingCapturer.stats() keys).
STAT_FIELDS = ("steps", "tokens_offloaded", "invalid_slots", "damaged_steps", "host_missing_steps",
               "errors", "offload_seconds", "hook_calls", "hook_seconds", "hook_errors",
               "hook_mismatches", "bad_expert_ids", "missing_layer_steps")


_CREATED_HERE: set[str] = set()     # segments this process owns (tracked by its resource tracker)


def shared_slots_name(suffix: str | int) -> str:
    """The shared-memory name of the slot cache of one engine instance."""
    text = str(suffix)
    if not text or not all(c.isalnum() or c in "-_." for c in text) or len(text) > 64:
        raise ConfigError(f"shared slot cache suffix must be 1-64 characters of [A-Za-z0-9._-], got {text!r}")
    return _PREFIX + text


class SharedSlotCache(HostSlotCache):
    """A :class:`HostSlotCache` whose array lives in a named shared-memory segment,
    followed by ``stat_ranks`` rows of :data:`STAT_FIELDS` counters."""

    def __init__(self, name: str, num_slots: int, num_layers: int, top_k: int, dtype: np.dtype,
                 fill_value: int, *, create: bool, stat_ranks: int = 1,
                 layer_columns: Sequence[int] | None = None) -> None:
        self.name = name
        self.layer_columns = checked_layer_columns(layer_columns, int(num_layers))
        self.dtype = np.dtype(dtype)
        self.fill_value = int(fill_value)
        shape = (int(num_slots), int(num_layers), int(top_k))
        if min(shape) <= 0 or stat_ranks <= 0:
            raise ConfigError(f"shared slot cache {name}: sizes must be positive, got {shape} "
                              f"and {stat_ranks} ranks")
        slots_size = int(np.prod(shape)) * self.dtype.itemsize
        stats_offset = -(-slots_size // 8) * 8
        # column 0: 1 once the rank has published
        stats_shape = (int(stat_ranks), 1 + len(STAT_FIELDS))
        size = stats_offset + int(np.prod(stats_shape)) * 8
        self._owner = create
        if create:
            self._shm = self._create(name, size)
            _CREATED_HERE.add(name)
        else:
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            # Python < 3.13 registers attached segments with the resource tracker, which
            # would unlink the engine's segment when this worker exits.
            if name not in _CREATED_HERE:
                try:
                    resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
                except Exception:  # pragma: no cover - tracker internals differ by version
                    pass
            if self._shm.size < size:
                actual = self._shm.size
                self._shm.close()
                raise ConfigError(
                    f"shared slot cache {name} holds {actual} bytes but {shape} {self.dtype} needs {size}; "
                    "the engine and the worker disagree on the capture geometry")
        self.array = np.ndarray(shape, dtype=self.dtype, buffer=self._shm.buf)
        self._stats = np.ndarray(stats_shape, dtype=np.float64, buffer=self._shm.buf,
                                 offset=stats_offset)
        if create:
            self.array[...] = self.fill_value
            self._stats[...] = 0

    def publish(self, rank: int, stats: Mapping[str, Any]) -> None:
        """Store a worker's counters (the :data:`STAT_FIELDS` of its ``stats()``) in its row."""
        if not 0 <= rank < self._stats.shape[0]:
            raise ValueError(f"shared slot cache {self.name}: rank {rank} outside 0..{self._stats.shape[0] - 1}")
        row = np.fromiter((float(stats.get(key, 0) or 0) for key in STAT_FIELDS), dtype=np.float64,
                          count=len(STAT_FIELDS))
        self._stats[rank, 1:] = row
        self._stats[rank, 0] = 1.0

    def publish_values(self, rank: int, values: Sequence[float]) -> None:
        """Store a worker's counters given in :data:`STAT_FIELDS` order (every step: no dict)."""
        if not 0 <= rank < self._stats.shape[0]:
            raise ValueError(f"shared slot cache {self.name}: rank {rank} outside 0..{self._stats.shape[0] - 1}")
        self._stats[rank, 1:] = values
        self._stats[rank, 0] = 1.0

    def rank_stats(self) -> dict[int, dict[str, float]]:
        """``{rank: {field: value}}`` for every rank that has published."""
        rows = self._stats.copy()
        return {rank: dict(zip(STAT_FIELDS, row[1:].tolist(), strict=True))
                for rank, row in enumerate(rows) if row[0] == 1.0}

    @staticmethod
    def _create(name: str, size: int) -> shared_memory.SharedMemory:
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            # A previous engine with the same suffix died without unlinking it.
            stale = shared_memory.SharedMemory(name=name, create=False)
            stale.close()
            stale.unlink()
            logger.warning("routing replay: removed a stale shared slot cache %s left by a previous "
                           "engine", name)
            return shared_memory.SharedMemory(name=name, create=True, size=size)

    @property
    def owner(self) -> bool:
        return self._owner

    def close(self) -> None:
        """Detach; the owner also unlinks the segment."""
        shm, self._shm = getattr(self, "_shm", None), None
        if shm is None:
            return
        self.array = np.empty((0,) + self.array.shape[1:], dtype=self.dtype)
        self._stats = np.zeros((0, self._stats.shape[1]), dtype=np.float64)
        shm.close()
        if self._owner:
            _CREATED_HERE.discard(self.name)
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def as_numpy(value: object, dtype: object | None = None) -> np.ndarray:
    """A flat NumPy view/copy of a Paddle tensor, NumPy array or sequence."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    array = np.asarray(value)
    if dtype is not None:
        array = array.astype(dtype, copy=False)
    return array.reshape(-1)


def host_block_table(block_table: object) -> np.ndarray | None:
    """A zero-copy host view of a CPU block table (None for a device table).

    FastDeploy (and the harness) update ``share_inputs["block_tables"]`` in place, so the
    view stays current; taking it once saves a DLPack export per step and per finish.
    """
    if isinstance(block_table, np.ndarray):
        return block_table
    place = getattr(block_table, "place", None)
    if place is not None and place.is_cpu_place() and len(block_table.shape) == 2:
        view = np.from_dlpack(block_table)
        if view.dtype in (np.int32, np.int64) and view.flags.c_contiguous:
            return view
    return None


def request_slots(block_row: object, length: int, block_size: int) -> np.ndarray:
    """KV slots of positions ``0 .. length-1`` of one request, from its block-table row.

    Raises :class:`OpsError` when the row has too few blocks or an unassigned (negative)
    block among them: such a request's routing cannot be assembled, only reported.
    """
    from fd_routing_replay.errors import OpsError

    row = block_row if isinstance(block_row, np.ndarray) else as_numpy(block_row, np.int64)
    row = np.asarray(row, dtype=np.int64).reshape(-1)
    positions = np.arange(int(length), dtype=np.int64)
    index = positions // block_size
    if length and index[-1] >= row.shape[0]:
        raise OpsError(f"{length} positions need {index[-1] + 1} blocks; the block table "
                       f"has {row.shape[0]} for this request")
    blocks = row[index]
    if (blocks < 0).any():
        raise OpsError(f"{int((blocks < 0).sum())} of {length} positions have no KV block")
    return blocks * block_size + positions % block_size


_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8}
_ITEMSIZE_BY_DTYPE: dict[Any, int | None] = {}      # Paddle dtype object -> item size (None: not an int)


def _itemsize(dtype: Any) -> int | None:
    """Item size of a Paddle integer/bool dtype (None for any other), looked up once per dtype."""
    try:
        return _ITEMSIZE_BY_DTYPE[dtype]
    except KeyError:
        size = _ITEMSIZE_BY_DTYPE[dtype] = _ITEMSIZE.get(str(dtype).rsplit(".", 1)[-1])
        return size


class HostInts:
    """``(address, itemsize, length)`` of per-step integer inputs, read in place.

    A CPU Paddle tensor is described once per object (dtype, place) and then only asked
    for its data pointer (and its length again when the pointer moved); a NumPy array by
    its buffer; anything else (a device tensor, a list) is copied to a host array that
    this object keeps alive until the next call for the same input name.
    """

    def __init__(self) -> None:
        self._described: dict[str, tuple[Any, int, int, int]] = {}   # name -> (obj, itemsize, ptr, length)
        self._copies: dict[str, np.ndarray] = {}

    def __call__(self, name: str, value: Any) -> tuple[int, int, int]:
        if value is None:
            return 0, 0, 0
        known = self._described.get(name)
        if known is not None and known[0] is value:
            pointer = value.data_ptr()
            if pointer == known[2]:
                return pointer, known[1], known[3]
        if isinstance(value, np.ndarray):
            if value.flags.c_contiguous and value.dtype.kind in "biu" and value.itemsize in (1, 2, 4, 8):
                return value.ctypes.data, value.itemsize, value.size
            return self._copy(name, value)
        place = getattr(value, "place", None)
        if place is not None and hasattr(value, "data_ptr") and place.is_cpu_place():
            itemsize = _itemsize(value.dtype)
            if itemsize is not None:
                pointer = value.data_ptr()
                length = 1
                for dim in value.shape:
                    length *= int(dim)
                self._described[name] = (value, itemsize, pointer, length)
                return pointer, itemsize, length
        return self._copy(name, value)

    def _copy(self, name: str, value: Any) -> tuple[int, int, int]:
        array = np.ascontiguousarray(as_numpy(value))
        if array.dtype.kind not in "biu" or array.itemsize not in (1, 2, 4, 8):
            array = array.astype(np.int64)
        self._copies[name] = array
        return array.ctypes.data, array.itemsize, array.size


class PlannedStep:
    """A step the ledger planned: where its tracked tokens sit (slot, position, step-buffer
    row, KV slot) and which slots forwarded, as views of the ledger's scratch made only when
    read (the ledger itself reads the scratch).  Valid until the ledger plans the next step."""

    __slots__ = ("ledger", "num_tokens", "num_active", "num_step_tokens", "_has_encoder", "_slots")

    def __init__(self, ledger: StepLedger, num_tokens: int, num_active: int, num_step_tokens: int,
                 has_encoder: bool) -> None:
        self.ledger = ledger
        self.num_tokens = num_tokens
        self.num_active = num_active
        self.num_step_tokens = int(num_step_tokens)
        self._has_encoder = has_encoder
        self._slots: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def batch_ids(self) -> np.ndarray:
        return self.ledger.tokens[0, :self.num_tokens]

    @property
    def positions(self) -> np.ndarray:
        return self.ledger.tokens[1, :self.num_tokens]

    @property
    def rows(self) -> np.ndarray:
        return self.ledger.tokens[2, :self.num_tokens]

    @property
    def slots(self) -> np.ndarray:
        """KV slot per token (-1: none); one object per step (``compute_slot_mapping``
        returns it and ``update_host_cache`` recognises it)."""
        if self._slots is None:
            self._slots = self.ledger.tokens[3, :self.num_tokens]
        return self._slots

    @property
    def active(self) -> np.ndarray:
        return self.ledger.slots[0, :self.num_active]

    @property
    def starts(self) -> np.ndarray:
        return self.ledger.slots[1, :self.num_active]

    @property
    def counts(self) -> np.ndarray:
        return self.ledger.slots[2, :self.num_active]

    @property
    def is_prefill(self) -> np.ndarray | None:
        return self.ledger.slots[3, :self.num_active].astype(bool) if self._has_encoder else None

    @property
    def kept(self) -> np.ndarray:
        """Tokens of each active slot that count (after the commit: speculative decoding
        keeps a decode step's accepted ones)."""
        return self.ledger.slots[4, :self.num_active]

    @property
    def relative(self) -> np.ndarray:
        """Index of each token within its sequence's part of this step (0..count-1)."""
        return self.positions - np.repeat(self.starts, self.counts)


class StepLedger:
    """The bound ledger with its scratch and state arrays (see the module docstring).

    ``registered``, ``forwarded`` and ``damaged`` are the manager's own per-slot arrays: the
    ledger reads and updates them in place.  Scratch: ``tokens`` int64 ``[4, T]`` (slot,
    position, step-buffer row, KV slot of each tracked token), ``slots`` int64 ``[5, S]``
    (active slot, start, count, prefill, kept), ``finished`` int64 ``[2, S]`` (finished slot,
    its length).  The token scratch grows when a step tracks more tokens than it holds.
    """

    def __init__(self, arrays: dict[str, Any], max_tokens: int) -> None:
        num_seqs = int(arrays["registered"].shape[0])
        self._arrays = arrays
        self.slots = np.zeros((5, num_seqs), dtype=np.int64)
        self.finished_scratch = np.zeros((2, num_seqs), dtype=np.int64)
        self.inputs = HostInts()
        self.current: PlannedStep | None = None      # the last plan: its views are current
        self._bind(max(int(max_tokens), 1))

    def _bind(self, capacity: int) -> None:
        self.tokens = np.zeros((4, capacity), dtype=np.int64)
        self.capacity = capacity
        self.bound = ops.bind_step_ledger(tokens=self.tokens, slots=self.slots,
                                          finished=self.finished_scratch, **self._arrays)

    def plan(self, seq_lens_decoder: Any, seq_lens_this_time: Any, seq_lens_encoder: Any = None) -> PlannedStep:
        """This step's tracked tokens (the token scratch grows to hold them)."""
        decoder = self.inputs("seq_lens_decoder", seq_lens_decoder)
        this_time = self.inputs("seq_lens_this_time", seq_lens_this_time)
        encoder = self.inputs("seq_lens_encoder", seq_lens_encoder)
        while True:
            count, active, step_tokens = self.bound.plan(decoder[0], decoder[1], decoder[2], this_time[0],
                                                         this_time[1], this_time[2], *encoder)
            if count >= 0:
                break
            self._bind(2 * self.capacity)             # rare: more tracked tokens than ever before
        self.current = PlannedStep(self, count, active, step_tokens, seq_lens_encoder is not None)
        return self.current

    def planned(self, positions: Any) -> bool:
        """Whether ``positions`` is this ledger's current plan (its scratch views are valid)."""
        return positions is not None and positions is self.current

    def commit(self, positions: PlannedStep, staged_rows: int | None,
               accept_num: Any = None) -> tuple[int, int, int, int]:
        """``(written, unmapped, missing_layers, bad_ids)`` of the planned step; ``staged_rows``
        None on a rank that does not offload; ``accept_num``: speculative decoding's."""
        return self.bound.commit(positions.num_tokens, positions.num_active,
                                 -1 if staged_rows is None else int(staged_rows),
                                 *self.inputs("accept_num", accept_num))

    def finished(self, positions: PlannedStep, finished_batch_ids: Any, stop_flags: Any, prompt_lens: Any,
                 **speculative: Any) -> tuple[np.ndarray, np.ndarray]:
        """The planned step's slots that finished and their lengths (views, valid until the
        next call).  ``speculative``: ``step_idx``, ``max_dec_len``, ``accept_tokens``,
        ``eos_token_id`` (speculative decoding only)."""
        names = ("step_idx", "max_dec_len", "accept_tokens", "eos_token_id")
        count = self.bound.finished(positions.num_active, *self.inputs("finished", finished_batch_ids),
                                    *self.inputs("stop_flags", stop_flags),
                                    *self.inputs("prompt_lens", prompt_lens),
                                    *(value for name in names for value in self.inputs(name, speculative.get(name))))
        return self.finished_scratch[0, :count], self.finished_scratch[1, :count]
