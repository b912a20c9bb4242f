"""Tensor swap on the CPU path: (layer, index) keys, wildcard tags, prefetch of the previous
layer, last layer kept, misuse errors and in-place detection."""
from __future__ import annotations

import pytest
import torch

from graphstash.errors import SavedTensorModifiedError, SavedTensorsError
from graphstash.offload import ActivationOffloader
from graphstash.swap import TensorSwapper, default_swapper, swap_activations as swap

from _marks import Marker

WIDTH = 40


def _layers(gen, n=4):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.SiLU(),
                                torch.nn.Linear(WIDTH, WIDTH)) for _ in range(n)]


def _input(gen, rows=16):
    return torch.randn(rows, WIDTH, generator=gen) + torch.arange(rows, dtype=torch.float32)[:, None]


def _step(layers, x0, swapper=None, log=None, named=False, **kw):
    x = x0.clone().requires_grad_()
    h = x * 0.5
    for i, layer in enumerate(layers):
        if swapper is None:
            h = layer(h)
            continue
        name = {"module_name": f"layers.{10 + i}.mlp"} if named else {}
        if log is not None:
            h = Marker.apply(h, log, f"end {i}")
        with swap("layers.*.mlp", swapper=swapper, **name, **kw):
            h = layer(h)
        if log is not None:
            h = Marker.apply(h, log, f"begin {i}")
    h.pow(2).sum().backward()
    grads = [p.grad.clone() for l in layers for p in l.parameters()] + [x.grad.clone()]
    for l in layers:
        l.zero_grad(set_to_none=True)
    return grads


def _assert_same(a, b):
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"gradient {i} differs"


def test_gradients_exact_keys_and_last_layer_kept(gen):
    layers = _layers(gen)
    sw = TensorSwapper(min_tensor_bytes=256, device="cpu")
    for step in range(3):
        x0 = _input(gen)
        ref = _step(layers, x0)
        sw.transfer_log.clear()
        _assert_same(_step(layers, x0, sw), ref)
        d2h = [k for op, k in sw.transfer_log if op == "d2h"]
        # each layer saves: its input, linear1 output (SiLU input), SiLU output = 3 tensors
        swapped_layers = 4 if step == 0 else 3            # the last layer learned after step 0
        assert d2h == [(l, i) for l in range(swapped_layers) for i in range(3)]
        h2d = [k for op, k in sw.transfer_log if op == "h2d"]
        assert sorted(h2d) == sorted(d2h if step else d2h[:-3])  # layer 3 adopted at step 0
        if step == 0:
            allocations = sw.host_pool.allocations
        assert sw.host_pool.allocations == allocations and sw.host_pool.in_use_bytes == 0
        assert sw.outstanding == 0


def test_wildcard_module_names(gen):
    layers = _layers(gen, n=3)
    sw = TensorSwapper(min_tensor_bytes=256, device="cpu")
    x0 = _input(gen)
    ref = _step(layers, x0)
    _assert_same(_step(layers, x0, sw, named=True), ref)
    d2h = [k for op, k in sw.transfer_log if op == "d2h"]
    assert {l for l, _ in d2h} == {10, 11, 12}
    with pytest.raises(ValueError, match="module_name.*does not match"):
        sw.swap("layers.*.mlp", module_name="layers.3.attn")
    with pytest.raises(ValueError, match="exactly one"):
        sw.swap("layers.*.experts.*", module_name="layers.1.experts.2")
    with pytest.raises(SavedTensorsError, match="layer 4 entered twice"):
        for _ in range(2):
            with sw.swap("dup.*", module_name="dup.4"):
                pass


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_order(gen, prefetch):
    layers = _layers(gen)
    sw = TensorSwapper(min_tensor_bytes=256, device="cpu")
    x0 = _input(gen)
    ref = _step(layers, x0)
    _step(layers, x0, sw)                                 # learn the layer count
    sw.transfer_log.clear()
    log = sw.transfer_log
    _assert_same(_step(layers, x0, sw, log=log, prefetch=prefetch), ref)
    events = list(log)
    for l in (2, 1, 0):
        fetches = [events.index(("h2d", (l, i))) for i in range(3)]
        own_begin = events.index(("bwd", f"begin {l}"))
        if prefetch:
            # all of layer l arrives during the backward of layer l + 1
            assert events.index(("bwd", f"begin {l + 1}")) < min(fetches)
            assert max(fetches) < own_begin
        else:
            assert min(fetches) > own_begin               # fetched on use


def test_uneven_layers_prefetch_everything(gen):
    # layer 0 saves 3 tensors, layer 1 saves 2: layer 1's saves prefetch 1 and 2 of layer 0
    sw = TensorSwapper(min_tensor_bytes=0, device="cpu")
    x = (torch.randn(8, 8, generator=gen) + 2).requires_grad_()
    for _ in range(2):
        sw.transfer_log.clear()
        h = x * 1
        with sw.swap("u.*"):
            h = torch.sin(torch.cos(torch.exp(h * 0.1)))       # saves exp and cos outputs...
            h = h * h.detach()                                  # ...and the constant factor
        with sw.swap("u.*"):
            h = torch.tanh(h) * torch.sigmoid(h)                # saves both outputs
        with sw.swap("u.*"):
            h = h * 3                                           # saves nothing big enough
        h.sum().backward()
    fetched = [k for op, k in sw.transfer_log if op == "h2d"]
    assert sorted(fetched) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    ref = x.detach().clone().requires_grad_()
    r = torch.sin(torch.cos(torch.exp(ref * 1 * 0.1)))
    r = r * r.detach()
    ((torch.tanh(r) * torch.sigmoid(r)) * 3).sum().backward()
    assert torch.equal(x.grad / 2, ref.grad)


def test_check_fn_and_min_size(gen):
    sw = TensorSwapper(min_tensor_bytes=1024, device="cpu")
    big = (torch.randn(32, 32, generator=gen) + 1).requires_grad_()
    small = (torch.randn(8, generator=gen) + 1).requires_grad_()
    rejected = []

    def check(t):
        keep = t.dim() == 2 and t.shape[1] == 16
        if keep:
            rejected.append(t.shape)
        return not keep

    with swap("c.*", check_fn=check, swapper=sw):
        a = torch.sin(big * 1)                      # swapped
        b = torch.sin(big[:, :16] * 1)              # rejected by check_fn
        c = torch.sin(small * 1)                    # too small
    assert rejected == [torch.Size([32, 16])]
    assert sw.swapped_bytes("c.*") == 32 * 32 * 4
    (a.sum() + b.sum() + c.sum()).backward()
    assert torch.equal(small.grad, torch.cos(small).detach())


def test_misuse_and_inplace(gen):
    sw = TensorSwapper(min_tensor_bytes=0, device="cpu")
    with sw.swap("a.*"):
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with sw.swap("b.*"):
                pass
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with ActivationOffloader(device="cpu"):
                pass
    scope = sw.swap("a.*")
    with scope:
        pass
    with pytest.raises(SavedTensorsError, match="entered twice"):
        scope.__enter__()
    with pytest.raises(TypeError, match="module_tag"):
        sw.swap("")
    with pytest.raises(TypeError, match="check_fn"):
        sw.swap("a.*", check_fn=3)
    with pytest.raises(TypeError, match="prefetch"):
        sw.swap("a.*", prefetch="yes")
    with pytest.raises(TypeError, match="swapper"):
        swap("a.*", swapper=object())
    sw.reset()
    x = torch.randn(16, 16, generator=gen).requires_grad_()
    with sw.swap("m.*"):
        h = x * 2
        y = torch.sin(h)
    with sw.swap("m.*"):
        y = torch.cos(y)
    h.add_(1)
    with pytest.raises(SavedTensorModifiedError, match="modified in place"):
        y.sum().backward()
    sw.reset()
    assert sw.host_pool.in_use_bytes == 0 and sw.outstanding == 0


def test_microbatches_restart_keys_and_abandoned_forward(gen):
    layers = _layers(gen, n=2)
    sw = TensorSwapper(min_tensor_bytes=256, device="cpu")
    for _ in range(2):                                   # forward/backward per microbatch
        sw.transfer_log.clear()
        _step(layers, _input(gen), sw)
        assert {k[0] for op, k in sw.transfer_log if op == "d2h"} <= {0, 1}
    x = _input(gen).requires_grad_()
    with sw.swap("layers.*.mlp"):
        y = layers[0](x * 1)
    assert sw.host_pool.in_use_bytes > 0
    del y                                                # dropped without backward
    sw.transfer_log.clear()
    _step(layers, _input(gen), sw)
    assert [k for op, k in sw.transfer_log if op == "d2h"][0] == (0, 0)
    assert sw.host_pool.in_use_bytes == 0


def test_views_of_one_storage_share_one_copy(gen):
    z = (torch.randn(8, WIDTH, generator=gen) + 1).requires_grad_()
    x0 = _input(gen, rows=8)

    def layer(h):
        p = torch.softmax(h, dim=-1)             # softmax saves p
        y = p.t() @ z                            # mm saves p.t(): the same bytes
        return (y.sum() + torch.sin(p[2:]).sum()) * h   # sin saves p[2:]: inside p's bytes

    def run(sw=None):
        x = x0.clone().requires_grad_()
        h = x * 0.5
        for _ in range(3):
            if sw is None:
                h = layer(h)
            else:
                with sw.swap("v.*"):
                    h = layer(h)
        h.pow(2).sum().backward()
        grads = [x.grad.clone(), z.grad.clone()]
        z.grad = None
        return grads

    sw = TensorSwapper(min_tensor_bytes=0, device="cpu")
    ref = run()
    for step in range(2):
        sw.transfer_log.clear()
        _assert_same(run(sw), ref)
        d2h = [k for op, k in sw.transfer_log if op == "d2h"]
        # per layer: p (shared by its three saves) and the two factors of the last product
        swapped = 3 if step == 0 else 2                 # the last layer learned after step 0
        assert [k for k in d2h if k[1] == 0] == [(l, 0) for l in range(swapped)]
        assert len(d2h) == 3 * swapped, d2h
        assert sw.swapped_bytes("v.*") == swapped * (8 * WIDTH * 4 + 4 + 8 * WIDTH * 4)
        assert sw.host_pool.in_use_bytes == 0 and sw.outstanding == 0


def test_default_swapper_is_shared():
    assert default_swapper() is default_swapper()
    scope = swap("z.*")
    assert scope.swapper is default_swapper()
