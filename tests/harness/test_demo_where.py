"""``python -m fdrr_dev demo`` says where it wrote its records and with which namespace."""

from __future__ import annotations

import json
import re
import shlex

from fd_routing_replay.cli import main as fd_rr
from fdrr_dev.__main__ import main


def test_demo_names_its_store_and_namespace(tmp_path, capsys):
    output = tmp_path / "out dir"          # a space: the printed command must stay usable
    code = main(["demo", "--output", str(output), "--rollouts", "2", "--turns", "1",
                 "--writer-mode", "thread", "--no-plot"])
    out = capsys.readouterr().out
    assert code == 0, out
    store_url = f"local://{output / 'store'}"
    assert re.search(rf"records stored in +\| {re.escape(store_url)} \(namespace demo\)", out)
    line = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert line.startswith(f"wrote 2 record(s) to {store_url}, namespace demo; ")
    command = shlex.split(line.split("list them with: ", 1)[1])
    assert command[:2] == ["fd-rr", "ls"]
    assert fd_rr(command[1:]) == 0
    assert len(capsys.readouterr().out.split()) == 2
    assert json.loads((output / "summary.json").read_text())["namespace"] == "demo"
