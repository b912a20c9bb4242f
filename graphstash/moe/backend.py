"""Which kernels the MoE path runs: the one resolver of :mod:`graphstash.moe`.

NOTE [moe kernels]: every kernel of dispatch, combine and the expert activation exists twice
with the same arguments and the same results: the registered operators
(``torch.ops.graphstash.*``, :mod:`graphstash._kernels`: the CuPy launchers on CUDA, the
reference as their CPU kernel) and the pure-torch reference (:mod:`graphstash.reference`,
which also runs on CUDA tensors: the oracle, and the path of a GPU without CuPy).
:func:`kernels_for` picks one set for a device the way every graphstash buffer does
(:func:`graphstash._backend.resolve`: ``"auto"`` takes the operators where the CuPy kernels can
run); dispatch keeps the set it chose in its handle, so combine and the backward use the same.
The routing kernels exist only as CUDA operators (``route_local`` is None in the reference
set, whose plans the torch code of ``_routing.py`` builds).

Nothing here touches the GPU at import time (registering the operators does not).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .. import _backend
from .._kernels import experts as _kernel_experts
from .._kernels import moe as _kernel_moe
from ..reference import experts as _reference_experts
from ..reference import moe as _reference_moe

__all__ = ["OPERATORS", "REFERENCE", "Kernels", "kernels_for"]


class Kernels(NamedTuple):
    """One backend's MoE kernels (NOTE [moe kernels]); each writes into caller-allocated
    outputs, arguments as in :mod:`graphstash.reference.moe` and
    :mod:`graphstash.reference.experts`."""
    name: str                                  # "cupy" or "reference"
    gather_rows: Callable[..., None]
    place_rows: Callable[..., None]
    combine_rows: Callable[..., None]
    weight_grad: Callable[..., None]
    act_forward: Callable[..., None]
    act_backward: Callable[..., None]
    route_local: Callable[..., None] | None    # CUDA operators only
    route_fits: Callable[[int], bool] | None


OPERATORS = Kernels("cupy", _kernel_moe.gather_rows, _kernel_moe.place_rows,
                    _kernel_moe.combine_rows, _kernel_moe.weight_grad, _kernel_experts.act_forward,
                    _kernel_experts.act_backward, _kernel_moe.route_local,
                    _kernel_moe.route_fits)
REFERENCE = Kernels("reference", _reference_moe.gather_rows, _reference_moe.place_rows,
                    _reference_moe.combine_rows, _reference_moe.weight_grad,
                    _reference_experts.act_forward,
                    _reference_experts.act_backward, None, None)


# NOTE [reference kernels under torch.compile]: the reference kernels write into outputs the
# caller allocated (``out = x.new_empty(...)``, then ``out.copy_(...)``), as the CUDA kernels
# do. Traced by dynamo inside an autograd.Function's forward, a fresh tensor filled in place
# and returned loses its gradient on torch 2.11 (measured on the CPU: every gradient of a
# compiled MoE layer came out zero; torch 2.13 traces it right). The registered operators
# declare what they write (``mutates_args``) and are opaque to dynamo, and their CPU kernel is
# the reference itself, so a trace on the CPU takes them instead: the same arithmetic, in a
# form every torch version traces correctly. (CUDA tensors take the operators anyway; a GPU
# without CuPy runs the reference uncompiled only.)
TRACED_REFERENCE = Kernels("reference", OPERATORS.gather_rows, OPERATORS.place_rows,
                           OPERATORS.combine_rows, OPERATORS.weight_grad, OPERATORS.act_forward,
                           OPERATORS.act_backward, None, None)


def kernels_for(backend: str, device: torch.device) -> Kernels:
    """The kernels for tensors on ``device``: ``backend`` is ``"auto"``, ``"cupy"`` or
    ``"reference"`` (ValueError naming ``backend`` otherwise;
    :class:`~graphstash.BackendUnavailableError` for ``"cupy"`` where CuPy cannot run)."""
    name, _ = _backend.resolve(backend, device)
    if name == "cupy":
        return OPERATORS
    if device.type == "cpu" and torch.compiler.is_compiling():
        return TRACED_REFERENCE          # NOTE [reference kernels under torch.compile]
    return REFERENCE
