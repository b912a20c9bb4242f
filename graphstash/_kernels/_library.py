"""Kernel entry points as ``torch.library`` operators (``torch.ops.graphstash.<name>``).

Every launcher writes into outputs its caller allocated and returns nothing, so each one is
registered as a *mutating* operator: its schema marks the arguments it writes
(``Tensor(a!)``), its CUDA kernel is the CuPy launcher, its CPU kernel the pure-torch
reference (the oracle: same arguments, same values), and its fake (meta) implementation does
nothing, since there is no output to describe. ``torch.compile`` (Dynamo, AOTAutograd,
Inductor) and ``torch.library.opcheck`` then see an ordinary operator instead of a Python
function that reads ``data_ptr()`` (NOTE [kernels as operators]).

The pattern, for a launcher module such as ``graphstash/_kernels/moe.py``::

    from ..reference import moe as _reference
    from ._library import kernel_op

    def _gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        ...  # the launch, as before

    gather_rows = kernel_op("gather_rows", _gather_rows, mutates_args=("out",),
                            cpu=_reference.gather_rows)

The launcher's annotations give the schema (``torch.library.infer_schema``: tensors,
``Tensor | None``, ``int``, ``int | None``, ``bool``, ``float``, ``str``, keyword-only
arguments with defaults), so they must be exact, the return annotation must be ``None``, and
``mutates_args`` must name every tensor the kernel writes. ``cpu`` takes the same arguments
(wrap the reference if its signature differs), or is ``None`` where the oracle is not a
kernel of the same shape (the operator then runs on CUDA only). Registration imports no
CuPy and touches no GPU: the launcher imports CuPy on its first call.

NOTE [kernels as operators]: operators are defined with ``torch.library.Library`` /
``define`` / ``impl`` rather than ``torch.library.custom_op``: the dispatcher calls the
Python kernel directly, while ``custom_op``'s wrapper adds more Python per call than a kernel
launch costs (docs/kernel-tuning.md, "Host time per call"). No autograd formula is registered: the
operators run inside our autograd Functions (``graphstash/moe/_dispatch.py``, ``mlp.py``),
whose backward calls the operators again, and they have no outputs to differentiate.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

NAMESPACE = "graphstash"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _no_outputs(*args, **kwargs) -> None:
    """Fake implementation of an operator that only writes into its arguments."""
    return None


def kernel_op(name: str, launcher: Callable[..., None], *, mutates_args: Iterable[str],
              cpu: Callable[..., None] | None) -> Callable[..., None]:
    """Register ``launcher`` as the CUDA kernel of ``torch.ops.graphstash.<name>``.

    Args:
        name: operator name in the ``graphstash`` namespace (unique).
        launcher: the CuPy launcher; its annotations give the schema, it returns ``None``.
        mutates_args: names of the tensor arguments the kernel writes (all of them).
        cpu: the CPU kernel, same arguments (the reference implementation), or ``None``
            for an operator that runs on CUDA only.

    Returns a function with the launcher's signature and docstring that calls the operator.
    Example::

        gather_rows = kernel_op("gather_rows", _gather_rows, mutates_args=("out",),
                                cpu=_reference.gather_rows)
        gather_rows(out, src, index)            # torch.ops.graphstash.gather_rows
    """
    mutates_args = tuple(mutates_args)
    schema = torch.library.infer_schema(launcher, mutates_args=mutates_args)
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, launcher, "CUDA")
    if cpu is not None:
        _LIBRARY.impl(name, cpu, "CPU")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, _no_outputs, lib=_LIBRARY)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default

    @functools.wraps(launcher)
    def entry(*args, **kwargs) -> None:
        op(*args, **kwargs)

    entry.op = op
    entry.__name__ = entry.__qualname__ = name
    return entry
