"""The byte ring that carries record payloads from the engine to the writer.

The engine copies each record's ids into a range of one fixed buffer (the only copy on
the engine's thread) and sends the writer a small message naming the range; the writer
encodes and stores straight from that memory and acknowledges, which frees the range.

* :class:`RingAllocator` hands out aligned ranges in FIFO order and takes them back in
  any order (a range is reused once every older range is free), so capacity is counted
  in bytes, not items.
* :class:`RingMemory` is the buffer: a Linux ``memfd`` (shared memory without a name in
  ``/dev/shm``, so it cannot leak when a process is SIGKILLed and is not bound by a small
  container ``/dev/shm``), an unlinked temporary file elsewhere, or plain process memory
  in thread mode.  Its pages can be pre-faulted off the GIL so the first trip around the
  ring does not pay page faults on the engine's thread.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

ALIGNMENT = 64
"""Every range starts at a multiple of this (cache line; any ids dtype is aligned)."""

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _align(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


@dataclass(eq=False)
class Block:
    """One allocated range ``[offset, offset + size)``; ``nbytes`` is what the caller asked."""

    offset: int
    size: int
    nbytes: int
    freed: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.size


class RingAllocator:
    """FIFO range allocator over ``capacity`` bytes; not thread-safe (the writer locks)."""

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGNMENT:
            raise ValueError(f"ring capacity must be at least {ALIGNMENT} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGNMENT
        self._blocks: deque[Block] = deque()
        self.used_bytes = 0
        """Bytes callers asked for in live blocks (the queue-bytes gauge)."""

    def fits_ever(self, nbytes: int) -> bool:
        """True when a request of ``nbytes`` can be satisfied once the ring is empty."""
        return _align(nbytes) <= self.capacity

    def alloc(self, nbytes: int) -> Block | None:
        """A free aligned range of at least ``nbytes``, or None when there is none now."""
        size = _align(nbytes)
        if size > self.capacity:
            return None
        if not self._blocks:
            offset = 0
        else:
            tail = self._blocks[0].offset
            head = self._blocks[-1].end
            if head > tail:  # live data is [tail, head): room at the end, then at the start
                if size <= self.capacity - head:
                    offset = head
                elif size <= tail:
                    offset = 0
                else:
                    return None
            elif size <= tail - head:  # wrapped: room only between head and tail
                offset = head
            else:
                return None
        block = Block(offset, size, nbytes)
        self._blocks.append(block)
        self.used_bytes += nbytes
        return block

    def free(self, block: Block) -> None:
        """Return ``block``; its space is reusable once every older block is free too."""
        if block.freed:
            return
        block.freed = True
        self.used_bytes -= block.nbytes
        while self._blocks and self._blocks[0].freed:
            self._blocks.popleft()


class RingMemory:
    """The shared buffer behind the ring, mapped as a uint8 numpy array (``array``).

    ``shared=True`` makes memory another process can map through :attr:`fd` (memfd or an
    unlinked temporary file); ``shared=False`` is process memory for thread mode.
    """

    def __init__(self, capacity: int, *, shared: bool) -> None:
        self.capacity = capacity
        self.fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self.prefault_thread: threading.Thread | None = None
        if shared:
            self.fd = _anonymous_shared_fd(capacity)
            self._mmap = mmap.mmap(self.fd, capacity)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        else:
            self.array = np.empty(capacity, dtype=np.uint8)

    @classmethod
    def attach(cls, fd: int, capacity: int) -> RingMemory:
        """Map a ring another process created (the writer process side)."""
        self = cls.__new__(cls)
        self.capacity = capacity
        self.fd = fd
        self.prefault_thread = None
        self._mmap = mmap.mmap(fd, capacity)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        return self

    def view(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """``nbytes`` at ``offset`` as an array of ``dtype`` and ``shape`` (no copy)."""
        return self.array[offset:offset + nbytes].view(dtype).reshape(shape)

    def prefault_in_background(self) -> threading.Thread | None:
        """Touch every page in a daemon thread with the GIL released (Linux ≥ 5.14).

        Without it the first pass around a fresh ring pays a page fault per 4 KiB on the
        engine's thread (about 1 ms per MB on a VM).  Costs ``capacity`` bytes of RAM up
        front, which the ring would reach after one lap anyway.
        """
        if not sys.platform.startswith("linux") or self.capacity == 0:
            return None
        available = _mem_available()
        if available is not None and self.capacity > available // 2:
            log.info("ring of %d bytes not pre-faulted: only %d bytes of memory available",
                     self.capacity, available)
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return None
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        address = self.array.ctypes.data
        page = mmap.PAGESIZE
        start = address - address % page
        length = self.capacity + (address - start)

        def run() -> None:
            # ctypes drops the GIL for the call; errors (old kernel) just skip it.
            if madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                log.debug("ring prefault skipped: madvise errno %d", ctypes.get_errno())

        thread = threading.Thread(target=run, name="fd-rr-ring-prefault", daemon=True)
        thread.start()
        self.prefault_thread = thread
        return thread

    def close(self) -> None:
        """Unmap and close; views still alive keep the mapping until they are dropped."""
        self.array = np.empty(0, dtype=np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still exported; the GC unmaps it later
                pass
            self._mmap = None
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _anonymous_shared_fd(capacity: int) -> int:
    """A file descriptor of ``capacity`` bytes of shareable memory with no name to leak."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("fd-routing-replay-ring", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        handle = tempfile.TemporaryFile()
        fd = os.dup(handle.fileno())
        handle.close()
    try:
        os.ftruncate(fd, capacity)
    except OSError:
        os.close(fd)
        raise
    return fd
