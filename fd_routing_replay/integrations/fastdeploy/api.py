"""Which routing replay interface the FastDeploy at hand has, decided by inspection.

FastDeploy has shipped two generations of its R3 interface (see docs/fastdeploy.md):

* ``table`` — 2.5 and develop as of 2026-04: the MoE hook is ``save_routing_to_buffer(
  routing_replay_table, topk_ids, batch_id_per_token, seq_lens_decoder, cu_seqlens_q,
  layer_idx, tp_size, ep_size, tp_group)`` and the runner drives a request-level manager
  (``register_request``, ``get_token_positions``, ``put_finished_batch``, ...).
* ``step-buffer`` — 2.6: the hook is ``save_routing_to_buffer_v2(device_routing_buffer,
  topk_ids, layer_idx, tp_size, ep_size, tp_group, total_token_num, position_ids,
  debug_mode)`` and the runner drives a step capturer (``get_device_routing_buffer``,
  ``prepare_pending_save``, ``flush_pending_save``, ``clear``); records are assembled on
  the engine side when a request finishes.

Nothing is guessed from version strings: the hook's parameter names are read with
:mod:`inspect`, and the members FastDeploy's runner and post-processing use on the
manager are read from their source with :mod:`ast`.  Anything else is refused at start-up
with a message naming the FastDeploy version found.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from fd_routing_replay.errors import ConfigError

__all__ = ["TABLE", "STEP_BUFFER", "FastDeployR3API", "detect_api", "manager_members_used",
           "fastdeploy_version", "check_manager_covers"]

TABLE = "table"
STEP_BUFFER = "step-buffer"

CACHE_MODULE = "fastdeploy.model_executor.layers.moe.routing_indices_cache"
MOE_MODULE = "fastdeploy.model_executor.layers.moe.moe"
RUNNER_MODULE = "fastdeploy.worker.gpu_model_runner"
POSTPROCESS_MODULE = "fastdeploy.model_executor.pre_and_post_process"

_HOOKS = {
    TABLE: ("save_routing_to_buffer",
            ("routing_replay_table", "topk_ids", "batch_id_per_token", "seq_lens_decoder",
             "cu_seqlens_q", "layer_idx", "tp_size", "ep_size", "tp_group")),
    STEP_BUFFER: ("save_routing_to_buffer_v2",
                  ("device_routing_buffer", "topk_ids", "layer_idx", "tp_size", "ep_size",
                   "tp_group", "total_token_num", "position_ids", "debug_mode")),
}


@dataclass(frozen=True)
class FastDeployR3API:
    """The detected interface: generation, the hook's name and FastDeploy's own hook."""

    generation: str
    hook_name: str
    original_hook: Any
    fastdeploy_version: str
    members_used: frozenset[str] | None = None   # filled by with_members_used()

    def with_members_used(self) -> FastDeployR3API:
        """A copy knowing which manager members FastDeploy's runner code uses."""
        from dataclasses import replace

        return replace(self, members_used=frozenset(manager_members_used(runner_sources())))


def fastdeploy_version() -> str:
    """FastDeploy's version string, or a description of where it was imported from."""
    try:
        import fastdeploy
    except ImportError:
        return "not importable"
    version = getattr(fastdeploy, "__version__", None)
    if version and version != "0.0.0":
        return str(version)
    return f"unknown version at {getattr(fastdeploy, '__path__', ['?'])[0]}"


def _parameters(fn: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def detect_api(cache_module: ModuleType | None = None, moe_module: ModuleType | None = None) -> FastDeployR3API:
    """Decide the R3 generation of the imported FastDeploy, or raise :class:`ConfigError`.

    The MoE module's global is what ``FusedMoE.forward`` binds at call time, so its
    signature decides; the routing cache module must define the same function.
    """
    import importlib

    if cache_module is None or moe_module is None:
        try:
            cache_module = cache_module or importlib.import_module(CACHE_MODULE)
            moe_module = moe_module or importlib.import_module(MOE_MODULE)
        except ImportError as exc:
            raise ConfigError(f"fd-routing-replay cannot import FastDeploy's MoE routing modules "
                              f"(FastDeploy {fastdeploy_version()}): {exc}") from exc
    found = []
    for generation, (name, params) in _HOOKS.items():
        fn = getattr(moe_module, name, None)
        if fn is None:
            continue
        got = _parameters(fn)
        found.append(f"{name}{got}")
        if got[:len(params)] == params:
            if getattr(fn, "fdrr_hook", False):      # already rebound: FastDeploy's is the fallback
                from fd_routing_replay.capture.device import fallback

                fn = fallback(name)
            return FastDeployR3API(generation, name, fn, fastdeploy_version())
    raise ConfigError(
        f"fd-routing-replay does not support the routing replay interface of FastDeploy "
        f"{fastdeploy_version()}: {MOE_MODULE} has "
        f"{', '.join(found) if found else 'neither save_routing_to_buffer nor save_routing_to_buffer_v2'}; "
        "supported: FastDeploy 2.5 / develop-2026-04 (save_routing_to_buffer) and 2.6 "
        "(save_routing_to_buffer_v2). Disable the plugin (unset FD_PLUGINS) or upgrade fd-routing-replay.")


class _ManagerUses(ast.NodeVisitor):
    """Collects ``X`` in ``<...>.routing_replay_manager.X`` and ``routing_replay_manager.X``."""

    def __init__(self) -> None:
        self.members: set[str] = set()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if (isinstance(value, ast.Attribute) and value.attr == "routing_replay_manager") or (
                isinstance(value, ast.Name) and value.id == "routing_replay_manager"):
            self.members.add(node.attr)
        self.generic_visit(node)


def manager_members_used(sources: Iterable[str]) -> set[str]:
    """Members FastDeploy's code reads or calls on its routing replay manager."""
    visitor = _ManagerUses()
    for source in sources:
        visitor.visit(ast.parse(source))
    return visitor.members


def runner_sources(modules: Iterable[ModuleType] | None = None) -> list[str]:
    """Source text of FastDeploy's GPU runner and post-processing modules."""
    import importlib

    if modules is None:
        modules = [importlib.import_module(RUNNER_MODULE), importlib.import_module(POSTPROCESS_MODULE)]
    return [inspect.getsource(m) for m in modules]


def check_manager_covers(manager: Any, used: set[str]) -> None:
    """Refuse a manager that lacks a member FastDeploy uses (named, with the version)."""
    missing = sorted(name for name in used if not hasattr(manager, name))
    if missing:
        raise ConfigError(
            f"FastDeploy {fastdeploy_version()} uses {', '.join(missing)} on the routing replay "
            f"manager, which {type(manager).__name__} lacks; this FastDeploy is not supported by "
            "this fd-routing-replay version")
