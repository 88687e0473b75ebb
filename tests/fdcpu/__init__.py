"""CPU stand-ins for FastDeploy's compiled kernels, so FastDeploy's own Python runs on a CPU.

``install()`` runs FastDeploy (2.6's GPU code path) unchanged on a CPU Paddle: it puts
:mod:`fdrr_dev.testing.fastdeploy_standins` in place (FastDeploy's compiled op modules and
Triton become stand-in modules) and fills ``fastdeploy.model_executor.ops.gpu`` with the
CPU implementations below before any FastDeploy module binds them; it presents FastDeploy's
CUDA platform (:mod:`.device`).  Every stand-in names the CUDA source it mirrors
(custom_ops/gpu_ops in the public PaddlePaddle/FastDeploy repository) and is tested
against hand-worked cases in ``tests/fdcpu/``.

=========================================  ==================================================
op (``fastdeploy.model_executor.ops.gpu``)  module / CUDA source
=========================================  ==================================================
get_padding_offset                          :mod:`.step_ops` / get_padding_offset.cu
get_position_ids_and_slot_mapping           :mod:`.step_ops` / get_position_ids_and_slot_mapping.cu
recover_decode_task                         :mod:`.step_ops` / recover_decode_task.cu
rebuild_padding                             :mod:`.step_ops` / rebuild_padding.cu
set_value_by_flags_and_idx                  :mod:`.step_ops` / set_value_by_flags.cu
set_stop_value_multi_ends                   :mod:`.step_ops` / stop_generation_multi_ends.cu
update_inputs_v1                            :mod:`.step_ops` / update_inputs_v1.cu
custom_numpy_to_tensor                      :mod:`.step_ops` / cpp_extensions.cc
get_token_penalty_multi_scores              :mod:`.sampling_ops` / token_penalty_multi_scores.cu
min_p_sampling, top_k_renorm_probs          :mod:`.sampling_ops` / min_p_sampling.cu, top_k_renorm_probs.cu
moe_expert_dispatch / _ffn / _reduce        :mod:`.moe_ops` / moe/moe_dispatch.cu, moe_ffn.cu, moe_reduce.cu
set_data_ipc, share_external_data,          :mod:`.ipc_ops` / set_data_ipc.cu, share_external_data.cu
unset_data_ipc
save_output, get_output                     :mod:`.output_ops` / save_with_output_msg.cc, get_output.cc
=========================================  ==================================================

Beside the ops: ``paddle.tensor.top_p_sampling`` (Paddle's own op, no CPU kernel;
:mod:`.sampling_ops`), the CUDA presentation and device calls (:mod:`.device`), FastDeploy's
Triton routing capture kernel (:mod:`.triton_kernels`), and paged attention for a float32
model on FastDeploy's KV cache layout (:mod:`.attention`).  Ops not
listed stay FastDeploy's stand-ins that raise when called, naming the op.

Environment FastDeploy needs on this rig (set by ``tests/live/rig.py``): ``FD_ENABLE_TOP_P_ONE_OPT=0``
(its top-p = 1 shortcut draws Triton Gumbel noise on the device, sampler.py:363-366).  Both of
FastDeploy's worker-to-engine output paths run: the default System V message queue
(:mod:`.output_ops`) and, with ``FD_USE_GET_SAVE_OUTPUT_V1=1``, ZMQ (pure Python).
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["GPU_OPS", "install"]

GPU_OPS = {
    "step_ops": ("get_padding_offset", "get_position_ids_and_slot_mapping", "recover_decode_task",
                 "rebuild_padding", "set_value_by_flags_and_idx", "set_stop_value_multi_ends",
                 "update_inputs_v1", "custom_numpy_to_tensor"),
    "sampling_ops": ("get_token_penalty_multi_scores", "min_p_sampling", "top_k_renorm_probs"),
    "moe_ops": ("moe_expert_dispatch", "moe_expert_ffn", "moe_expert_reduce"),
    "ipc_ops": ("set_data_ipc", "share_external_data", "unset_data_ipc"),
    "output_ops": ("save_output", "get_output"),
}
"""Stand-in module -> the ``fastdeploy.model_executor.ops.gpu`` names it provides."""

_installed = False


def _fill_gpu_ops(module: ModuleType) -> None:
    import importlib

    for module_name, names in GPU_OPS.items():
        source = importlib.import_module(f"{__name__}.{module_name}")
        for name in names:
            setattr(module, name, getattr(source, name))


def _patch_paddle(paddle: ModuleType) -> None:
    from . import device, sampling_ops

    device.patch_paddle(paddle)
    paddle.tensor.top_p_sampling = sampling_ops.top_p_sampling


def _patch_triton(triton: ModuleType) -> None:
    from .triton_kernels import patch_triton

    patch_triton(triton)


def install() -> None:
    """Install the stand-ins in this process (idempotent); call before importing FastDeploy."""
    global _installed
    if _installed:
        return
    from fdrr_dev.testing import fastdeploy_standins

    from . import device
    from .hooks import install_hooks

    fastdeploy_standins.install()
    install_hooks({
        "paddle": [_patch_paddle],
        "triton": [_patch_triton],
        "fastdeploy.platforms": [device.present_cuda_platform],
        "fastdeploy.worker.gpu_worker": [device.patch_gpu_worker],
        "fastdeploy.model_executor.ops.gpu": [_fill_gpu_ops],
    })
    _installed = True
