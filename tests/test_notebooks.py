"""The Colab notebooks (colab/*.ipynb) run top to bottom in their small mode.

Each notebook is executed with nbclient in a fresh kernel running this
interpreter (so the venv's jaxcomp: the notebooks' install cell is skipped),
with ``JAXCOMP_NOTEBOOK_SMALL=1`` (each shrinks to a CPU run of seconds) and 2
simulated CPU devices (the quickstart's data-parallel path really exchanges);
any cell error fails the test. The committed files must be valid nbformat 4
with their outputs stripped.
"""

import json
import os
import pathlib
import re
import sys

import nbformat
import pytest
from helpers import compile_flags_without_devices
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "colab").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds; the 2 cores are shared with the rest of the suite
DEVICES = 2


def _read(name):
    return nbformat.read(ROOT / "colab" / name, as_version=4)


def _kernel_dir(tmp_path):
    """A ``python3`` kernelspec running this interpreter, first on JUPYTER_PATH.

    Whatever ``python3`` kernels the user or the system have (another Python,
    no jaxcomp), the notebooks run in the venv that runs the tests; nothing
    needs installing on a fresh clone.
    """
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3 (test)", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return tmp_path / "jupyter"


def _kernel_env():
    env = dict(os.environ)
    flags = compile_flags_without_devices()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAXCOMP_NOTEBOOK_SMALL"] = "1"
    # The kernel picks its inline backend; a backend forced by the caller would not show plots.
    env.pop("MPLBACKEND", None)
    return env


def test_notebooks_found():
    assert {"quickstart.ipynb", "selection_benchmark.ipynb", "cifar_resnet20.ipynb"} <= set(
        NOTEBOOKS
    )
    assert "reproduce.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_valid_and_stripped(name):
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (name, cell.source[:60])
    # Thin: the notebooks drive the library and the experiments package.
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "jaxcomp" in source and "experiments" in source
    # The install cell must be skipped where jaxcomp is importable.
    assert 'find_spec("jaxcomp") is None' in nb.cells[1].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_small_mode(name, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_dir(tmp_path)))
    # Connection files and IPython's profile in the test's directory, not $HOME.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = _read(name)
    # Which Python and jaxcomp ran the notebook: this interpreter and this checkout's
    # package, not one the install cell fetched.
    probe = "import sys\n\nimport jaxcomp\n\nprint(sys.executable)\nprint(jaxcomp.__file__)"
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    work = tmp_path / "cwd"  # results/ and data the notebook writes land here
    work.mkdir()
    client = NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(work)}}
    )
    client.execute(env=_kernel_env())  # raises CellExecutionError on any cell error

    code = [cell for cell in nb.cells if cell.cell_type == "code"]

    def printed(cell):
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    executable, package = printed(code[-1]).split()
    assert pathlib.Path(executable).resolve() == pathlib.Path(sys.executable).resolve()
    assert pathlib.Path(package).resolve().is_relative_to(ROOT)
    if name == "quickstart.ipynb":
        # The data-parallel path ran on every device the kernel had.
        setup = next(cell for cell in code if cell.get("id") == "setup")
        assert f"{DEVICES} devices:" in printed(setup)
    # Every cell that shows a plot (a call at the start of a line) displayed a PNG.
    plotting = [c for c in code if re.search(r"^(show|plt\.show|display)\(", c.source, re.M)]
    assert plotting, name
    for cell in plotting:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), (name, cell.source)
