"""Graphstash code that ``torch.compile`` runs as it is instead of tracing it.

NOTE [untraced machinery]: the saved-tensor machinery (``stash_activations`` entering and
leaving, the pack and unpack hooks of every graphstash context) is Python bookkeeping around
device kernels: ring counters, buffer tables, the recorded schedule, the stash plan. Dynamo
cannot trace ``saved_tensors_hooks`` (it breaks the graph there), but without a marker it
would still trace whatever that code calls after the break, in frames of its own: the
buffers' stash and reload with their page tables, the plan, even the pack hook called by
autograd. Every value read there becomes a guard, and those values change by design between
the warmup steps (which measure demand, with no buffer yet) and the captured step (which
runs the sized pool): the guard fails inside the capture, dynamo recompiles there and
Inductor cannot compile inside a CUDA graph capture ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture"). Wrapped in :func:`untraced`, the machinery is one graph
break that runs eagerly, as it runs without ``torch.compile``: it puts no guard on the
manager's state and is compiled never. The expert kernels inside the stash context are
still compiled in frames of their own.
"""
from __future__ import annotations

import torch


def untraced(fn):
    """``fn`` as ``torch.compile`` must see it: run eagerly, never traced, no guard on what it
    reads (NOTE [untraced machinery]). Calls from code that is not compiled cost one function
    call more.

    Example::

        class context:
            @untraced
            def __enter__(self): ...
    """
    return torch.compiler.disable(fn, recursive=True)


# NOTE [constant results without dynamo]: ``torch.compiler.assume_constant_result(fn)`` imports
# ``torch._dynamo`` (about a second, the larger part of ``import graphstash``) only to set one
# attribute on ``fn``; dynamo reads that attribute when it meets a call of ``fn`` and puts the
# call's result into the graph as a constant. Functions marked at import time set it here
# without the import; ``tests/test_imports.py`` checks that torch's decorator still sets exactly
# this attribute, so a torch that changes the mechanism fails a test instead of tracing ``fn``.
CONSTANT_RESULT_ATTRIBUTE = "_dynamo_marked_constant"


def constant_result(fn):
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it, without importing
    ``torch._dynamo`` (NOTE [constant results without dynamo]): while ``torch.compile`` traces,
    a call of ``fn`` runs eagerly and its result is a constant of the graph.

    Example::

        @constant_result
        def availability() -> tuple[bool, str]: ...
    """
    setattr(fn, CONSTANT_RESULT_ATTRIBUTE, True)
    return fn
