"""The table-API manager's per-step bookkeeping, compiled: three bound calls per step.

:class:`~fd_routing_replay.capture.manager.RoutingReplayManager` calls FastDeploy's four
per-step methods; with the compiled ops each is a thin shell over one call of the
library's ``StepLedger`` (custom_ops/step_ledger.cc):

* ``plan`` (``get_token_positions`` + ``compute_slot_mapping``): positions, step-buffer rows
  and KV slots of the tracked tokens, into preallocated scratch;
* ``commit`` (``update_host_cache``, after the step's rows reached the host staging): the
  tokens without a valid KV slot, each slot's forwarded length, the device counters'
  deltas and the scatter into the host slot cache;
* ``finished`` (``put_finished_batch``'s check): the slots that finished this step.

Per-step inputs (``seq_lens_*``, ``stop_flags``, ...) are read where they live when they
are host buffers (a CPU Paddle tensor by its data pointer, a NumPy array by its buffer);
a device tensor is copied to the host first, as the NumPy path does.  The manager keeps
its NumPy path -- the reference the ledger is tested against -- for what the ledger does
not cover: speculative decoding, a device block table, and steps whose tokens outgrow the
scratch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_routing_replay import ops
from fd_routing_replay.capture.positions import as_numpy

__all__ = ["HostInts", "PlannedStep", "StepLedger"]

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
    """A step the ledger planned: what :class:`~fd_routing_replay.capture.positions.
    StepPositions` holds, as views of the ledger's scratch made only when read (the
    compiled path reads the scratch itself).  Valid until the ledger plans the next step."""

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
    def relative(self) -> np.ndarray:
        """Index of each token within its sequence's part of this step (0..count-1)."""
        return self.positions - np.repeat(self.starts, self.counts)


class StepLedger:
    """The bound ledger with its scratch and state arrays (see the module docstring).

    ``registered``, ``forwarded`` and ``damaged`` are the manager's own per-slot arrays:
    the ledger reads and updates them in place.  Build with :meth:`bind`, which returns
    None where the compiled library is not loaded.
    """

    def __init__(self, bound: Any, tokens: np.ndarray, slots: np.ndarray, finished: np.ndarray) -> None:
        self.bound = bound
        self.tokens = tokens
        self.slots = slots
        self.finished_slots = finished
        self.inputs = HostInts()
        self.capacity = int(tokens.shape[1])
        self.current: PlannedStep | None = None      # the last plan: its views are current

    @classmethod
    def bind(cls, *, registered: np.ndarray, forwarded: np.ndarray, damaged: np.ndarray,
             block_table: np.ndarray, block_size: int, max_model_len: int, max_tokens: int,
             host_cache: Any = None, step: Any = None) -> StepLedger | None:
        """A ledger over the manager's arrays, or None without the compiled library."""
        num_seqs = int(registered.shape[0])
        tokens = np.zeros((4, max(int(max_tokens), 1)), dtype=np.int64)
        slots = np.zeros((4, num_seqs), dtype=np.int64)
        finished = np.zeros(num_seqs, dtype=np.int64)
        offload = dict(cache=None, staging=None, host_counters=None, seen=None, delta=None)
        if host_cache is not None and step is not None:
            offload = dict(cache=host_cache.array, staging=step.host_rows, host_counters=step.host_counters,
                           seen=step.seen_counters, delta=step.counter_delta)
        bound = ops.bind_step_ledger(
            registered=registered, forwarded=forwarded, damaged=damaged, tokens=tokens, slots=slots,
            finished=finished, block_table=block_table, block_size=int(block_size),
            max_model_len=int(max_model_len), **offload)
        return None if bound is None else cls(bound, tokens, slots, finished)

    def plan(self, seq_lens_decoder: Any, seq_lens_this_time: Any,
             seq_lens_encoder: Any = None) -> PlannedStep | None:
        """This step's tracked tokens, or None when they outgrow the scratch."""
        decoder = self.inputs("seq_lens_decoder", seq_lens_decoder)
        this_time = self.inputs("seq_lens_this_time", seq_lens_this_time)
        encoder = self.inputs("seq_lens_encoder", seq_lens_encoder)
        count, active, step_tokens = self.bound.plan(decoder[0], decoder[1], decoder[2], this_time[0],
                                                     this_time[1], this_time[2], *encoder)
        if count < 0:
            self.current = None
            return None
        self.current = PlannedStep(self, count, active, step_tokens, seq_lens_encoder is not None)
        return self.current

    def planned(self, positions: Any) -> bool:
        """Whether ``positions`` is this ledger's current plan (its scratch views are valid)."""
        return positions is not None and positions is self.current

    def commit(self, positions: PlannedStep, staged_rows: int | None) -> tuple[int, int, int, int]:
        """``(written, unmapped, missing_layers, bad_ids)`` of the planned step; ``staged_rows``
        None on a rank that does not offload."""
        return self.bound.commit(positions.num_tokens, positions.num_active,
                                 -1 if staged_rows is None else int(staged_rows))

    def finished(self, positions: PlannedStep, finished_batch_ids: Any, stop_flags: Any,
                 prompt_lens: Any) -> np.ndarray:
        """The planned step's slots that finished (a view, valid until the next call)."""
        count = self.bound.finished(positions.num_active, *self.inputs("finished", finished_batch_ids),
                                    *self.inputs("stop_flags", stop_flags),
                                    *self.inputs("prompt_lens", prompt_lens))
        return self.finished_slots[:count]
