"""docs/trainer.md's examples run as written, in order, as one script.

The PaddleFormers section's examples need PaddleFormers, which runs in its own environment
(.venv-paddle, `make trainer-paddle`): tests/trainers/paddle/test_paddle_doc.py runs them
there, after this page's first example (the records they read); this file runs the rest.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
PADDLE_SECTION = "PaddleFormers (Paddle trainers)"


def doc_blocks() -> list[tuple[str, str]]:
    """``(section heading, code)`` of every ```python block of the page, in order."""
    found = []
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        heading = section.splitlines()[0].strip()
        found += [(heading, code) for code in re.findall(r"```python\n(.*?)```", section,
                                                        flags=re.S)]
    return found


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` with the page's store at ``tmp_path``, in this interpreter, from tmp_path."""
    script = tmp_path / "trainer_doc.py"
    script.write_text(code.replace("local:///tmp/rr", f"local://{tmp_path}") +
                      "\nprint('examples finished')\n")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


def test_trainer_doc_examples_run(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("paddle")
    pytest.importorskip("verl", reason="verl 0.9.1: `make verl-deps` installs it")
    blocks = [code for heading, code in doc_blocks() if heading != PADDLE_SECTION]
    assert len(blocks) >= 7, "docs/trainer.md: setup, NumPy/PyTorch, Megatron, verl, slime, " \
                             "slicing and mismatch examples"
    done = run_script("\n".join(blocks), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("examples finished")


def test_the_paddle_section_has_an_example_for_its_own_test():
    assert any(heading == PADDLE_SECTION for heading, _ in doc_blocks())


def test_readme_links_the_trainer_doc():
    readme = (DOC.parents[1] / "README.md").read_text()
    assert "(docs/trainer.md)" in readme
