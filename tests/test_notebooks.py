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
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        return "needs the python3 Jupyter kernel (ipykernel installed in this environment)"
    return None


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_paged_stash_explained.ipynb", "02_memory_timeline.ipynb",
            "03_overflow_and_recovery.ipynb", "04_offload_and_swap.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: committed with outputs; clear them before saving"
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
