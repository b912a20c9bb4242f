"""Test-only faults: a wrong backward injected into one kernel (or one exchange), so that a
test can prove a family of gradient checks fails when the gradient is wrong.

Nothing here touches library code: each fault wraps, for the duration of a ``with`` block,

- a graphstash kernel operator (``torch.ops.graphstash.<name>``, CPU and CUDA alike, through a
  temporary ``Autograd``-key registration that runs the real kernel, then corrupts what it
  wrote) and its pure-torch reference twin (``graphstash.reference.<module>.<name>``, which
  the CPU backend calls directly);
- or ``PagedStashBuffer.reload`` (the rows a stash gives back for backward);
- or ``torch.distributed.all_to_all_single`` (the expert-parallel exchange).

A fault fires only while autograd runs a backward (``backward_only``) and while it is
``armed``; ``hits`` counts the calls it corrupted, so a meta-test can check that the fault
reached the code under test at all. Example::

    with kernel_fault("act_backward", scale=1.25) as fault:
        with pytest.raises(AssertionError):
            check_under_test()
    assert fault.hits > 0
"""
from __future__ import annotations

import contextlib
import importlib
import warnings

import torch

# kernel -> (module of its operator and reference twin, index of the argument it writes)
KERNELS = {
    "gather_rows": ("moe", 0),           # combine's backward, the regathered expert input
    "combine_rows": ("moe", 0),          # dispatch's backward
    "weight_grad": ("moe", 0),           # the router weights' gradient (weighted combine)
    "act_backward": ("experts", 0),      # the expert activation's backward
}


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class Fault:
    """What a fault did: ``hits`` corrupted calls; set ``armed = False`` to pause it."""

    def __init__(self, name: str, scale: float, backward_only: bool):
        self.name, self.scale, self.backward_only = name, scale, backward_only
        self.armed = True
        self.hits = 0

    def fires(self) -> bool:
        return self.armed and (not self.backward_only or in_backward())

    def corrupt(self, t: torch.Tensor) -> None:
        """Scale ``t`` in place (a scale of 0 zeroes it); counts the hit."""
        self.hits += 1
        if self.scale == 0:
            t.zero_()
        else:
            t.mul_(self.scale)


@contextlib.contextmanager
def kernel_fault(name: str, *, scale: float = 1.25, backward_only: bool = True):
    """Scale what kernel ``name`` (a key of :data:`KERNELS`) writes by ``scale``, on the
    reference backend and on the registered operator (CPU and CUDA); yields the
    :class:`Fault`."""
    family, out_index = KERNELS[name]
    importlib.import_module(f"graphstash._kernels.{family}")    # registers the operator
    module = importlib.import_module(f"graphstash.reference.{family}")
    fault = Fault(name, scale, backward_only)
    reference = getattr(module, name)

    def faulty_reference(*args, **kwargs):
        reference(*args, **kwargs)
        if fault.fires():
            fault.corrupt(args[out_index])

    op = getattr(torch.ops.graphstash, name).default

    def faulty_operator(*args, **kwargs):
        with torch._C._AutoDispatchBelowAutograd():
            op(*args, **kwargs)
        if fault.fires():
            fault.corrupt(args[out_index])

    library = torch.library.Library("graphstash", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        library.impl(name, faulty_operator, "Autograd")
    # the MoE path takes the reference kernels from its one resolver's set (NOTE [moe
    # kernels] in graphstash/moe/backend.py), which holds the functions themselves
    from graphstash.moe import backend
    kernel_set = backend.REFERENCE
    setattr(module, name, faulty_reference)
    backend.REFERENCE = kernel_set._replace(**{name: faulty_reference})
    try:
        yield fault
    finally:
        setattr(module, name, reference)
        backend.REFERENCE = kernel_set
        library._destroy()


@contextlib.contextmanager
def reload_fault(*, scale: float = 0.5):
    """Scale the rows every ``PagedStashBuffer.reload`` gives back (what backward then reads)
    by ``scale``; yields the :class:`Fault`."""
    from graphstash.paging import PagedStashBuffer

    fault = Fault("reload", scale, backward_only=False)
    real = PagedStashBuffer.reload

    def faulty(self, handle, *args, **kwargs):
        out = real(self, handle, *args, **kwargs)
        if fault.fires() and out.is_floating_point():
            fault.corrupt(out)
        return out

    PagedStashBuffer.reload = faulty
    try:
        yield fault
    finally:
        PagedStashBuffer.reload = real


@contextlib.contextmanager
def exchange_fault(*, scale: float = 1.25):
    """Scale what ``torch.distributed.all_to_all_single`` receives in a backward pass (the
    expert-parallel exchange of gradients); yields the :class:`Fault`."""
    import torch.distributed as dist

    fault = Fault("all_to_all_single", scale, backward_only=True)
    real = dist.all_to_all_single

    def faulty(output, input, *args, **kwargs):
        work = real(output, input, *args, **kwargs)
        if fault.fires() and output.is_floating_point():
            fault.corrupt(output)
        return work

    dist.all_to_all_single = faulty
    try:
        yield fault
    finally:
        dist.all_to_all_single = real
