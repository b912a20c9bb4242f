"""CUDA C sources of graphstash's kernels, shipped as package data.

Nothing here compiles anything: :mod:`graphstash._kernels` reads the files. The numbers the
launchers share with the sources (the tunables of ``gs_tunables.cuh``, a kernel's block of
elements or chunk of pairs) are read from the sources with :func:`int_defines`, so each is
written once, in the ``.cu`` or ``.cuh`` file that uses it.

NOTE [kernel names]: an entry point is ``gs_<concern>_<op>`` followed by what tells its
variants apart, in this order, each part only where the kernel has variants of that kind:

- ``_<type>``: the element type it computes in (``bf16``, ``f16``, ``f32``, ``f64``) or the
  index type it reads (``i32``, ``i64``); kernels that only move bytes have none;
- ``_g<0|1|2>``: plain, gated (gate rows, then up rows) or gated with interleaved gate and
  up rows expert activation;
- ``_v<W>``: each thread loads and stores ``W`` contiguous bytes at a time, where ``W`` is
  the widest the launcher could pick for the row width and every base address (16-byte
  vectors, 8-element packs: ``W`` = 16, 32, 64) or the element size when it goes element
  by element.

So ``gs_stash_v16``, ``gs_moe_combine_bf16_v2``, ``gs_expert_act_bwd_f32_g1_v32``,
``gs_route_place_i64``. ``tests/test_kernels_compile.py`` checks every name.
"""
from pathlib import Path
import re

KERNEL_DIR = Path(__file__).resolve().parent
TUNABLES_HEADER = "gs_tunables.cuh"

_DEFINE = re.compile(r"^[ \t]*#define[ \t]+GS_([A-Z0-9_]+)[ \t]+(-?\d+)\b", re.MULTILINE)


def source_path(name: str) -> Path:
    """Path of the kernel source ``name`` (e.g. ``"paged_stash.cu"``) in this package."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} is not in {KERNEL_DIR}")
    return path


def int_defines(name: str) -> dict[str, int]:
    """``{NAME: value}`` of the ``#define GS_NAME <integer>`` lines of the source ``name``
    (those inside ``#ifndef`` guards included: they are the defaults). Raises ValueError if a
    name is defined twice with different values."""
    found: dict[str, int] = {}
    for key, value in _DEFINE.findall(source_path(name).read_text()):
        if key in found and found[key] != int(value):
            raise ValueError(f"{name}: GS_{key} is defined as {found[key]} and as {value}")
        found[key] = int(value)
    return found
