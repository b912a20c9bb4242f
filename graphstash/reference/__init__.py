"""Pure-torch implementations of graphstash's kernels: the CPU backend and the GPU tests' oracle.

Each function takes the same arguments as its CUDA counterpart in :mod:`graphstash._kernels`
and produces the same bytes, page ids, records and flags.
"""
from . import paged_stash

__all__ = ["paged_stash"]
