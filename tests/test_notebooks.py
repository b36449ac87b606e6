"""The notebooks (notebooks/*.ipynb) run top to bottom, and are committed without outputs.

Each notebook is executed with nbclient in a fresh Python kernel (a temporary working directory), after its
"parameters"-tagged cell is replaced papermill-style to pin the small (CPU) preset; any cell error fails the
test. The quickstart loads the real SmolLM2 and its shipped drafter and starts the real server, so these are
slow-marked (they still run in CI).
"""

from __future__ import annotations

import glob
import os
import time

import nbformat
import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          "notebooks", "*.ipynb")))
CI_PARAMETERS = 'PRESET = "small"  # injected by tests/test_notebooks.py'


def _parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "each notebook needs exactly one cell tagged 'parameters'"
    return cells[0]


def test_there_are_notebooks():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "train_a_drafter.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"cell {i} of {path} has outputs"
    assert "PRESET" in _parameters_cell(nb).source


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    _parameters_cell(nb).source = CI_PARAMETERS
    t0 = time.perf_counter()
    # Per-cell timeout: the slowest cell (bucket compilation at server start, or the training run) on 2 CPU cores.
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    print(f"\n{os.path.basename(path)}: {time.perf_counter() - t0:.0f} s\n{text[-3000:]}")
    assert "preset 'small'" in text
