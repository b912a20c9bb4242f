"""The saved-tensor core under stash, offload and swap (graphstash/_saved), on the CPU.

One hook context per thread (mixed nesting refused, both orders), autograd's in-place check
under the stash, eager overflow reported, ``with manager:`` exits in order, the errors that
name their argument, and every public module importable as a module.
"""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import graphstash
from graphstash import (ActivationOffloader, SavedTensorModifiedError, SavedTensorsError,
                        StashConfig, StashManager, StashOverflowError, TensorSwapper,
                        stash_activations)
from graphstash._saved import HookContext, innermost

B, H = 96, 8        # budget rows, row width


def _rows(gen, rows=B, width=H):
    """Row r holds r * 100 + column + noise: a misplaced row is a readable difference."""
    base = torch.arange(rows, dtype=torch.float32).unsqueeze(1) * 100 + torch.arange(width)
    return (base + torch.rand(rows, width, generator=gen)).requires_grad_(True)


def _contexts():
    """Each graphstash saved-tensor context, as a factory of a fresh context manager."""
    def stash():
        manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cpu")
        return stash_activations(torch.tensor([B // 2]), manager=manager, name="g")

    def offload():
        off = ActivationOffloader(device="cpu", min_tensor_bytes=0)

        class Forward:
            def __enter__(self):
                off.__enter__()
                self.group = off.group("grp")
                self.group.__enter__()

            def __exit__(self, *exc):
                self.group.__exit__(*exc)
                off.__exit__(*exc)
        return Forward()

    def swap():
        return TensorSwapper(device="cpu", min_tensor_bytes=0).swap("layers.*")

    return {"stash": stash, "offload": offload, "swap": swap}


@pytest.mark.parametrize("outer", ["stash", "offload", "swap"])
@pytest.mark.parametrize("inner", ["stash", "offload", "swap"])
def test_mixed_nesting_is_refused_with_one_error(outer, inner):
    """Every pair of contexts of different owners (each factory makes a new one; the same
    manager's stash contexts nest by design, see test_stash.py)."""
    factories = _contexts()
    with factories[outer]():
        top = innermost()
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with factories[inner]():
                pass
        assert innermost() is top                # the refused context left nothing behind
    assert innermost() is None


def test_hook_context_refuses_exit_out_of_order():
    a = HookContext("a", "context a", lambda t: t, lambda t: t)
    b = HookContext("b", "context b", lambda t: t, lambda t: t)
    a.__enter__()
    with pytest.raises(SavedTensorsError, match="do not nest"):
        b.__enter__()
    with pytest.raises(SavedTensorsError, match="exited while the innermost open context is"):
        b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert innermost() is None


@pytest.mark.parametrize("where", ["stashed", "kept"])
def test_in_place_write_to_saved_tensor_under_stash_raises_like_autograd(gen, where):
    """Plain autograd raises when a saved tensor was modified in place; so must the stash,
    for a tensor it stashed and for one it left on the device."""
    x = _rows(gen)
    # plain autograd, for reference
    y = x * 1
    z = y.exp()
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cpu")
    manager.begin_step()
    y = x * 1
    n = torch.tensor([int(torch.randint(1, B, (1,), generator=gen))])
    with stash_activations(n, manager=manager, name="exp"):
        z = y.exp()                               # saves its [B, H] output: budget-shaped
        small = y[:3].exp()                       # saves a [3, H] output: kept
    with stash_activations(n, manager=manager, name="next"):
        pass                                      # a schedule point: the stash is done
    target = z if where == "stashed" else small
    target.add_(1)
    with pytest.raises(SavedTensorModifiedError, match="modified in place") as info:
        (z.sum() + small.sum()).backward()
    assert isinstance(info.value, RuntimeError)   # catchable as autograd's error is
    manager.end_step()


def test_unmodified_saved_tensors_still_give_exact_gradients(gen):
    x = _rows(gen)
    n = torch.tensor([B])
    ref = torch.autograd.grad((x * 1).exp().sum() + (x[:3] * 2).exp().sum(), x)[0]
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cpu")
    manager.begin_step()
    with stash_activations(n, manager=manager):
        z = (x * 1).exp()
        small = (x[:3] * 2).exp()
    with stash_activations(n, manager=manager):
        pass
    got = torch.autograd.grad(z.sum() + small.sum(), x)[0]
    manager.end_step()
    assert torch.equal(ref, got)


def _overflowing_step(manager, gen):
    """One eager step whose stash needs more pages than the pool holds (host tier off)."""
    x = _rows(gen)
    manager.begin_step()
    with stash_activations(torch.tensor([B]), manager=manager, name="big"):
        z = (x * 1).exp()
    with stash_activations(torch.tensor([B]), manager=manager, name="next"):
        pass
    z.sum().backward()


def test_eager_overflow_raises_at_end_step(gen):
    config = StashConfig(min_tensor_bytes=0, page_size=16, initial_tokens=32, host_tier=False)
    manager = StashManager(config, device="cpu")
    _overflowing_step(manager, gen)
    with pytest.raises(StashOverflowError, match="gradients, are wrong"):
        manager.end_step()
    # sticky until handled: the next step says so again, clear_status() acknowledges it
    manager.begin_step()
    with pytest.raises(StashOverflowError):
        manager.end_step()
    manager.clear_status()
    manager.begin_step()
    manager.end_step()


def test_eager_overflow_can_warn_instead(gen):
    config = StashConfig(min_tensor_bytes=0, page_size=16, initial_tokens=32, host_tier=False)
    manager = StashManager(config, device="cpu", eager_overflow="warn")
    _overflowing_step(manager, gen)
    with pytest.warns(RuntimeWarning, match="the stash overflowed"):
        manager.end_step()
    with pytest.raises(ValueError, match="eager_overflow: expected one of"):
        StashManager(config, device="cpu", eager_overflow="ignore")


def test_end_step_without_overflow_is_silent(gen):
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cpu")
    x = _rows(gen)
    manager.begin_step()
    with stash_activations(torch.tensor([B // 3]), manager=manager):
        z = (x * 1).exp()
    with stash_activations(torch.tensor([B // 3]), manager=manager):
        pass
    z.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager.end_step()


def test_with_manager_exited_out_of_order_is_refused():
    a, b = StashManager(device="cpu"), StashManager(device="cpu")
    a.__enter__()
    b.__enter__()
    with pytest.raises(SavedTensorsError, match="exited out of order"):
        a.__exit__(None, None, None)
    # a is not left behind as the thread's default
    assert graphstash.current_manager() is b
    b.__exit__(None, None, None)
    assert graphstash.current_manager() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("make", [lambda: ActivationOffloader(device="cuda"),
                                  lambda: TensorSwapper(device="cuda"),
                                  lambda: StashManager(device="cuda")],
                         ids=["offloader", "swapper", "manager"])
def test_cuda_device_without_cuda_names_device(make):
    with pytest.raises(ValueError, match="device: 'cuda' requested but torch sees no CUDA"):
        make()


def test_status_on_an_unusable_device_names_status():
    with pytest.raises(ValueError, match="status: expected a CUDA or CPU device, got meta"):
        StashManager(status=torch.zeros(8, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="status: expected an int32 tensor of shape"):
        StashManager(status=torch.zeros(8, dtype=torch.int64), device="cpu")


def test_require_zero_tail_refuses_zero_tail_false(gen):
    """An op whose backward reads the rows past the counts (e.g. grouped_mm's masked dense
    fallback) refuses a context that skips zeroing them; with the default it is fine."""
    manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4 * B), device="cpu")
    n = torch.tensor([B // 2])
    with stash_activations(n, manager=manager, name="experts", zero_tail=False):
        with pytest.raises(ValueError, match="zero_tail: stash_activations group 'experts'"):
            graphstash.stash.require_zero_tail("the masked fallback")
    with stash_activations(n, manager=manager, name="experts"):
        graphstash.stash.require_zero_tail("the masked fallback")
    graphstash.stash.require_zero_tail("the masked fallback")     # no context: nothing


def test_mark_not_movable_is_the_one_opt_out(gen):
    """A tensor marked once stays where it is for stash and offload alike."""
    x = _rows(gen)
    y = graphstash.mark_not_movable(x * 1)
    off = ActivationOffloader(device="cpu", min_tensor_bytes=0)
    with off:
        with off.group("g"):
            z = y.exp()
    assert off.summary()["g"] == z.numel() * 4     # the exp output moved, marked y did not
    z.sum().backward()
    for name in ("mark_not_stashable", "mark_not_offloadable"):     # no second spelling
        assert not hasattr(graphstash, name) and not hasattr(graphstash.stash, name)
        assert not hasattr(off, name)


def _public_modules() -> list[str]:
    """Every module of the package no part of whose dotted name starts with ``_``."""
    import pkgutil

    names = [m.name for m in pkgutil.walk_packages(graphstash.__path__, "graphstash.")]
    return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


@pytest.mark.parametrize("name", _public_modules())
def test_import_gives_the_module(name):
    import types

    module = importlib.import_module(name)
    assert isinstance(module, types.ModuleType)
    parent, _, leaf = name.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_swap_is_the_module_and_not_a_function():
    """The compatibility shims of 0.1 are gone (CHANGELOG.md): ``graphstash.swap`` is the
    module, not callable, and has no ``swap()``; ``OffloadError`` is no more."""
    import graphstash.swap as swap_module

    assert graphstash.swap is swap_module and not callable(swap_module)
    assert not hasattr(swap_module, "swap") and not hasattr(graphstash, "OffloadError")
