"""CUDA C sources of graphstash's kernels, shipped as package data.

Nothing here compiles anything: :mod:`graphstash._kernels` reads the files.
"""
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent


def source_path(name: str) -> Path:
    """Path of the kernel source ``name`` (e.g. ``"paged_stash.cu"``) in this package."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} is not in {KERNEL_DIR}")
    return path
