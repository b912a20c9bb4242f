"""Inputs and outputs of a captured step: flattening, signatures, static buffers.

A CUDA graph reads its inputs from fixed addresses, so every tensor the step takes is copied
into a *static* buffer allocated at capture time, and every replay first copies the new call's
tensors into those buffers. Everything else an argument holds is baked into the graph, so it is
part of the call's signature and compared, by value, at every call.

# NOTE [what a step may take]
The arguments are walked, not handed to ``torch.utils._pytree`` (which treats any type it has
no handler for, a dataclass or transformers' ``BatchEncoding``, as one opaque leaf). The walk
sees into

* tensors (staged: copied into the static buffers before each replay);
* lists, tuples, namedtuples, ``torch.Size`` and their subclasses;
* ``Mapping``\\ s: ``dict`` and its subclasses, ``UserDict`` (``BatchEncoding``) and any other
  ``MutableMapping``, through their items (keys are compared as constants);
* dataclasses (frozen or not) and attrs classes, through every attribute of the instance;

and bakes in, compared *by value*: ``None``, bools, numbers, strings, bytes, ``torch.dtype`` /
``device`` / ``layout`` / ``memory_format``, enum members, numpy scalars, slices and ranges,
and objects whose class defines both ``__eq__`` and ``__hash__``. Handles whose meaning is their
identity (modules, optimizers, generators, functions, classes, Python modules) are compared by
identity. Anything else (numpy arrays above all: a graph cannot read host memory, so an array
would be read once, at capture) is refused with a TypeError naming the argument's path, when the
call would capture. Nothing is ever compared through ``repr()``, which elides the middle of a
large tensor or array.

The captured call receives the caller's objects rebuilt around the static tensors: a shallow
copy of each container (the same type, frozen dataclasses included) with its tensor leaves
replaced, so the caller's own objects are never modified.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
import enum
import reprlib
import struct
import sys
import types

import torch

# ---- constants ----------------------------------------------------------------------------
_BY_VALUE = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout,
             torch.memory_format, type(Ellipsis))
_BY_IDENTITY = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                types.ModuleType, torch.nn.Module, torch.optim.Optimizer, torch.Generator,
                types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType)
_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60


class _Identity:
    """A key comparing ``value`` by identity (keeps it alive)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self):
        return id(self.value)


class _Value:
    """A key comparing ``value`` with its own ``__eq__`` / ``__hash__`` (its class defines
    both); an ``__eq__`` that raises or returns something that is not a bool means unequal."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash((type(value), value))

    def __eq__(self, other):
        if not isinstance(other, _Value) or type(other.value) is not type(self.value):
            return False
        try:
            result = self.value == other.value
        except Exception:
            return False
        return result if isinstance(result, bool) else False

    def __hash__(self):
        return self._hash


def _defines(cls: type, name: str) -> bool:
    """True when ``cls`` (not ``object``) defines the special method ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass is not object and vars(klass)[name] is not None
    return False


def constant_key(value, path: str):
    """A hashable key that is equal for two values a graph may bake in interchangeably.

    Raises TypeError naming ``path`` for a value that can be neither compared by value nor by
    identity (NOTE [what a step may take]).
    """
    if isinstance(value, float):                  # bitwise: 0.0 != -0.0, nan == nan
        return (float, struct.pack("<d", value))
    if isinstance(value, complex):
        return (complex, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, _BY_VALUE) and not isinstance(value, enum.Enum):
        return (type(value), value)
    if isinstance(value, enum.Enum):
        return (type(value), _Identity(value))
    if isinstance(value, (slice, range)):
        parts = (value.start, value.stop, value.step)
        return (type(value), tuple(constant_key(v, path) for v in parts))
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.generic) and value.dtype.kind not in "OV":
            return (type(value), value.tobytes())
        if isinstance(value, np.ndarray):
            raise TypeError(
                f"{path}: a numpy.ndarray cannot be staged into a CUDA graph (the step could "
                f"only read it once, at capture, and later calls would reuse that data); pass "
                f"torch.from_numpy(array) (a tensor is staged every call) or a tuple of numbers")
    if isinstance(value, _BY_IDENTITY) or callable(value) and not isinstance(value, torch.Tensor):
        return ("identity", _Identity(value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(constant_key(v, path) for v in value))
    if _defines(type(value), "__eq__") and _defines(type(value), "__hash__"):
        try:
            return ("value", _Value(value))
        except TypeError:
            pass
    raise TypeError(
        f"{path}: graph_step cannot see into an object of type {type(value).__qualname__} or "
        f"compare it between calls (it would be baked into the graph at capture and a changed "
        f"value replayed stale); pass tensors, plain values (numbers, strings, ...), lists, "
        f"tuples, dicts, Mappings, dataclasses or attrs classes of them "
        f"(NOTE [what a step may take] in graphstash/graph/_staging.py)")


# ---- the walk ------------------------------------------------------------------------------
# A spec is a hashable nested tuple: ("leaf",) for a tensor or constant (its key lives in the
# signature), or (kind, type, labels, children) for a container.
_LEAF = ("leaf",)
_MAX_DEPTH = 64


def _attrs_names(obj) -> tuple | None:
    fields = getattr(type(obj), "__attrs_attrs__", None)
    if fields is None:
        return None
    return tuple(f.name for f in fields)


def _object_names(obj) -> tuple:
    """Attribute names of a dataclass or attrs instance: its fields, then any other
    attribute set on the instance."""
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = list(_attrs_names(obj))
    extra = [k for k in getattr(obj, "__dict__", {}) if k not in names]
    return tuple(names + extra)


def _children(obj):
    """``(kind, labels, values)`` of a container the walk sees into, else None."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, (list, tuple)):
        kind = "namedtuple" if isinstance(obj, tuple) and hasattr(type(obj), "_fields") else (
            "tuple" if isinstance(obj, tuple) else "list")
        return kind, len(obj), list(obj)
    if isinstance(obj, collections.abc.Mapping):
        keys = tuple(obj.keys())
        return "mapping", keys, [obj[k] for k in keys]
    if (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or (
            _attrs_names(obj) is not None and not isinstance(obj, type)):
        names = _object_names(obj)
        return "object", names, [getattr(obj, n) for n in names]
    return None


_CALL = "<call>"      # the path of the (args, kwargs) pair a call is walked as


def _child_path(path: str, kind: str, label) -> str:
    """The path of a child: ``args`` / ``kwargs`` under a call's ``(args, kwargs)`` pair, then
    ``[0]``, ``['key']`` or ``.field``."""
    if path is _CALL:
        return ("args", "kwargs")[label]
    if kind == "object":
        return f"{path}.{label}"
    return f"{path}[{label!r}]"


def _walk(obj, path: str, leaves: list, paths: list | None, strict: bool, depth: int, seen):
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        if paths is not None:
            paths.append(path)
        return _LEAF
    found = _children(obj)
    if found is None:
        if strict:
            constant_key(obj, path)               # refuses what cannot be compared
        leaves.append(obj)
        if paths is not None:
            paths.append(path)
        return _LEAF
    if depth > _MAX_DEPTH or id(obj) in seen:
        raise TypeError(f"{path}: the arguments nest deeper than {_MAX_DEPTH} levels or hold "
                        "themselves (a cycle); graph_step cannot stage them")
    kind, labels, values = found
    if kind == "mapping":
        if strict:
            for key in labels:
                constant_key(key, f"{path} key {key!r}")
        if strict and not isinstance(obj, (dict, collections.abc.MutableMapping)):
            raise TypeError(f"{path}: a read-only Mapping of type {type(obj).__qualname__} "
                            "cannot be rebuilt around the graph's static tensors; pass a dict")
    seen.add(id(obj))
    children = []
    for i, value in enumerate(values):
        sub = _child_path(path, kind, labels[i] if kind in ("mapping", "object") else i)
        children.append(_walk(value, sub, leaves, paths, strict, depth + 1, seen))
    seen.discard(id(obj))
    return (kind, type(obj), labels, tuple(children))


def _rebuild(spec, template, leaves):
    """``template`` (the container the spec was taken from) rebuilt with ``leaves`` (an
    iterator) in place of its leaves: same types, a shallow copy of every container."""
    if spec is _LEAF or spec == _LEAF:
        return next(leaves)
    kind, cls, labels, children = spec
    if kind == "mapping":
        values = [_rebuild(c, template[k], leaves) for c, k in zip(children, labels)]
        if cls is dict:
            return dict(zip(labels, values))
        new = copy.copy(template)
        for key, value in zip(labels, values):
            new[key] = value
        return new
    if kind == "object":
        values = [_rebuild(c, getattr(template, n), leaves) for c, n in zip(children, labels)]
        new = copy.copy(template)
        for name, value in zip(labels, values):
            object.__setattr__(new, name, value)     # frozen dataclasses and attrs too
        return new
    values = [_rebuild(c, t, leaves) for c, t in zip(children, template)]
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    if kind == "namedtuple":
        return cls(*values)
    if kind == "list":
        new = copy.copy(template)
        new[:] = values
        return new
    return cls(values)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, object]:
    """Flatten ``(args, kwargs)`` into leaves (tensors and constants) and a spec.

    Raises TypeError naming the argument's path for what a graph cannot take (NOTE [what a
    step may take]).
    """
    leaves: list = []
    spec = _walk((args, kwargs), _CALL, leaves, None, True, 0, set())
    return leaves, spec


def leaf_names(args: tuple, kwargs: dict) -> list[str]:
    """Readable paths of the leaves (``args[0]``, ``kwargs['batch'].ids``), in leaf order."""
    paths: list = []
    _walk((args, kwargs), _CALL, [], paths, False, 0, set())
    return paths


# ---- signatures ------------------------------------------------------------------------------
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
    """A non-tensor input baked into the graph: compared through ``key``, shown by ``value``."""

    key: object
    value: object = dataclasses.field(compare=False, hash=False)

    def describe(self) -> str:
        return f"{type(self.value).__name__} {_REPR.repr(self.value)}"


def signature(leaves: list, spec) -> tuple:
    """A hashable key of a call: its structure plus each leaf's TensorSpec or Constant.

    Two calls with equal signatures can replay the same graph.
    """
    return (spec, tuple(TensorSpec.of(x) if isinstance(x, torch.Tensor)
                        else Constant(constant_key(x, "a constant argument"), x)
                        for x in leaves))


def _shown(path: str) -> str:
    return "the arguments" if path is _CALL else path


def _spec_difference(a, b, path: str) -> str | None:
    """The first place where specs ``a`` and ``b`` differ, described, or None."""
    if a == b:
        return None
    if a == _LEAF or b == _LEAF:
        what = lambda s: "a tensor or value" if s == _LEAF else f"a {s[1].__qualname__}"  # noqa: E731
        return f"{_shown(path)}: the graph was captured for {what(a)}, " \
               f"got {what(b)}"
    (ka, ca, la, cha), (_, cb, lb, chb) = a, b
    where = _shown(path)
    if ca is not cb:
        return f"{where}: the graph was captured for a {ca.__qualname__}, got a {cb.__qualname__}"
    if la != lb:
        if ka in ("mapping", "object"):
            return f"{where}: the graph was captured for the keys {list(la)}, got {list(lb)}"
        return f"{where}: the graph was captured for {la} items, got {lb}"
    for i, (x, y) in enumerate(zip(cha, chb)):
        sub = _child_path(path, ka, la[i] if ka in ("mapping", "object") else i)
        found = _spec_difference(x, y, sub)
        if found:
            return found
    return None


def describe_mismatch(expected: tuple, got: tuple, args: tuple, kwargs: dict) -> str:
    """Say which argument differs between two signatures (for the error a new shape raises)."""
    exp_spec, exp_leaves = expected
    got_spec, got_leaves = got
    if exp_spec != got_spec:
        found = _spec_difference(exp_spec, got_spec, _CALL)
        return "the structure of the arguments changed: " + (found or "")
    names = leaf_names(args, kwargs)
    for name, e, g in zip(names, exp_leaves, got_leaves):
        if e != g:
            if isinstance(e, Constant) and isinstance(g, Constant):
                return (f"{name} changed from {_REPR.repr(e.value)} to {_REPR.repr(g.value)}; "
                        "non-tensor arguments are baked into the graph")
            return f"{name}: the graph was captured for a {e.describe()}, got a {g.describe()}"
    return "the arguments differ from those the graph was captured for"


# ---- static inputs ---------------------------------------------------------------------------
class StaticInputs:
    """Static copies of a call's tensor leaves; ``stage`` copies a new call's tensors in.

    Args:
        leaves: the flattened leaves of the capturing call (tensors of any shape, dtype and
            device, plus constants). Tensors are cloned (detached; ``requires_grad`` kept).
        spec: the spec from :func:`flatten_call`.
        call: the capturing call's ``(args, kwargs)``, whose containers are copied around the
            static tensors once, here (nothing of it is kept but its constants).
    """

    def __init__(self, leaves: list, spec, call: tuple):
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
        self._static = [self.leaves[i] for i in self.tensor_index]
        self._call = _rebuild(spec, call, iter(self.leaves))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self._static

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._static)

    def args_kwargs(self) -> tuple[tuple, dict]:
        """The caller's arguments rebuilt around the static leaves, for the captured call
        (containers keep their types: NOTE [what a step may take])."""
        return self._call

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


# ---- outputs ---------------------------------------------------------------------------------
def map_tensors(tree, fn):
    """``tree`` rebuilt with ``fn(t)`` for every tensor ``t`` it holds (containers as in NOTE
    [what a step may take]; anything else is returned as it is)."""
    leaves: list = []
    spec = _walk(tree, "", leaves, None, False, 0, set())
    mapped = [fn(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    return _rebuild(spec, tree, iter(mapped))


def detach_tree(tree):
    """``tree`` with every tensor leaf detached (no copy)."""
    return map_tensors(tree, lambda x: x.detach())


def clone_tree(tree):
    """``tree`` with every tensor leaf detached and cloned."""
    return map_tensors(tree, lambda x: x.detach().clone())


def copy_tree_into(dst_tree, src_tree) -> bool:
    """Copy the tensors of ``src_tree`` into the same-shaped tensors of ``dst_tree``.

    Returns False (copying nothing) when the structures, shapes or dtypes differ.
    """
    dst: list = []
    src: list = []
    if _walk(dst_tree, "", dst, None, False, 0, set()) != _walk(src_tree, "", src, None, False,
                                                                  0, set()):
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
           "describe_mismatch", "constant_key", "map_tensors", "detach_tree", "clone_tree",
           "copy_tree_into"]
