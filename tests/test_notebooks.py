"""Execute every notebook in notebooks/ headless, top to bottom (on the CPU: reduced sizes,
reference backend; on a GPU: the real kernels and CUDA graphs)."""
from __future__ import annotations

import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _missing() -> str | None:
    for module in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        try:
            __import__(module)
        except ImportError:
            return (f"needs {module} to execute the notebooks (pip install -e '.[dev]' "
                    "installs it)")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel  # noqa: I001

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        return "needs the python3 Jupyter kernel (ipykernel installed in this environment)"
    return None


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_paged_stash_explained.ipynb", "02_memory_timeline.ipynb",
            "03_overflow_and_recovery.ipynb", "04_offload_and_swap.ipynb"} <= names


def _run_in_process(path: pathlib.Path, tmp_path: pathlib.Path, monkeypatch) -> None:
    """Execute the code cells top to bottom in this interpreter (no Jupyter kernel needed).

    Used where nbclient/ipykernel are not installed but matplotlib is (e.g. a GPU machine
    without Jupyter): the same code runs, only outside a kernel. ``IPython.display`` is
    stubbed if IPython itself is missing.
    """
    import json
    import sys
    import types

    import matplotlib

    matplotlib.use("Agg")
    try:
        import IPython.display  # noqa: F401
    except ImportError:
        display_mod = types.ModuleType("IPython.display")
        display_mod.display = lambda *a, **k: None
        display_mod.Image = lambda *a, **k: None
        ipython = types.ModuleType("IPython")
        ipython.display = display_mod
        ipython.get_ipython = lambda: None      # matplotlib asks whether it runs in IPython
        ipython.version_info = (0, 0, 0)
        monkeypatch.setitem(sys.modules, "IPython", ipython)
        monkeypatch.setitem(sys.modules, "IPython.display", display_mod)
    monkeypatch.chdir(tmp_path)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        assert not cell.get("outputs"), f"{path.name}: committed with outputs; clear them"
        code = "".join(cell["source"])
        exec(compile(code, f"{path.name}[code cell {i}]", "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    reason = _missing()
    if reason is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pytest.skip(reason)
        _run_in_process(path, tmp_path, monkeypatch)
        return
    import os

    import nbformat
    from nbclient import NotebookClient

    # the kernel imports graphstash from this checkout, not from wherever it is installed
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))

    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: committed with outputs; clear them before saving"
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
