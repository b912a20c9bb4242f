"""Inputs and outputs of a captured step: pytree flattening, signatures, static buffers.

A CUDA graph reads its inputs from fixed addresses, so every tensor the step takes is copied
into a *static* buffer allocated at capture time, and every replay first copies the new
call's tensors into those buffers. Anything that is not a tensor (an int, a flag, a string)
is baked into the graph and therefore part of its signature.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils import _pytree as pytree

from .._checks import describe

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a graph assumes about one tensor input: shape, dtype, device, requires_grad."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def describe(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{self.dtype} tensor of shape {self.shape} on {self.device}{grad}"

@dataclasses.dataclass(frozen=True)
class Constant:
    """A non-tensor input; its value is baked into the graph."""

    value: object

    def describe(self) -> str:
        return f"{type(self.value).__name__} {self.value!r}"

def _constant(value) -> Constant:
    try:
        hash(value)
    except TypeError:
        value = ("<unhashable>", type(value).__name__, repr(value))
    return Constant(value)

def flatten_call(args: tuple, kwargs: dict) -> tuple[list, object]:
    """Flatten ``(args, kwargs)`` into leaves and a tree spec (lists, tuples, dicts, namedtuples)."""
    return pytree.tree_flatten((args, kwargs))

def signature(leaves: list, spec) -> tuple:
    """A hashable key of a call: the tree structure plus each leaf's TensorSpec or Constant.

    Two calls with equal signatures can replay the same graph.
    """
    return (spec, tuple(TensorSpec.of(x) if isinstance(x, torch.Tensor) else _constant(x)
                        for x in leaves))

def leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """Readable paths of the leaves (``args[0]``, ``kwargs['batch'][1]``), in leaf order."""
    with_paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _leaf in with_paths:
        head, *rest = path
        root = "args" if getattr(head, "idx", None) == 0 else "kwargs"
        names.append(root + "".join(str(k) for k in rest))
    return names

def describe_mismatch(expected: tuple, got: tuple, args: tuple, kwargs: dict) -> str:
    """Say which argument differs between two signatures (for the error a new shape raises)."""
    exp_spec, exp_leaves = expected
    got_spec, got_leaves = got
    if exp_spec != got_spec:
        return (f"the structure of the arguments changed: the graph was captured for {exp_spec}, "
                f"this call passes {got_spec}")
    names = leaf_names(args, kwargs)
    for name, e, g in zip(names, exp_leaves, got_leaves):
        if e != g:
            if isinstance(e, Constant) and isinstance(g, Constant):
                return (f"{name} changed from {e.value!r} to {g.value!r}; non-tensor arguments "
                        "are baked into the graph")
            return f"{name}: the graph was captured for a {e.describe()}, got a {g.describe()}"
    return "the arguments differ from those the graph was captured for"

class StaticInputs:
    """Static copies of a call's tensor leaves; ``stage`` copies a new call's tensors in.

    Args:
        leaves: the flattened leaves of the capturing call (tensors of any shape, dtype and
            device, plus constants). Tensors are cloned (detached; ``requires_grad`` kept).
        spec: the tree spec from :func:`flatten_call`.
    """

    def __init__(self, leaves: list, spec):
        self.spec = spec
        self.leaves = []
        self.tensor_index: list[int] = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                static = x.detach().clone()
                if x.requires_grad:
                    static.requires_grad_(True)
                self.leaves.append(static)
                self.tensor_index.append(i)
            else:
                self.leaves.append(x)
        # destinations grouped for one multi-tensor copy where source and destination share a device
        self._static = [self.leaves[i] for i in self.tensor_index]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self._static

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._static)

    def args_kwargs(self) -> tuple[tuple, dict]:
        """The static leaves rebuilt into ``(args, kwargs)`` for the captured call."""
        return pytree.tree_unflatten(self.leaves, self.spec)

    def stage(self, leaves: list) -> None:
        """Copy the tensors of ``leaves`` (same signature) into the static buffers.

        Copies run on the current stream; same-device copies go out as one multi-tensor launch.
        """
        dst_same, src_same = [], []
        with torch.no_grad():
            for static, i in zip(self._static, self.tensor_index):
                src = leaves[i]
                if src is static:
                    continue
                if src.device == static.device:
                    dst_same.append(static)
                    src_same.append(src)
                else:
                    static.copy_(src)
            if dst_same:
                torch._foreach_copy_(dst_same, src_same, non_blocking=True)

def detach_tree(tree):
    """``tree`` with every tensor leaf detached (no copy)."""
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)

def clone_tree(tree):
    """``tree`` with every tensor leaf detached and cloned."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)

def copy_tree_into(dst_tree, src_tree) -> bool:
    """Copy the tensors of ``src_tree`` into the same-shaped tensors of ``dst_tree``.

    Returns False (copying nothing) when the structures, shapes or dtypes differ.
    """
    dst, dst_spec = pytree.tree_flatten(dst_tree)
    src, src_spec = pytree.tree_flatten(src_tree)
    if dst_spec != src_spec:
        return False
    pairs = []
    for d, s in zip(dst, src):
        if isinstance(d, torch.Tensor) != isinstance(s, torch.Tensor):
            return False
        if isinstance(d, torch.Tensor):
            if d.shape != s.shape or d.dtype != s.dtype or d.device != s.device:
                return False
            pairs.append((d, s))
    with torch.no_grad():
        for d, s in pairs:
            d.copy_(s)
    return True

__all__ = ["TensorSpec", "Constant", "StaticInputs", "flatten_call", "signature", "leaf_names",
           "describe_mismatch", "detach_tree", "clone_tree", "copy_tree_into"]
