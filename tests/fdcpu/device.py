"""The CUDA presentation: FastDeploy's GPU code paths, run by a CPU Paddle.

FastDeploy picks its platform from ``paddle.is_compiled_with_cuda()``
(fastdeploy/platforms/base.py:42-46, platforms/__init__.py:37); off CUDA it has no worker
(worker/worker_process.py:79-112 has no CPU branch), its ``cpu`` platform is a stub
(platforms/cpu.py:17-18) and args_utils turns prefix caching and overlap scheduling off.
So FastDeploy's own ``current_platform`` is replaced by a CUDA platform object whose
``is_cuda()`` answers True; Paddle itself is left alone (its launcher and collectives see a
CPU build).  Beside it, the few device calls FastDeploy's GPU path makes that a CPU build
refuses:

* ``GpuWorker.init_device`` (worker/gpu_worker.py:58-94) sets ``gpu:N`` as Paddle's device;
  the stand-in does the same steps on the CPU place.
* ``Tensor.pin_memory`` (worker/input_batch.py:157-159 and others): a CPU copy, which is
  what a pinned host copy is to a CPU program.
* ``paddle.device.cuda.create_event`` / ``Event`` (gpu_model_runner.py:1260, :2680): CPU
  work is complete when the call returns, so ``record`` / ``synchronize`` have nothing to
  wait for.
* ``paddle.device.cuda.get_device_properties`` (config-info endpoint, usage stats): a fixed
  description naming this rig.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

__all__ = ["HostEvent", "device_properties", "present_cuda_platform", "patch_paddle", "patch_gpu_worker"]


class HostEvent:
    """``paddle.device.cuda.Event`` for a program whose kernels finish before they return."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def device_properties(device: Any = None) -> SimpleNamespace:
    """What ``paddle.device.cuda.get_device_properties`` reports on this rig."""
    return SimpleNamespace(name="CPU (fd-routing-replay live rig, fake CUDA)", major=9, minor=0,
                           total_memory=16 << 30, multi_processor_count=1)


def _pinned_copy(self: Any, blocking: bool = True) -> Any:
    """``Tensor.pin_memory``: a host copy (the CPU build has no pinned place)."""
    return self.clone()


def patch_paddle(paddle: ModuleType) -> None:
    """Install the device stand-ins on an imported ``paddle``."""
    paddle.Tensor.pin_memory = _pinned_copy
    cuda = paddle.device.cuda
    cuda.Event = HostEvent
    cuda.create_event = lambda *args, **kwargs: HostEvent()
    cuda.get_device_properties = device_properties


def present_cuda_platform(platforms: ModuleType) -> None:
    """Make ``fastdeploy.platforms.current_platform`` FastDeploy's own CUDA platform, answering
    True to ``is_cuda()`` on this CPU build (run right after ``fastdeploy.platforms`` loads)."""
    from fastdeploy.platforms.cuda import CUDAPlatform

    class RigCUDAPlatform(CUDAPlatform):
        """FastDeploy's CUDA platform on a CPU Paddle (test rig only)."""

        def is_cuda(self) -> bool:
            return True

        def is_cuda_alike(self) -> bool:
            return True

        def is_cpu(self) -> bool:
            return False

        @classmethod
        def available(cls) -> bool:
            return True

    platforms._current_platform = RigCUDAPlatform()


def patch_gpu_worker(gpu_worker: ModuleType) -> None:
    """Replace ``GpuWorker.init_device`` (gpu_worker.py:58-94) by its steps on the CPU place."""

    def init_device(self: Any) -> None:
        import paddle
        from fastdeploy.usage.usage_lib import report_usage_stats
        from fastdeploy.utils import set_random_seed

        self.max_chips_per_node = 8
        self.device_ids = self.parallel_config.device_ids.split(",")
        self.device = "cpu"                       # gpu_worker.py:66 sets f"gpu:{local_rank}"
        paddle.device.set_device(self.device)
        paddle.set_default_dtype(self.model_config.dtype)
        if self.local_rank == 0:
            report_usage_stats(self.fd_config)    # a no-op under DO_NOT_TRACK=1
        set_random_seed(self.fd_config.model_config.seed)
        self.model_runner = gpu_worker.ModelRunner(
            fd_config=self.fd_config, device=self.device,
            device_id=int(self.device_ids[self.local_rank % self.max_chips_per_node]),
            rank=self.rank, local_rank=self.local_rank)

    gpu_worker.GpuWorker.init_device = init_device
