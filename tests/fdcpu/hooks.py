"""Post-import hooks: run a function on a module right after it is first imported.

The CPU stand-ins must be in place before FastDeploy's modules bind them (``from
fastdeploy.model_executor.ops.gpu import update_inputs_v1`` at import time,
pre_and_post_process.py:87-108), and the CUDA presentation must be set before the first
``current_platform`` lookup.  A finder placed first on ``sys.meta_path`` lets the other
finders locate each hooked module as usual and wraps its loader, so the hook runs once the
module's own code has run and before any importer sees it.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["PostImportHooks", "install_hooks"]

Hook = Callable[[ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, hooks: list[Hook]) -> None:
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:          # get_source, is_package, ...
        return getattr(self._loader, name)


class PostImportHooks(importlib.abc.MetaPathFinder):
    """Finder that wraps the loaders of the modules named in ``hooks``."""

    def __init__(self, hooks: dict[str, list[Hook]]) -> None:
        self.hooks = hooks
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        hooks = self.hooks.get(fullname)
        if not hooks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _HookedLoader(spec.loader, hooks)
                    return spec
            return None
        finally:
            self._busy.name = None


def install_hooks(hooks: dict[str, list[Hook]]) -> PostImportHooks:
    """Put a :class:`PostImportHooks` first on ``sys.meta_path``; a module already imported
    gets its hooks at once."""
    finder = PostImportHooks(hooks)
    sys.meta_path.insert(0, finder)
    for name, module_hooks in hooks.items():
        module = sys.modules.get(name)
        if module is not None:
            for hook in module_hooks:
                hook(module)
    return finder
