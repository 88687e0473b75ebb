"""The plugin's log lines in FastDeploy's engine process reach FastDeploy's engine log.

Found by the live rig (tests/live): a real server's engine never showed the line docs/fastdeploy.md
tells operators to look for (``engine-side routing assembly ready``), because the plugin's
logger had handlers only where the runner plugin attached the worker's."""

from __future__ import annotations

import logging
import os
from pathlib import Path


def test_token_processor_plugin_routes_the_plugins_lines_to_fastdeploys_engine_log(env):
    from fd_routing_replay.integrations.fastdeploy import token_processor_plugin

    token_processor_plugin()
    logging.getLogger("fd_routing_replay.integrations.fastdeploy.engine").info(
        "fd-routing-replay: engine probe line 5172")
    for handler in logging.getLogger("fd_routing_replay").handlers:
        handler.flush()
    engine_logs = [p for p in Path(os.environ["FD_LOG_DIR"]).rglob("fastdeploy.log*") if p.is_file()]
    assert engine_logs, f"FastDeploy wrote no fastdeploy.log under {os.environ['FD_LOG_DIR']}"
    assert any("engine probe line 5172" in p.read_text(errors="replace") for p in engine_logs)
