"""The rules the code is written to (zerolab/DESIGN.md), checked on the source, no process run.

- no file over 500 lines; the stage files (ddp.py -> zero1.py -> zero2.py -> zero3.py) under 250,
  each opening with what changes from the stage before;
- no module of zerolab imports another's underscore name: what crosses a module boundary is that
  module's public API, named without the underscore.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("zerolab", "tests", "solutions")
                 for p in (REPO / folder).rglob("*.py"))
STAGES = ["ddp.py", "zero1.py", "zero2.py", "zero3.py"]


def test_no_file_is_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in SOURCES
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


@pytest.mark.parametrize("name", STAGES)
def test_stage_files_are_short_and_open_with_what_changes(name):
    path = REPO / "zerolab" / name
    assert len(path.read_text().splitlines()) < 250
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    if name != "ddp.py":  # DDP is the first stage: nothing before it
        before = STAGES[STAGES.index(name) - 1]
        assert doc.split("\n\n")[1].startswith("What changes from") \
            and f"({before}):" in doc.split("\n\n")[1].splitlines()[0], doc[:300]


def private_imports(path: Path) -> list[str]:
    """`from zerolab.x import _name` in `path`, as "line N: zerolab.x._name"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerolab"):
            found += [f"line {node.lineno}: {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name(tmp_path):
    found = {str(p.relative_to(REPO)): names for p in SOURCES
             if p.parts[len(REPO.parts)] == "zerolab" and (names := private_imports(p))}
    assert not found, found
    # The check itself sees one.
    sample = tmp_path / "sample.py"
    sample.write_text("from zerolab.grading.check import load_module, _hidden\n")
    assert private_imports(sample) == ["line 1: zerolab.grading.check._hidden"]
