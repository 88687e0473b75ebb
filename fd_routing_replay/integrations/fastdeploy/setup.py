"""What the plugin reads from FastDeploy's ``FDConfig``: our config, the capture geometry,
the MoE layer map, and the setups that are refused.

Pure functions over attribute access: they import neither FastDeploy nor Paddle, so the
contract tier runs them on FastDeploy's real ``FDConfig`` objects and the unit tests on
plain namespaces.  File:line references are to ``../shared/fastdeploy/2.6``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fd_routing_replay.errors import ConfigError

__all__ = ["FASTDEPLOY_DEFAULTS", "check_supported", "config_from_fastdeploy_config",
           "architecture_of", "engine_rank_identity", "expert_groups_of", "geometry_from_fastdeploy_config", "moe_layer_map",
           "moe_layer_offset", "rank_identity", "record_metadata", "top_k_of", "tp_size",
           "verification_code"]

FASTDEPLOY_DEFAULTS: dict[str, Any] = {
    "routing_store_type": "local",
    "local_store_dir": "./routing_replay_output",
    "rdma_store_server": "",
    "only_last_turn": False,
    "use_fused_put": False,
}
"""FastDeploy's ``RoutingReplayConfig`` defaults (config.py:1841-1858); a flat key at its
default does not override our YAML."""

RESPONSE_MODE = "response"


def config_from_fastdeploy_config(fd_config: Any, *, env: Mapping[str, str] | None = None) -> Any:
    """Our :class:`RoutingReplayConfig` for a FastDeploy ``FDConfig``.

    Precedence: defaults < ``FD_ROUTING_REPLAY_CONFIG`` YAML < ``FD_RR_*`` variables <
    FastDeploy's flat keys that differ from FastDeploy's defaults.  ``enabled`` is always
    FastDeploy's ``enable_routing_replay``.  ``routing_store_type: response`` (2.6) keeps
    the store settings of the YAML: records travel in the response instead.
    """
    from fd_routing_replay.config import config_from_fastdeploy, load_config

    rr = getattr(fd_config, "routing_replay_config", None)
    flat: dict[str, Any] = {"enable_routing_replay": bool(getattr(rr, "enable_routing_replay", False))}
    for key, default in FASTDEPLOY_DEFAULTS.items():
        value = getattr(rr, key, default)
        if key == "routing_store_type" and value == RESPONSE_MODE:
            continue
        if value is not None and value != "None" and value != default:
            flat[key] = value
    return load_config(overrides=config_from_fastdeploy(flat, source="FastDeploy --routing-replay-config"),
                       env=os.environ if env is None else env)


def return_mode(fd_config: Any) -> str:
    """``local`` / ``rdma`` (records go to our store) or ``response`` (2.6: in the response)."""
    rr = getattr(fd_config, "routing_replay_config", None)
    return str(getattr(rr, "routing_store_type", "local") or "local")


def top_k_of(model_config: Any) -> int:
    """Experts per token, read as FastDeploy reads it (config.py:1877-1880)."""
    architectures = list(getattr(model_config, "architectures", None) or [""])
    if architectures[0] == "Glm4MoeForCausalLM":
        return int(model_config.num_experts_per_tok)
    for name in ("moe_k", "num_experts_per_tok"):
        value = getattr(model_config, name, None)
        if value:
            return int(value)
    raise ConfigError("cannot find the MoE top-k in the model config (moe_k / num_experts_per_tok)")


def _count(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"model config {name} must be an int or a list of ints, got {value!r}")
    return int(value)


def _int_field(model: Any, name: str, default: int | None = None) -> int | None:
    value = getattr(model, name, default)
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and name == "moe_layer_end_index" and len(set(value)) == 1:
        value = value[0]          # ERNIE-4.5-VL: one end for the text and the image MoE
    if isinstance(value, (list, tuple)):
        raise ConfigError(
            f"routing replay does not support a list-valued model config {name} ({value!r}) of "
            f"{architecture_of(model)}: " + (
                "FastDeploy's FusedMoE.forward subtracts it from the layer index to bind the "
                "routing hook (moe.py:748 in 2.6, :701 in 2.5), which fails for a list"
                if name == "moe_layer_start_index" else
                "its text and image MoE layers differ, and a record has one layer map"))
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"model config {name} must be an int, got {value!r}")
    return value


def architecture_of(model_config: Any) -> str:
    """The model's architecture name (``architectures[0]``), for messages."""
    names = list(getattr(model_config, "architectures", None) or ["this model"])
    return str(names[0])


def expert_groups_of(model_config: Any) -> tuple[int, int] | None:
    """``(text experts, image experts)`` of a model with per-modality expert groups
    (ERNIE-4.5-VL: ``moe_num_experts: [text, image]``, ernie4_5_vl_moe.py:161-165), else None."""
    value = getattr(model_config, "moe_num_experts", None)
    if not isinstance(value, (list, tuple)) or len(value) == 1:
        return None
    if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ConfigError(f"routing replay supports moe_num_experts as an int or [text, image] "
                          f"(ERNIE-4.5-VL); {architecture_of(model_config)} has {value!r}")
    return int(value[0]), int(value[1])


def record_metadata(fd_config: Any) -> dict[str, Any]:
    """What every record of this deployment says about its expert ids (docs/record-format.md):
    ``expert_groups`` for a model with per-modality expert groups (one id space, the image
    experts after the text experts), ``eplb_redundant_experts`` under EPLB (the ids are
    logical experts all the same)."""
    out: dict[str, Any] = {}
    groups = expert_groups_of(fd_config.model_config)
    if groups is not None:
        out["expert_groups"] = [{"name": "text", "first": 0, "count": groups[0]},
                                {"name": "image", "first": groups[0], "count": groups[1]}]
    eplb = getattr(fd_config, "eplb_config", None)
    if getattr(eplb, "enable_eplb", False):
        out["eplb_redundant_experts"] = int(getattr(eplb, "redundant_experts_num", 0) or 0)
    return out


def moe_layer_map(model_config: Any) -> tuple[int, ...]:
    """Global decoder-layer index of every MoE layer, the way each model defines its MoE layers.

    * Qwen3-MoE: layer ``i`` is MoE unless in ``mlp_only_layers`` and when
      ``(i + 1) % decoder_sparse_step == 0`` (models/qwen3moe.py:155-159).
    * DeepSeek-V3 / GLM-4.5: layers from ``first_k_dense_replace`` (models/deepseek_v3.py:979);
      FastDeploy remaps ``moe_layer_start_index`` only for GLM (config.py:2155-2157).
    * ERNIE 4.5 and others: layers from ``moe_layer_start_index`` (models/ernie4_5_moe.py:74)
      to ``moe_layer_end_index`` when set.
    """
    num_layers = _int_field(model_config, "num_hidden_layers")
    if not num_layers or num_layers <= 0:
        raise ConfigError(f"model config num_hidden_layers must be a positive int, got {num_layers!r}")
    start = _int_field(model_config, "moe_layer_start_index", 0) or 0
    step = _int_field(model_config, "decoder_sparse_step")
    if step is not None and step > 0 and hasattr(model_config, "mlp_only_layers"):
        dense = set(getattr(model_config, "mlp_only_layers", None) or ())
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    else:
        first_dense = _int_field(model_config, "first_k_dense_replace")
        if first_dense is not None and first_dense > start:
            start = first_dense
        end = _int_field(model_config, "moe_layer_end_index")
        last = num_layers - 1 if end is None or end < 0 else min(end, num_layers - 1)
        layers = tuple(range(start, last + 1))
    if not layers:
        raise ConfigError(f"the model config defines no MoE layer (num_hidden_layers={num_layers}, "
                          f"moe_layer_start_index={start}); routing replay needs a MoE model")
    return layers


def fastdeploy_layer_rows(model_config: Any, layer_map: tuple[int, ...]) -> tuple[int, ...]:
    """Row of our buffer for each FastDeploy ``layer_idx`` (global − moe_layer_start_index).

    FastDeploy passes ``self.layer_idx - moe_layer_start_index`` (moe.py:748); rows of
    layers that are not MoE are -1.
    """
    start = _int_field(model_config, "moe_layer_start_index", 0) or 0
    size = layer_map[-1] - start + 1
    rows = [-1] * max(size, 0)
    for row, layer in enumerate(layer_map):
        if layer - start >= 0:
            rows[layer - start] = row
    return tuple(rows)


def moe_layer_offset(model_config: Any) -> int:
    """What FastDeploy subtracts from a decoder layer's index to make the hook's
    ``layer_idx`` (``moe_layer_start_index``, moe.py:748)."""
    return _int_field(model_config, "moe_layer_start_index", 0) or 0


def tp_size(fd_config: Any) -> int:
    """The TP group's size (the ranks a TP x EP all-gather joins)."""
    return max(int(getattr(fd_config.parallel_config, "tensor_parallel_size", 1) or 1), 1)


def verification_code(fd_config: Any, config: Any) -> Any:
    """The :class:`VerificationCode` of this deployment when ``capture.verify`` is on, else None."""
    if not config.capture.verify:
        return None
    from fd_routing_replay.codec.verification import VerificationCode

    model = fd_config.model_config
    return VerificationCode(_count(model.moe_num_experts, "moe_num_experts"), top_k_of(model),
                            len(moe_layer_map(model)), tp_size(fd_config))


def geometry_from_fastdeploy_config(fd_config: Any, total_block_num: int) -> Any:
    """Capture sizes from an ``FDConfig``, derived the way FastDeploy derives them."""
    from fd_routing_replay.capture.slots import CaptureGeometry

    model = fd_config.model_config
    spec = getattr(fd_config, "speculative_config", None)
    num_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0) if getattr(spec, "method", None) else 0
    layers = moe_layer_map(model)
    return CaptureGeometry(
        max_num_seqs=int(fd_config.scheduler_config.max_num_seqs),
        max_model_len=int(model.max_model_len),
        num_moe_layers=len(layers),
        top_k=top_k_of(model),
        num_experts=_count(model.moe_num_experts, "moe_num_experts"),
        num_shared_experts=_count(getattr(model, "moe_num_shared_experts", 0), "moe_num_shared_experts"),
        block_size=int(fd_config.cache_config.block_size),
        total_block_num=int(total_block_num),
        num_speculative_tokens=num_spec,
        layer_map=layers,
    )


def max_batched_tokens(fd_config: Any) -> int:
    """Rows of the 2.6 step buffer: FastDeploy sizes it with ``get_max_chunk_tokens()``."""
    getter = getattr(fd_config, "get_max_chunk_tokens", None)
    if callable(getter):
        return int(getter())
    return int(fd_config.scheduler_config.max_num_batched_tokens)


def rank_identity(fd_config: Any) -> Any:
    """The :class:`RankIdentity` a writer's journal directory is keyed by (one per writer)."""
    from fd_routing_replay.core.paths import RankIdentity

    parallel = fd_config.parallel_config
    device_ids = str(getattr(parallel, "device_ids", "") or "")
    local_rank = int(getattr(parallel, "tensor_parallel_rank", 0) or 0)
    devices = [d for d in device_ids.split(",") if d.strip()]
    device = int(devices[local_rank]) if local_rank < len(devices) and devices[local_rank].strip().isdigit() else 0
    # The global DP rank: local_data_parallel_id repeats on every node, and a store root on a
    # shared filesystem would then give two nodes' writers one journal.
    return RankIdentity(dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
                        tp_rank=local_rank, device_id=device)


def engine_rank_identity(fd_config: Any) -> Any:
    """The :class:`RankIdentity` of a 2.6 engine process's writer (one engine per DP rank).

    An engine process never gets ``data_parallel_rank`` (a worker-side field, set only in
    worker_process.py:1191): FastDeploy's ``ExpertService`` for DP rank ``i`` of a node sets
    ``local_data_parallel_id = i`` and re-derives its ports and devices
    (expert_service.py:81-84, config.py:2313-2322), each node running ``dp / nnode`` of them
    (engine.py:824-826).  The global DP rank is therefore
    ``node_rank * (dp / nnode) + local_data_parallel_id``, the same number the workers of
    that engine have as ``data_parallel_rank``; without it every engine of a DP deployment
    took the journal of DP rank 0.
    """
    from fd_routing_replay.core.paths import RankIdentity

    parallel = fd_config.parallel_config
    nnode = max(int(getattr(fd_config, "nnode", 1) or 1), 1)
    per_node = max(int(getattr(parallel, "data_parallel_size", 1) or 1) // nnode, 1)
    local = int(getattr(parallel, "local_data_parallel_id", 0) or 0)
    dp_rank = int(getattr(fd_config, "node_rank", 0) or 0) * per_node + local
    devices = [str(d).strip() for d in (getattr(fd_config, "local_device_ids", None) or ())]
    device = int(devices[0]) if devices and devices[0].isdigit() else rank_identity(fd_config).device_id
    return RankIdentity(dp_rank=dp_rank, tp_rank=0, device_id=device)


def routes_moved_by_fastdeploy(fd_config: Any) -> list[str]:
    """The enabled features under which FastDeploy itself moves routing rows along with
    KV blocks (each named with its setting): PD disaggregation, the CPU KV cache, a KV
    cache storage tier."""
    features = []
    role = getattr(fd_config.scheduler_config, "splitwise_role", "mixed")
    if role != "mixed":
        features.append(f"PD disaggregation (splitwise_role={role!r})")
    cache = getattr(fd_config, "cache_config", None)
    swap = getattr(cache, "swap_space", None)
    cpu_blocks = getattr(cache, "num_cpu_blocks", None)
    if (swap not in (None, 0, 0.0)) or (isinstance(cpu_blocks, int) and cpu_blocks > 0):
        features.append(f"the CPU KV cache (swap_space={swap!r}, num_cpu_blocks={cpu_blocks!r})")
    backend = getattr(cache, "kvcache_storage_backend", None)
    if backend not in (None, "", "none", "None"):
        features.append(f"a KV cache storage tier (kvcache_storage_backend={backend!r})")
    return features


def _fastdeploy_view(fd_config: Any) -> tuple[tuple[int, tuple[int, ...]] | None, str]:
    """(FastDeploy's row count and the row of each of our MoE layers in its view, or None
    when the view cannot hold ours; why not)."""
    from fd_routing_replay.codec import routing_dtype

    rr = getattr(fd_config, "routing_replay_config", None)
    model = fd_config.model_config
    layers = moe_layer_map(model)
    ours = (len(layers), top_k_of(model),
            routing_dtype(_count(model.moe_num_experts, "moe_num_experts")
                          + _count(getattr(model, "moe_num_shared_experts", 0), "moe_num_shared_experts")).name)
    theirs = (int(getattr(rr, "num_moe_layers", 0) or 0), int(getattr(rr, "moe_top_k", 0) or 0),
              str(getattr(rr, "routing_dtype", "") or ""))
    start = _int_field(model, "moe_layer_start_index", 0) or 0
    columns = tuple(layer - start for layer in layers)
    if ours[1:] == theirs[1:] and columns and min(columns) >= 0 and max(columns) < theirs[0]:
        return (theirs[0], columns), ""
    return None, (f"FastDeploy sizes that buffer as {theirs[0]} MoE layers x top-{theirs[1]} "
                  f"{theirs[2] or '(unset)'} while this model's routing is {ours[0]} MoE layers x "
                  f"top-{ours[1]} {ours[2]} (layers {list(layers)})")


def fastdeploy_view_mismatch(fd_config: Any) -> str | None:
    """Why FastDeploy 2.6's own views of its routing host buffer could not read our slot
    cache, or None when they can (see :func:`fastdeploy_view_columns`).

    FastDeploy's engine, token processor and cache transfer manager attach to
    ``routing_host_buffer.<worker-queue port>`` as ``[slots, num_moe_layers, moe_top_k]`` in
    ``routing_dtype``, all three from its ``RoutingReplayConfig`` (token_processor.py:150-176,
    common_engine.py:2436-2450, cache_transfer_manager.py:337-391, sized in config.py:1871-1892:
    ``num_hidden_layers - moe_layer_start_index`` rows).  Our slot cache can take that layout
    when the top-k and dtype agree and each of our MoE layers has a row in it
    (``layer - moe_layer_start_index``, the index FastDeploy's hook passes, moe.py:748).
    """
    view, why = _fastdeploy_view(fd_config)
    return None if view is not None else why


def fastdeploy_view_columns(fd_config: Any) -> tuple[int, tuple[int, ...]] | None:
    """FastDeploy's row count and the row of each of our MoE layers in its view of the
    routing host buffer, or None when that view cannot hold our slot cache.

    E.g. DeepSeek-V3 (``first_k_dense_replace`` 3, ``moe_layer_start_index`` 0): FastDeploy's
    view has 61 rows, ours are rows 3..60 and rows 0..2 stay at the fill value.
    """
    return _fastdeploy_view(fd_config)[0]


def check_supported(fd_config: Any, *, generation: str, env: Mapping[str, str] | None = None) -> None:
    """Refuse setups where capture would record wrong data, naming the setting."""
    env = os.environ if env is None else env
    parallel = fd_config.parallel_config
    model = fd_config.model_config
    groups = expert_groups_of(model)
    sharded = int(getattr(parallel, "tensor_parallel_size", 1) or 1) > 1 and \
        int(getattr(parallel, "expert_parallel_size", 1) or 1) > 1
    if getattr(parallel, "enable_chunked_moe", False) and (groups or getattr(parallel, "use_sequence_parallel_moe", False)):
        raise ConfigError(
            "routing replay does not support enable_chunked_moe " + (
                f"with {architecture_of(model)}'s per-modality expert groups" if groups else
                "with TP x EP sequence-parallel MoE (use_sequence_parallel_moe): each rank's chunks "
                "then hold a share of the step's tokens whose size the MoE hook is not told") +
            "; disable chunked MoE")
    if groups and sharded:
        raise ConfigError(f"routing replay does not support {architecture_of(model)}'s per-modality expert "
                          "groups with TP x EP: each rank splits its own share of the tokens into text and "
                          "image, which the MoE hook cannot put back in order; use TP or EP alone")
    moved = routes_moved_by_fastdeploy(fd_config)
    if moved and generation == "table":
        raise ConfigError(
            f"routing replay with FastDeploy 2.5 (its routing-table API) does not support {' or '.join(moved)}: the routing is "
            "kept per GPU KV slot in the worker and FastDeploy 2.5 has no path that moves it with the KV "
            "blocks (to another instance, the CPU or a storage tier); FastDeploy 2.6 has one, which "
            "fd-routing-replay uses")
    if moved:
        mismatch = fastdeploy_view_mismatch(fd_config)
        if mismatch is not None:
            raise ConfigError(
                f"routing replay cannot follow {' or '.join(moved)} for this model: FastDeploy moves "
                f"the routing with the KV blocks through its own view of the routing host buffer, and "
                f"{mismatch}")
    if generation == "table" and str(env.get("FD_PD_REORDER", "0")).strip() not in ("", "0"):
        raise ConfigError(
            "routing replay with FastDeploy 2.5 does not support FD_PD_REORDER=1: the reorder moves "
            "requests between batch slots after the routing table was bound to them; unset FD_PD_REORDER")
    rr = getattr(fd_config, "routing_replay_config", None)
    if getattr(rr, "debug_mode", False):
        raise ConfigError(
            "routing replay: FastDeploy's debug_mode replaces the routing with position ids and is not "
            "supported by fd-routing-replay; its own verification mode checks more, after the store: set "
            "capture.verify: true in the FD_ROUTING_REPLAY_CONFIG YAML (or FD_RR_CAPTURE__VERIFY=true) "
            "and run `fd-rr selftest` (docs/fastdeploy.md, Self-check)")
    mode = return_mode(fd_config)
    if mode not in ("local", "rdma", RESPONSE_MODE):
        raise ConfigError(f"routing_store_type {mode!r} is not one of 'local', 'rdma', 'response'")
    if mode == RESPONSE_MODE and generation == "table":
        raise ConfigError("routing_store_type 'response' needs FastDeploy 2.6 (the engine-side routing "
                          "path); with FastDeploy 2.5 use 'local' or 'rdma'")
    moe_layer_map(model)     # raises on list-valued / missing layer fields
