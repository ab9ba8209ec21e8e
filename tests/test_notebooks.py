"""The notebooks as stored: executed in order, without errors, and checked by nbval.

`pytest --nbval notebooks` re-runs every notebook and compares each cell's output with the
stored one; these tests make sure there is something real to compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["00_launch", "01_ddp_memory", "02_collectives", "03_zero1", "04_zero2", "05_zero3",
            "06_fsdp2", "07_scaling", "08_activations", "09_past_one_node", "10_bytes_to_seconds"]
IGNORE_MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")


def code_cells(path: Path) -> list[dict]:
    cells = json.loads(path.read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def test_the_course_has_its_notebooks():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_was_executed_in_order(path):
    counts = [c["execution_count"] for c in code_cells(path)]
    assert None not in counts, f"{path.name}: unexecuted code cells"
    assert counts == sorted(counts) and len(set(counts)) == len(counts), (
        f"{path.name}: outputs out of order {counts}")
    assert counts[0] == 1, f"{path.name}: not run from a fresh kernel"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_errors(path):
    for cell in code_cells(path):
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", (path.name, "".join(cell["source"])[:80])
            if output.get("name") == "stderr":
                raise AssertionError(f"{path.name}: stderr output {''.join(output['text'])[:200]}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_most_outputs_are_compared(path):
    """Ignore-markers only where output truly varies: at most a third of the code cells."""
    cells = code_cells(path)
    ignored = [c for c in cells if any(m in "".join(c["source"]) for m in IGNORE_MARKERS)]
    assert len(ignored) * 3 <= len(cells), f"{path.name}: {len(ignored)} of {len(cells)} ignored"
    compared_outputs = sum(1 for c in cells if c not in ignored and c.get("outputs"))
    assert compared_outputs >= 3, f"{path.name}: too few compared outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_worker_function_is_defined_in_a_cell(path):
    """Spawned ranks cannot import a notebook's functions: workers live in the package."""
    for cell in code_cells(path):
        source = "".join(cell["source"])
        assert not any(line.startswith("def ") for line in source.splitlines()), (
            path.name, source[:80])
