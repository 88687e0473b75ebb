"""The README's example runs as written (against a temporary directory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from fd_routing_replay.store.local import LocalStore

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "README should hold exactly one Python example"
    code = blocks[0].replace("local:///tmp/rr", f"local://{tmp_path}")
    assert f"local://{tmp_path}" in code
    script = tmp_path / "readme_example.py"
    script.write_text(code + "\nprint('example finished')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("example finished")
    assert LocalStore(tmp_path, "routing_replay").list() == []  # it deleted what it wrote
    assert (tmp_path / "routing_replay").is_dir()                 # after writing there
