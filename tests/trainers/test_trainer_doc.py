"""docs/trainer.md's examples run as written, in order, as one script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"


def test_trainer_doc_examples_run(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("paddle")
    pytest.importorskip("verl", reason="verl 0.9.1: `make verl-deps` installs it")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 7, "docs/trainer.md: setup, NumPy/PyTorch, Megatron, verl, slime, " \
                             "slicing and mismatch examples"
    code = "\n".join(blocks).replace("local:///tmp/rr", f"local://{tmp_path}")
    script = tmp_path / "trainer_doc.py"
    script.write_text(code + "\nprint('examples finished')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("examples finished")


def test_readme_links_the_trainer_doc():
    readme = (DOC.parents[1] / "README.md").read_text()
    assert "(docs/trainer.md)" in readme
