"""CPU stand-ins for the worker-to-engine token hand-off on FastDeploy's default output path.

With ``FD_USE_GET_SAVE_OUTPUT_V1=0`` (FastDeploy's default, envs.py:129) the worker's
``save_output`` (custom_ops/gpu_ops/save_with_output_msg.cc, ``save_kernel``) copies the
step's sampled tokens to the host and sends them on a System V message queue, and the
engine's token processor receives them with ``get_output`` (get_output.cc, ``GetOutput``)
into its ``output_tokens`` tensor (output/token_processor.py:118, :541-545).  Both ends are
host code around ``msgsnd`` / ``msgrcv``; the stand-ins make the same calls through ctypes:

* queue key ``custom_ftok("/dev/shm", id)`` -- ``(st_dev & 0xff) << 24 | (st_ino & 0xff) << 16
  | (id & 0xffff)`` of ``/dev/shm`` (custom_ftok.h) -- with ``id`` the environment's
  ``INFERENCE_MSG_QUEUE_ID`` (the engine-worker queue port, gpu_model_runner.py:238,
  common_engine.py:184), so two servers on one machine never share a queue;
* message ``{long mtype = 1; int mtext[MAX_BSZ + 2]}``: ``mtext[0]`` is ``INFERENCE_MSG_ID``
  (1) while the worker has running sequences and its negative otherwise, ``mtext[1]`` the
  batch size, then one token per slot (int32);
* ``get_output`` fills ``output_tokens[0:bsz + 2]`` (int64), or ``[-2, 0]`` when a
  non-blocking receive finds nothing.

2.6 passes ``save_output`` the slots preempted this step (``last_preempted_idx``,
model_executor/pre_and_post_process.py:420-432); their token is sent as
``PREEMPTED_TOKEN_ID`` (-9), the rule the ZMQ path applies in Python before sending
(gpu_model_runner.py:2669-2677) and the token processor expects (token_processor.py:358-373).

FastDeploy 2.6's other output path, ``FD_USE_GET_SAVE_OUTPUT_V1=1`` (ZMQ, no compiled op),
never moves a request to ``RUNNING_DECODE`` (``_process_batch_output_use_zmq``,
token_processor.py:345-449, has no counterpart of :1018-1019), so the V1 scheduler finds no
request it may preempt when blocks run out (resource_manager_v1.py:355-390: "scheduler may be
hung") -- the live rig runs this default path for that reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

import numpy as np

from .tensors import read, write

__all__ = ["MAX_BSZ", "PREEMPTED_TOKEN_ID", "get_output", "queue_key", "remove_queue", "save_output"]

MAX_BSZ = 512                       # get_output.cc / token_processor.py:57
PREEMPTED_TOKEN_ID = -9             # fastdeploy/config.py:69
IPC_CREAT, IPC_NOWAIT, IPC_RMID = 0o1000, 0o4000, 0
ENOMSG = 42

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.msgget.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
_libc.msgrcv.restype = ctypes.c_ssize_t
_libc.msgctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


class _Message(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_int * (MAX_BSZ + 2))]


def queue_key(msg_queue_id: int, path: str = "/dev/shm") -> int:
    """``custom_ftok(path, id)`` (custom_ftok.h)."""
    st = os.stat(path)
    key = ((st.st_dev & 0xFF) << 24) | ((st.st_ino & 0xFF) << 16) | (int(msg_queue_id) & 0xFFFF)
    return ctypes.c_int(key).value            # key_t is a signed int


def _queue_id(default: int) -> int:
    return int(os.environ.get("INFERENCE_MSG_QUEUE_ID", default))


_queues: dict[int, int] = {}


def _queue(msg_queue_id: int) -> int:
    if msg_queue_id not in _queues:
        qid = _libc.msgget(queue_key(msg_queue_id), IPC_CREAT | 0o666)
        if qid < 0:
            raise OSError(ctypes.get_errno(), f"msgget for message queue id {msg_queue_id} failed")
        _queues[msg_queue_id] = qid
    return _queues[msg_queue_id]


def save_output(x: Any, not_need_stop: Any, preempted_idx: Any = None, rank_id: int = 0,
                save_each_rank: bool = False) -> None:
    """Send the step's tokens ``x`` ``[bsz, 1]`` to the engine (rank 0 only)."""
    if rank_id > 0:
        return
    tokens = read(x).reshape(-1).astype(np.int64)
    if preempted_idx is not None:
        preempted = read(preempted_idx).reshape(-1)[: len(tokens)]
        tokens = np.where(preempted == 1, PREEMPTED_TOKEN_ID, tokens)
    if len(tokens) > MAX_BSZ:
        raise ValueError(f"save_output: {len(tokens)} slots exceed MAX_BSZ {MAX_BSZ}")
    message = _Message()
    message.mtype = 1
    msg_id = int(os.environ.get("INFERENCE_MSG_ID", "1"))
    message.mtext[0] = msg_id if bool(read(not_need_stop).reshape(-1)[0]) else -msg_id
    message.mtext[1] = len(tokens)
    for i, token in enumerate(tokens):
        message.mtext[2 + i] = int(token)
    if _libc.msgsnd(_queue(_queue_id(1)), ctypes.byref(message), (MAX_BSZ + 2) * 4, 0) == -1:
        print("full msg buffer", flush=True)          # save_kernel's own message


def get_output(x: Any, rank_id: int = 0, wait_flag: bool = True, msg_queue_id: int = 1) -> None:
    """Receive one step's tokens into ``x`` ``[MAX_BSZ + 2, 1]`` (blocking when ``wait_flag``)."""
    if rank_id > 0:
        return
    message = _Message()
    flags = 0 if wait_flag else IPC_NOWAIT
    while True:
        received = _libc.msgrcv(_queue(_queue_id(msg_queue_id)), ctypes.byref(message), (MAX_BSZ + 2) * 4, 0,
                                flags)
        if received != -1 or ctypes.get_errno() != 4:             # retry an interrupted wait (EINTR)
            break
    out = read(x)
    if received == -1:
        out.reshape(-1)[:2] = [-2, 0]
    else:
        count = int(message.mtext[1]) + 2
        out.reshape(-1)[:count] = np.frombuffer(message.mtext, dtype=np.int32)[:count]
    write(x, out)


def remove_queue(msg_queue_id: int) -> bool:
    """Remove the message queue of ``msg_queue_id`` if it exists (System V queues outlive
    their processes); True when one was removed."""
    qid = _libc.msgget(queue_key(msg_queue_id), 0o666)
    if qid < 0:
        return False
    return _libc.msgctl(qid, IPC_RMID, None) == 0
