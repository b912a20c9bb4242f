"""Tensor swap: per-layer activations to pinned host memory and back, keyed by (layer, index).

A swap scope marks one instance of a repeated sub-module (``"layers.*.mlp"``: the MLP of each
layer). Each tensor autograd saves inside the scope is copied to host as soon as it is saved,
keyed by ``(layer, index)`` where ``layer`` counts the scopes entered with the same tag in this
forward (or comes from the ``*`` of ``module_name``) and ``index`` counts the saves in it. In
backward, using tensor ``(L, i)`` prefetches its share of layer ``L - 1``'s tensors, so copies
overlap compute; the last layer is not swapped (its backward comes first).

Example::

    for i, layer in enumerate(model.layers):
        x = x + layer.attn(x)
        with graphstash.swap_activations("layers.*.mlp"):
            x = x + layer.mlp(x)
    loss = x.float().pow(2).mean()
    loss.backward()
"""
from __future__ import annotations

import dataclasses
import re
import weakref

import torch

from ._checks import normalize_device, require_positive_int
from ._saved import HookContext, Kept, RetireQueue
from ._saved.host import HostCopier, HostHandle, HostPool, StorageRecord, host_movable, storage_key
from .errors import SavedTensorsError

__all__ = ["TensorSwapper", "default_swapper", "swap_activations"]

_KEPT, _COPYING, _ON_HOST, _RELOADING, _READY = "kept", "copying", "on_host", "reloading", "ready"


class _Item:
    """One swapped (or kept last-layer) tensor: its record, copy events and state."""

    __slots__ = ("record", "layer", "index", "state", "d2h_mark", "h2d_mark", "__weakref__")

    def __init__(self, record: StorageRecord, layer: "_Layer", index: int, state: str):
        self.record = record
        self.layer = layer
        self.index = index
        self.state = state
        self.d2h_mark = None
        self.h2d_mark = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer.index, self.index)


@dataclasses.dataclass(eq=False)
class _Layer:
    index: int                       # layer number in the key
    position: int                    # order of entry in this forward
    step: "_Step"
    swapped: bool                    # False for the last layer (kept on the device)
    items: list = dataclasses.field(default_factory=list)
    by_storage: dict = dataclasses.field(default_factory=dict)  # storage ptr -> [_Item]
    handles: list = dataclasses.field(default_factory=list)   # weakrefs to HostHandles
    released: bool = False


@dataclasses.dataclass(eq=False)
class _Step:
    """One forward of one tag: its layers in the order they were entered."""

    layers: list = dataclasses.field(default_factory=list)
    backward_seen: bool = False
    outstanding: int = 0


@dataclasses.dataclass(eq=False)
class _Tag:
    step: _Step = dataclasses.field(default_factory=_Step)
    learned_layers: int | None = None


def _tag_regex(module_tag: str):
    parts = [re.escape(p) for p in module_tag.split("*")]
    return re.compile("^" + r"(\d+)".join(parts) + "$")


class TensorSwapper:
    """Swaps the tensors saved inside tagged layer scopes to pinned host memory and back.

    Args:
        min_tensor_bytes: smallest tensor (bytes) worth swapping. Default 64 KiB.
        device: the device whose tensors are swapped (default: current CUDA device; a CPU
            device runs the same logic with synchronous copies, for tests).
        host_pool: share a :class:`~graphstash.offload.HostPool`.

    NOTE [swap steps]: a tag's forward starts over (layer count back to 0) when a scope with
    that tag is entered after backward has used any of its tensors, so a plain loop (and
    gradient accumulation, one microbatch's backward before the next forward) needs nothing
    else. The number of layers is learned from the previous forward, which makes the last
    layer stay on the device from the second forward on. Schedules that run several forwards
    before their backwards (pipeline parallelism) must call :meth:`reset` per iteration.
    Under a CUDA graph the rules of NOTE [offload under a CUDA graph] apply: one eager step
    first (it fills the host pool and creates the streams), then capture.

    Example::

        swapper = TensorSwapper(min_tensor_bytes=1 << 20)
        for layer in layers:
            with swapper.swap("layers.*.mlp"):
                x = layer(x)
        x.sum().backward()
    """

    def __init__(self, *, min_tensor_bytes: int = 1 << 16, device=None,
                 host_pool: HostPool | None = None):
        require_positive_int("min_tensor_bytes", min_tensor_bytes, allow_zero=True)
        if host_pool is not None and not isinstance(host_pool, HostPool):
            raise TypeError(f"host_pool: expected a HostPool or None, got {type(host_pool).__name__}")
        self.min_tensor_bytes = min_tensor_bytes
        self.device = normalize_device(device)
        self.host_pool = host_pool if host_pool is not None else HostPool(self.device.type == "cuda")
        self._mover = HostCopier(self.device, self.host_pool)
        self._tags: dict[str, _Tag] = {}
        self._copying = RetireQueue(self._mover.d2h)   # layers whose device tensors are held
        self._outstanding = 0                    # items not yet unpacked, all tags

    @property
    def outstanding(self) -> int:
        """Swapped tensors backward has not used yet, over all tags (0 between steps)."""
        return self._outstanding

    @property
    def transfer_log(self):
        """Recent copies, oldest first: ``("d2h" | "h2d", (tag, layer, index))``, ``("release", ...)``."""
        return self._mover.log

    def swap(self, module_tag: str = "default", prefetch: bool = True, check_fn=None, *,
             module_name: str | None = None) -> "_SwapScope":
        """A context manager: tensors saved inside it are swapped as one layer of ``module_tag``.

        Args:
            module_tag: names the role shared by every layer, ``*`` standing for the layer
                number (``"layers.*.mlp"``, ``"layers.*.mlp.experts.0"``).
            prefetch: in backward, using tensor ``(L, i)`` also fetches its share of layer
                ``L - 1``'s tensors (otherwise each tensor is fetched when used).
            check_fn: optional ``fn(tensor) -> bool``; tensors it rejects stay on the device.
            module_name: the concrete module name (``"layers.7.mlp"``); when given, it must
                match ``module_tag`` and the number matched by ``*`` is the layer of the key.

        Example::

            with swapper.swap("layers.*.mlp", module_name=f"layers.{i}.mlp"):
                x = mlp(x)
        """
        if not isinstance(module_tag, str) or not module_tag:
            raise TypeError(f"module_tag: expected a non-empty str, got {module_tag!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch: expected a bool, got {type(prefetch).__name__}")
        if check_fn is not None and not callable(check_fn):
            raise TypeError(f"check_fn: expected a callable or None, got {type(check_fn).__name__}")
        layer = None
        if module_name is not None:
            if not isinstance(module_name, str):
                raise TypeError(f"module_name: expected a str or None, got {type(module_name).__name__}")
            if module_tag.count("*") != 1:
                raise ValueError(f"module_tag: expected exactly one '*' when module_name is given, "
                                 f"got {module_tag!r}")
            match = _tag_regex(module_tag).match(module_name)
            if match is None:
                raise ValueError(f"module_name: {module_name!r} does not match module_tag "
                                 f"{module_tag!r} ('*' stands for a layer number)")
            layer = int(match.group(1))
        return _SwapScope(self, module_tag, prefetch, check_fn, layer)

    # -- forward ---------------------------------------------------------------------------
    def _open_layer(self, tag_name: str, layer_index: int | None) -> _Layer:
        tag = self._tags.setdefault(tag_name, _Tag())
        if tag.step.backward_seen or self._abandoned(tag.step):
            self._new_step(tag)
        step = tag.step
        position = len(step.layers)
        index = position if layer_index is None else layer_index
        if any(l.index == index for l in step.layers):
            raise SavedTensorsError(f"swap scope {tag_name!r} layer {index} entered twice in one "
                               "forward; call reset() between forwards run before their backward")
        last = tag.learned_layers is not None and position >= tag.learned_layers - 1
        layer = _Layer(index, position, step, swapped=not last)
        step.layers.append(layer)
        return layer

    def _new_step(self, tag: _Tag) -> None:
        if tag.step.backward_seen:              # an abandoned forward teaches nothing
            tag.learned_layers = len(tag.step.layers)
        if tag.step.outstanding and self._abandoned(tag.step):
            self._retire(tag.step)
        tag.step = _Step()

    @staticmethod
    def _abandoned(step: _Step) -> bool:
        """True if the step saved tensors and autograd no longer holds any of them."""
        refs = [ref for layer in step.layers for ref in layer.handles]
        return bool(refs) and not any(ref() is not None for ref in refs)

    def _retire(self, step: _Step) -> None:
        """Give back everything ``step`` still holds (its backward will not run)."""
        for layer in step.layers:
            self._copying.take(layer)
            for item in layer.items:
                if item.state == _COPYING:
                    self._mover.d2h.wait(item.d2h_mark)
                elif item.state == _RELOADING:
                    self._mover.h2d.wait(item.h2d_mark)
                if item.record.refs > 0:
                    self._outstanding -= 1
                    step.outstanding -= 1
                item.record.refs = 0
                item.record.give_back(self.host_pool)
                item.state = _READY

    def _close_layer(self, layer: _Layer) -> None:
        # NOTE [release one layer later]: the copies of this layer overlap the next layer's
        # forward; layers entered before it are waited on now and their memory released
        # (NOTE [retire at the schedule point]).
        self._copying.retire([l for l in self._copying.owners() if l is not layer])

    def _release(self, layer: _Layer) -> None:
        """After the layer's D2H copies (the queue waited on the last one): drop the originals."""
        for item in layer.items:
            if item.state == _COPYING:
                item.record.drop_device()
                item.state = _ON_HOST
        layer.released = True
        self._mover.log.append(("release", layer.index))

    def _pack(self, layer: _Layer, check_fn, t: torch.Tensor):
        if (t.numel() * t.element_size() < self.min_tensor_bytes or not host_movable(t, self.device)
                or (check_fn is not None and not check_fn(t))):
            return Kept(t)
        # NOTE [swap shares copies]: a save whose bytes an earlier copy of the same storage in
        # this layer already holds (softmax's output and a matmul's reshaped view of it) reuses
        # that copy and is rebuilt from it on reload (NOTE [one record per storage]); the last
        # layer copies nothing, so all its views of a storage share one record.
        key = storage_key(t)
        same = layer.by_storage.setdefault(key, [])
        item = next((i for i in same if not layer.swapped or i.record.covers(t)), None)
        if item is None:
            record = StorageRecord(t, layer, key)
            record.plan()
            item = _Item(record, layer, len(layer.items), _COPYING if layer.swapped else _KEPT)
            layer.items.append(item)
            same.append(item)
            layer.step.outstanding += 1
            self._outstanding += 1
            if layer.swapped:
                item.d2h_mark = self._mover.to_host([record], item.key)
                self._copying.add(layer, item.d2h_mark, lambda: self._release(layer))
        item.record.refs += 1
        handle = HostHandle(item, item.record.add_view(t), t)
        layer.handles.append(weakref.ref(handle))
        return handle

    # -- backward --------------------------------------------------------------------------
    def _unpack(self, prefetch: bool, packed) -> torch.Tensor:
        if isinstance(packed, Kept):
            return packed.unpack()
        item = packed.owner
        rec = item.record
        if rec.refs <= 0:
            raise SavedTensorsError("a swapped saved tensor was used twice: swapped activations "
                               "support one backward (no retain_graph=True second backward)")
        packed.saved.check("it stayed on the device" if item.state == _KEPT
                           else "after it was swapped out")
        item.layer.step.backward_seen = True
        self._make_ready(item)
        if prefetch:
            self._prefetch(item)
        out = packed.view.back
        rec.refs -= 1
        if rec.refs == 0:
            rec.give_back(self.host_pool)
            item.layer.step.outstanding -= 1
            self._outstanding -= 1
            if self._outstanding == 0:
                self._mover.join()
        return out

    def _make_ready(self, item: _Item) -> None:
        rec = item.record
        if item.state == _KEPT:
            rec.adopt()
        elif item.state == _COPYING:
            # never released (backward came right after forward): use the device tensor
            self._mover.d2h.wait(item.d2h_mark)
            rec.adopt()
            item.state = _READY
            layer = item.layer
            if layer in self._copying and not any(i.state == _COPYING for i in layer.items):
                self._copying.take(layer)
        elif item.state == _ON_HOST:
            item.h2d_mark = self._mover.to_device([rec], item.key)
            item.state = _RELOADING
        if item.state == _RELOADING:
            self._mover.h2d.wait(item.h2d_mark)
        item.state = _READY

    def _prefetch(self, item: _Item) -> None:
        """Fetch the share of the previous layer that maps to ``item`` (NOTE [swap prefetch])."""
        # NOTE [swap prefetch]: tensor i of a layer with n tensors prefetches tensors
        # [i*m//n, (i+1)*m//n) of the layer entered before it (m tensors), so layers with
        # different numbers of saves are still fetched completely, spread over the backward
        # of the layer after them.
        layer = item.layer
        if layer.position == 0:
            return
        prev = layer.step.layers[layer.position - 1]
        n, m = len(layer.items), len(prev.items)
        for j in range(item.index * m // n, (item.index + 1) * m // n):
            other = prev.items[j]
            if other.state == _ON_HOST and other.record.refs > 0:
                other.h2d_mark = self._mover.to_device([other.record], other.key)
                other.state = _RELOADING

    # -- step-level control ----------------------------------------------------------------
    def reset(self) -> None:
        """Start every tag's next forward at layer 0, drop swapped tensors whose backward has
        not run (their saved tensors become unusable), join the side streams and free every
        host buffer. Safe inside a capture; not needed in a plain training loop."""
        for tag in self._tags.values():
            self._retire(tag.step)
            if tag.step.layers:
                self._new_step(tag)
        self._copying = RetireQueue(self._mover.d2h)
        self._outstanding = 0
        self._mover.join()
        self.host_pool.reclaim()

    def release(self) -> None:
        """:meth:`reset`, then free the host pool (no captured graph using it may replay)."""
        self.reset()
        self.host_pool.release()

    def swapped_bytes(self, module_tag: str) -> int:
        """Bytes swapped to host by the current (or last) forward of ``module_tag``; saves whose
        bytes an earlier copy already holds count once (NOTE [swap shares copies])."""
        tag = self._tags.get(module_tag)
        if tag is None:
            return 0
        return sum(i.record.nbytes for l in tag.step.layers if l.swapped for i in l.items)


class _SwapScope:
    """One layer instance of a tag: installs the saved-tensor hooks while open."""

    def __init__(self, swapper: TensorSwapper, tag: str, prefetch: bool, check_fn, layer):
        self.swapper, self.tag, self.prefetch, self.check_fn = swapper, tag, prefetch, check_fn
        self.layer_index = layer
        self._hooks = None
        self._layer = None

    @property
    def description(self) -> str:
        return f"swap scope {self.tag!r}"

    def __enter__(self):
        if self._layer is not None:
            raise SavedTensorsError(f"{self.description} entered twice; create one scope per layer")
        swapper, check_fn, prefetch = self.swapper, self.check_fn, self.prefetch
        hooks = HookContext(swapper, self.description,
                            lambda t: swapper._pack(self._layer, check_fn, t),
                            lambda p: swapper._unpack(prefetch, p))
        hooks.__enter__()                   # NOTE [one hook context]: refuses nesting
        try:
            self._layer = swapper._open_layer(self.tag, self.layer_index)
        except BaseException:
            hooks.__exit__(None, None, None)
            raise
        self._hooks = hooks
        return self

    def __exit__(self, exc_type, exc, tb):
        self._hooks.__exit__(exc_type, exc, tb)   # refuses an exit out of order
        self.swapper._close_layer(self._layer)
        return False

    @property
    def key_layer(self) -> int | None:
        """The layer number this scope's tensors are keyed by (after ``__enter__``)."""
        return None if self._layer is None else self._layer.index


_default: TensorSwapper | None = None


def default_swapper() -> TensorSwapper:
    """The process-wide :class:`TensorSwapper` behind :func:`swap_activations` (created on first
    use)."""
    global _default
    if _default is None:
        _default = TensorSwapper()
    return _default


def swap_activations(module_tag: str = "default", prefetch: bool = True, check_fn=None, *,
                     module_name: str | None = None, swapper: TensorSwapper | None = None):
    """Swap the tensors saved inside the returned context as one layer of ``module_tag``.

    Uses :func:`default_swapper` unless ``swapper`` is given; see :meth:`TensorSwapper.swap`
    for the arguments.

    Example::

        for layer in model.layers:
            with graphstash.swap_activations("layers.*.mlp"):
                x = layer.mlp(x)
    """
    if swapper is not None and not isinstance(swapper, TensorSwapper):
        raise TypeError(f"swapper: expected a TensorSwapper or None, got {type(swapper).__name__}")
    return (swapper or default_swapper()).swap(module_tag, prefetch, check_fn, module_name=module_name)

