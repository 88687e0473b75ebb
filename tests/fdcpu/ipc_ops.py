"""CPU stand-ins for the KV cache's cross-process sharing ops.

``set_data_ipc(tensor, name)`` (custom_ops/gpu_ops/set_data_ipc.cu, ``set_data_ipc``)
publishes a GPU tensor under a name through ``cudaIpcGetMemHandle`` so that FastDeploy's
cache transfer / messager processes can map it (``share_external_data``,
share_external_data.cu); the runner calls it for every KV cache tensor it creates
(gpu_model_runner.py:1566-1572).  Without a CPU KV tier, PD disaggregation or a KV storage
backend no other process maps the cache, so the stand-in records the name in this process
and ``share_external_data`` hands back a tensor only this process published: asking for
one published elsewhere raises, naming it, instead of silently creating a second cache.
"""

from __future__ import annotations

from typing import Any

__all__ = ["published", "set_data_ipc", "share_external_data", "unset_data_ipc"]

published: dict[str, Any] = {}


def set_data_ipc(tensor: Any, name: str) -> None:
    published[name] = tensor


def unset_data_ipc(tensor: Any, name: str, *args: Any) -> None:
    published.pop(name, None)


def share_external_data(tensor: Any, name: str, shape: Any, *args: Any) -> Any:
    if name not in published:
        raise RuntimeError(f"share_external_data: no tensor named {name!r} was published in this process; the "
                           "CPU rig cannot map another process's KV cache (no CPU KV tier, PD or storage backend)")
    return published[name].reshape(list(shape))
