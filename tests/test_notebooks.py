"""The tutorial notebooks run top to bottom.

The jupytext percent-format ``.py`` files in ``notebooks/`` are the source of truth: each is
converted to a notebook in memory and executed with nbclient in a fresh ``python3`` kernel
(registered for the current interpreter if no such kernel exists). Every notebook checks its
own results with ``assert`` cells (e.g. speculative output equals greedy output), so a wrong
result fails the test, not only an exception. The kernel runs in a temporary folder and the
notebooks write no figures unless ``EAGLEPANGU_NOTEBOOK_PLOTS`` names a folder, so a test run
leaves no files behind.

Notebooks 02-04 load the real SmolLM2 teacher and are marked slow.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "python3"
# Per-cell limit, generous: the slowest cell (several teacher compilations) took about three
# minutes on two heavily shared cores.
CELL_TIMEOUT_S = 900
FAST = ["01_tree_tensors_and_masks"]  # no weights needed
SLOW = ["02_path_scores_and_budget", "03_speculative_decoding_live", "04_budget_sweep"]


def _ensure_kernel() -> None:
    """Register a ``python3`` kernel for this interpreter if Jupyter knows none."""
    from jupyter_client.kernelspec import KernelSpecManager

    if KERNEL in KernelSpecManager().find_kernel_specs():
        return
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--user", "--name", KERNEL],
        check=True,
        capture_output=True,
    )


def run_notebook(name: str, workdir: Path) -> float:
    """Execute ``notebooks/<name>.py``; returns the wall time in seconds."""
    _ensure_kernel()
    notebook = jupytext.read(NOTEBOOKS / f"{name}.py")
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """The kernel inherits this process's environment: default mode, no figure output."""
    monkeypatch.delenv("EAGLEPANGU_MODE", raising=False)
    monkeypatch.delenv("EAGLEPANGU_NOTEBOOK_PLOTS", raising=False)
    return tmp_path


def test_every_notebook_is_collected():
    names = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert names == sorted(FAST + SLOW)


@pytest.mark.parametrize("name", FAST)
def test_notebook_runs(name, clean_env):
    run_notebook(name, clean_env)
    assert not any(clean_env.iterdir()), "the notebook wrote files without being asked to"


@pytest.mark.parametrize(
    "name",
    # The real-model notebooks cost minutes of compiling each: `make test-all` runs them,
    # `make test` runs notebook 01 (no weights) only.
    [pytest.param(n, marks=pytest.mark.slow) for n in SLOW],
)
def test_real_model_notebook_runs(name, clean_env):
    run_notebook(name, clean_env)
    assert not any(clean_env.iterdir()), "the notebook wrote files without being asked to"
