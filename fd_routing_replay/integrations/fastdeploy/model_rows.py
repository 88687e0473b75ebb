"""The step's row assembly bound to FastDeploy's loaded model: EPLB's placement table,
ERNIE-4.5-VL's expert groups, chunked MoE (:mod:`fd_routing_replay.capture.rows`).

Read once, when our manager is installed (``GpuWorker.initialize_cache``, after the model
is loaded: worker_process.py:1353-1355 in 2.6).  File:line references are to
``../shared/fastdeploy/2.6``.  Importing this module imports neither FastDeploy nor Paddle.
"""

from __future__ import annotations

import logging
from typing import Any

from fd_routing_replay.capture.rows import ExpertGroups, ExpertPlacement, MoEChunks, RowAssembler
from fd_routing_replay.errors import ConfigError
from fd_routing_replay.integrations.fastdeploy import setup as fd_setup

__all__ = ["expert_groups", "moe_layers", "placement", "row_assembler"]

logger = logging.getLogger(__name__)

GROUP_BUFFERS = ("token_type_ids", "text_index", "image_index")
"""ERNIE-4.5-VL's per-step buffers (``Ernie4_5_VLModel._cuda_graph_buffers``, filled by
``prepare_vl_moe_meta`` and ``text_image_index_out`` before the layers run,
ernie4_5_vl_moe.py:503-544)."""


def moe_layers(model: Any) -> list[Any]:
    """The model's ``FusedMoE`` layers (found by what FastDeploy's MoE layers carry)."""
    if model is None:
        return []
    return [layer for layer in model.sublayers(include_self=True)
            if hasattr(layer, "quant_method") and hasattr(layer, "layer_idx") and hasattr(layer, "moe_tag")]


def placement(fd_config: Any, model: Any) -> ExpertPlacement | None:
    """EPLB: FastDeploy's physical-slot table for the layers whose hook gets physical slots,
    or None when no layer does.

    A layer's ids are physical exactly when it selects through ``EPRunner.moe_select`` with a
    placement table: expert parallelism (its quant method holds an EP runner, set up by
    ``init_ep``, fused_moe_backend_base.py:69-120) and a ``redundant_table_manger``
    (ep.py:494-530).  Without EP, ``apply_tp`` selects logical experts even under EPLB.  In
    FastDeploy 2.6 only ERNIE-4.5 MoE builds the table (models/ernie4_5_moe.py:423-430).
    """
    eplb = getattr(fd_config, "eplb_config", None)
    if not getattr(eplb, "enable_eplb", False):
        return None
    if model is None:
        raise ConfigError("routing replay under EPLB reads FastDeploy's expert placement table from the "
                          "loaded model, but the model runner has no model")
    offset = fd_setup.moe_layer_offset(fd_config.model_config)
    managers: dict[int, Any] = {}
    rows: dict[int, int] = {}
    for layer in moe_layers(model):
        manager = getattr(layer, "redundant_table_manger", None)
        method = layer.quant_method
        physical = int(getattr(layer, "ep_size", 1) or 1) > 1 and (
            getattr(method, "ep_prefill_runner", None) is not None
            or getattr(method, "ep_decoder_runner", None) is not None)
        if manager is None or not physical:
            continue
        managers[id(manager)] = manager
        rows[int(layer.layer_idx) - offset] = int(layer.layer_idx)
    if len(managers) > 1:
        raise ConfigError(f"routing replay under EPLB found {len(managers)} expert placement tables in the "
                          "model; FastDeploy builds one per model")
    if not rows:
        logger.info("fd-routing-replay: EPLB is on but no MoE layer selects physical replica slots "
                    "(no expert parallelism or no placement table): the routed ids are logical already")
        return None
    table = next(iter(managers.values())).model_ep_rank_to_expert_id_list
    mapped = ExpertPlacement(table, [rows.get(i, -1) for i in range(max(rows) + 1)])
    logger.info("fd-routing-replay: EPLB: %d MoE layers map physical replica slots (%d) to logical "
                "experts through FastDeploy's placement table on the device", len(rows), mapped.slots)
    return mapped


def expert_groups(fd_config: Any, model: Any) -> ExpertGroups | None:
    """ERNIE-4.5-VL: the text / image expert groups, the image MoE's forward marked; None
    for a model without per-modality expert groups."""
    model_config = fd_config.model_config
    counts = fd_setup.expert_groups_of(model_config)
    if counts is None:
        return None
    name = fd_setup.architecture_of(model_config)
    buffers = None
    for layer in ([] if model is None else model.sublayers(include_self=True)):
        found = getattr(layer, "_cuda_graph_buffers", None)
        if isinstance(found, dict) and all(key in found for key in GROUP_BUFFERS):
            buffers = found
            break
    images = [layer for layer in moe_layers(model) if getattr(layer, "moe_tag", "") == "Image"]
    if buffers is None or not images:
        raise ConfigError(f"routing replay found no text/image MoE of {name} to bind (its per-step token "
                          f"type buffers {list(GROUP_BUFFERS)} and its image FusedMoE layers, "
                          "ernie4_5_vl_moe.py:160-170, :409-441): not an ERNIE-4.5-VL model FastDeploy built")
    groups = ExpertGroups(text_experts=counts[0], image_experts=counts[1],
                          token_types=buffers["token_type_ids"], text_index=buffers["text_index"],
                          image_index=buffers["image_index"])
    for layer in images:
        layer.forward = groups.image_call(layer.forward)
    return groups


def row_assembler(fd_config: Any, model: Any) -> RowAssembler | None:
    """The assembly this deployment needs, or None when the hook's ids are the rows already."""
    parallel = fd_config.parallel_config
    chunked = bool(getattr(parallel, "use_ep", False) and getattr(parallel, "enable_chunked_moe", False))
    found = RowAssembler(placement=placement(fd_config, model), groups=expert_groups(fd_config, model),
                         chunks=MoEChunks() if chunked else None)
    if found.placement is None and found.groups is None and found.chunks is None:
        return None
    return found
