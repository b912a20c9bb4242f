"""The MoE layer (graphstash.moe.moe_layer, NOTE [moe layer]), what expert_mlp(handle=) accepts
(NOTE [regathered input]) and the argument errors of the MoE path, on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from graphstash.models import MoEConfig, MoEModel, preset
from graphstash.moe import (budget_rows, combine, dispatch, expert_mlp, grouped_mm, moe_layer,
                            prepare_experts)
from graphstash.reference.moe import dense_moe
from graphstash.stash import StashConfig, StashManager

from _moe_data import routing, tokens

T, H, F, E, K = 24, 8, 12, 4, 2


def _weights(gen, gated, dtype=torch.float32):
    w1 = (torch.rand(E, 2 * F if gated else F, H, generator=gen, dtype=torch.float64) - 0.5)
    w2 = (torch.rand(E, H, F, generator=gen, dtype=torch.float64) - 0.5)
    return w1.to(dtype).requires_grad_(), w2.to(dtype).requires_grad_()


def _mlp(w1, w2, gated):
    def mlp(e, rows):
        h = rows @ w1[e].t()
        if gated:
            gate, up = h.chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate) * up) @ w2[e].t()
        return torch.nn.functional.silu(h) @ w2[e].t()
    return mlp


# ---- the layer -------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("budget", ["capacity", "rows", "dropless"])
def test_layer_is_the_dense_moe_with_its_gradients(gen, gated, budget):
    """moe_layer = sum_k w[t, k] * mlp_k(x[t]) (fp64), in every budget form, and the
    gradients of a projection loss reach x, the router weights and both expert weights."""
    x = (tokens(T, H, gen, torch.float64) / T).requires_grad_()
    idx, w = routing(T, K, E, gen, torch.float64)
    w = w.requires_grad_()
    w1, w2 = _weights(gen, gated, torch.float64)
    kw = {"capacity": dict(capacity_factor=1.0, pad_multiple=4),
          "rows": dict(budget=budget_rows(T, K, E, capacity_factor=1.5)),
          "dropless": {}}[budget]
    out = moe_layer(x, idx, w, w1, w2, E, gated=gated, **kw)
    want = dense_moe(x, idx, w, _mlp(w1, w2, gated))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    proj = torch.randn(T, H, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out * proj).sum(), (x, w, w1, w2))
    ref = torch.autograd.grad((want * proj).sum(), (x, w, w1, w2))
    for a, b, name in zip(got, ref, ("x", "topk_weight", "w1", "w2")):
        assert b.abs().max() > 1e-3, name                       # the loss reaches it
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_layer_is_the_recipe_bit_for_bit(gen):
    """The layer runs exactly the hand-written recipe README shows (fp32, bitwise)."""
    x = tokens(T, H, gen) / T
    idx, w = routing(T, K, E, gen)
    w1, w2 = _weights(gen, True)
    budget = budget_rows(T, K, E, capacity_factor=1.25, pad_multiple=2)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=2)
    y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                   handle=handle)
    want = combine(y, handle, weighted=False)
    got = moe_layer(x, idx, w, w1, w2, E, gated=True, capacity_factor=1.25, pad_multiple=2)
    assert torch.equal(got, want)


def test_layer_stashes_through_the_manager_it_is_given(gen):
    """stash=True takes the current manager (none: nothing stashed), a StashManager is used
    as given; the group carries the layer's name and its tensors go to the pool."""
    x = tokens(T, H, gen) / T
    idx, w = routing(T, K, E, gen)
    w1, w2 = _weights(gen, True)
    proj = torch.randn(T, H, generator=gen)
    budget = 3 * T * K                            # dead rows: the stash pays

    def run(stash, manager=None):
        for p in (w1, w2):
            p.grad = None
        if manager is not None:
            manager.begin_step()
            with manager:
                out = moe_layer(x, idx, w, w1, w2, E, gated=True, budget=budget, stash=stash,
                                name="layer0.experts")
                (out * proj).sum().backward()
            manager.end_step()
        else:
            out = moe_layer(x, idx, w, w1, w2, E, gated=True, budget=budget, stash=stash)
            (out * proj).sum().backward()
        return out.detach(), w1.grad.clone(), w2.grad.clone()

    plain = run(False)
    for a, b in zip(run(True), plain):                      # no manager current: unstashed
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for stash in ("current", "given"):
        manager = StashManager(StashConfig(min_tensor_bytes=0, initial_tokens=4096,
                                           policy="always"), device="cpu")
        got = run(True if stash == "current" else manager, manager)
        for a, b in zip(got, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert [name for _, _, name in manager.schedule] == ["layer0.experts"] * 2, stash
        assert manager.read_status()["buffers"], stash      # the pool took the rows
    with pytest.raises(TypeError, match="stash: expected False, True"):
        moe_layer(x, idx, w, w1, w2, E, gated=True, budget=budget, stash="yes")


def test_layer_argument_errors_name_the_argument(gen):
    x = tokens(T, H, gen)
    idx, w = routing(T, K, E, gen)
    w1, w2 = _weights(gen, False)
    with pytest.raises(ValueError, match="budget: give capacity_factor or budget, not both"):
        moe_layer(x, idx, w, w1, w2, E, capacity_factor=1.0, budget=100)
    with pytest.raises(TypeError, match=r"x: expected the experts' dtype torch.float32 "
                                        r"\(that of w1\), got torch.float64"):
        moe_layer(x.double(), idx, w.double(), w1, w2, E, capacity_factor=1.0)
    with pytest.raises(ValueError, match="topk_idx: expected an int32 or int64 \\[T, K\\]"):
        moe_layer(x, idx[:, 0], w, w1, w2, E, capacity_factor=1.0)


# ---- expert_mlp(handle=): the input must be what a gather of the tokens gives --------------
def _dispatched(gen, gated=True):
    x = (tokens(T, H, gen) / T).requires_grad_()
    idx, w = routing(T, K, E, gen)
    w1, w2 = _weights(gen, gated)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget_rows(T, K, E,
                                                                         capacity_factor=2.0))
    return x, w1, w2, permuted, counts, handle


def test_handle_refuses_a_function_of_the_permuted_output(gen):
    """Issue 27.2: x = dropout(permuted) with handle= gave w1.grad 25.5 off (the backward
    gathered the tokens, not x); any tensor but the permuted output itself is refused."""
    x, w1, w2, permuted, counts, handle = _dispatched(gen)
    for name, other in (("dropout", torch.nn.functional.dropout(permuted, 0.5)),
                        ("scaled", permuted * 2), ("copy", permuted.clone()),
                        ("view", permuted.view(permuted.shape))):
        with pytest.raises(ValueError, match="handle: x must be the very tensor this dispatch "
                                             "returned"):
            expert_mlp(other, w1, w2, counts, gated=True, handle=handle)
    _, _, _, other_permuted, _, _ = _dispatched(gen)            # another dispatch's output
    with pytest.raises(ValueError, match="handle: x must be the very tensor"):
        expert_mlp(other_permuted, w1, w2, counts, gated=True, handle=handle)
    y = expert_mlp(permuted, w1, w2, counts, gated=True, handle=handle)   # the output itself
    assert y.shape == (handle.budget_rows, H)


def test_handle_refuses_tokens_or_permuted_modified_in_place(gen):
    """Issue 27.2: tokens modified in place between dispatch and expert_mlp gave w1.grad 14.2
    off with no version error; the permuted output modified in place likewise."""
    x, w1, w2, permuted, counts, handle = _dispatched(gen)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(ValueError, match="handle: the tokens given to dispatch were modified "
                                         "in place"):
        expert_mlp(permuted, w1, w2, counts, gated=True, handle=handle)
    x, w1, w2, permuted, counts, handle = _dispatched(gen)
    with torch.no_grad():
        permuted[0] += 1
    with pytest.raises(ValueError, match="x: the permuted output was modified in place"):
        expert_mlp(permuted, w1, w2, counts, gated=True, handle=handle)


@pytest.mark.parametrize("hooks", [False, True])
def test_handle_refuses_tokens_modified_before_backward(gen, hooks):
    """Tokens modified after the forward, before backward: refused before the regather,
    also where saved-tensor hooks hold the tokens (autograd's own check does not run then)."""
    import contextlib

    x, w1, w2, permuted, counts, handle = _dispatched(gen)
    hold = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks
            else contextlib.nullcontext())
    with hold:
        y = expert_mlp(permuted, w1, w2, counts, gated=True, handle=handle)
    with torch.no_grad():
        x.add_(1)
    error = ValueError if hooks else RuntimeError               # ours, or autograd's
    match = "handle: the tokens given to dispatch" if hooks else "modified by an inplace"
    with pytest.raises(error, match=match):
        y.sum().backward()


def test_handle_must_be_a_dispatch_handle(gen):
    x, w1, w2, permuted, counts, handle = _dispatched(gen)
    with pytest.raises(TypeError, match="handle: expected the DispatchHandle returned by "
                                        "dispatch\\(\\), got str"):
        expert_mlp(permuted, w1, w2, counts, gated=True, handle="h")


def test_handle_regathered_gradients_equal_kept_input(gen):
    """The accepted path: gradients with handle= equal those with the input kept (the check
    refuses only what would differ)."""
    results = []
    for regather in (False, True):
        gen.manual_seed(7)
        x, w1, w2, permuted, counts, handle = _dispatched(gen)
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                       handle=handle if regather else None)
        out = combine(y, handle, weighted=False)
        proj = torch.randn(out.shape, generator=gen)
        results.append(torch.autograd.grad((out * proj).sum(), (x, w1, w2)))
    for a, b in zip(*results):
        assert b.abs().max() > 1e-3
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- integer, bool, meta and transposed arguments ------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_expert_mlp_and_grouped_mm_refuse_non_float_tensors(gen, dtype):
    """Issue 27.7: int64 tensors were accepted and SiLU truncated to integers."""
    x = tokens(16, H, gen)
    w1, w2 = (w.detach() for w in _weights(gen, False))
    counts = torch.tensor([6, 0, 5, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=f"x: expected .*got {dtype}"):
        expert_mlp(x.to(dtype), w1.to(dtype), w2.to(dtype), counts)
    with pytest.raises(TypeError, match=f"w1: expected .*got {dtype}"):
        expert_mlp(x, w1.to(dtype), w2, counts)
    with pytest.raises(TypeError, match=f"w2: expected .*got {dtype}"):
        expert_mlp(x, w1, w2.to(dtype), counts)
    with pytest.raises(TypeError, match=f"x: expected .*got {dtype}"):
        grouped_mm(x.to(dtype), w1.to(dtype), counts)
    with pytest.raises(TypeError, match=f"weight: expected .*got {dtype}"):
        grouped_mm(x, w1.to(dtype), counts)


def test_meta_tensors_and_transposed_weights_name_the_argument(gen):
    x = tokens(16, H, gen)
    w1, w2 = (w.detach() for w in _weights(gen, True))
    counts = torch.tensor([6, 0, 5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="x: expected a tensor on a CUDA device or the CPU, "
                                         "got .*on meta"):
        grouped_mm(x.to("meta"), w1.to("meta"), counts.to("meta"))
    with pytest.raises(ValueError, match=r"w1: expected a 3-D tensor \[experts, 2 \* ffn, 8\].*"
                                         r"it looks transposed"):
        expert_mlp(x, w1.transpose(1, 2), w2, counts, gated=True)
    with pytest.raises(ValueError, match=r"weight: expected a 3-D tensor \[experts, out, 8\]"):
        grouped_mm(x, w1.transpose(1, 2).contiguous(), counts)
    with pytest.raises(TypeError, match="dtype: expected a floating torch.dtype"):
        prepare_experts("cpu", torch.int32)


# ---- the reference model and its configuration ---------------------------------------------
@pytest.mark.parametrize("field, value, error", [
    ("layers", -1, ValueError), ("layers", 0, ValueError), ("layers", 2.5, TypeError),
    ("num_experts", 0, ValueError), ("heads", 0, ValueError), ("ffn", 0, ValueError),
    ("topk", 129, ValueError), ("hidden", True, TypeError), ("capacity_factor", 0.0, ValueError),
    ("capacity_factor", float("nan"), ValueError), ("pad_multiple", 0, ValueError),
    ("gated", 1, TypeError),
])
def test_config_errors_name_the_field(field, value, error):
    """Issue 27.8: MoEConfig(layers=-1) built a model of 0 blocks that ran; topk above the
    experts, zero sizes and float layer counts gave raw errors later."""
    with pytest.raises(error, match=f"^{field}: expected"):
        MoEConfig(**{field: value})
    with pytest.raises(error, match=f"^{field}: expected"):
        preset("qwen3-30b-a3b", **{field: value})


def test_config_heads_must_divide_hidden_with_attention():
    with pytest.raises(ValueError, match="heads: expected a divisor of hidden=256, got 3"):
        MoEConfig(attention=True, heads=3)
    MoEConfig(attention=False, heads=3)                       # unused without attention


def test_model_dtype_and_input_errors_name_the_argument(gen):
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, layers=1, num_tokens=8)
    with pytest.raises(TypeError, match="dtype: expected a torch.dtype .*got str 'bfloat16'"):
        MoEModel(config, dtype="bfloat16")
    with pytest.raises(TypeError, match="dtype: expected a floating torch.dtype"):
        MoEModel(config, dtype=torch.int32)
    model = MoEModel(config)
    x = tokens(8, 16, gen)
    with pytest.raises(TypeError, match=r"x: expected the model's dtype torch.float32, got "
                                        r"torch.float64"):
        model(x.double())
    with pytest.raises(TypeError, match="config: expected a graphstash.models.MoEConfig"):
        MoEModel({"hidden": 16})


def test_plain_peer_expert_parallel_raises_no_future_warning(tmp_path):
    """Issue 27.11: the peer's exchange used torch.distributed.nn.functional.all_to_all_single,
    which warns FutureWarning on every call; one rank over gloo, warnings as errors."""
    code = f"""
import os, warnings, torch, torch.distributed as dist
warnings.simplefilter("error", FutureWarning)
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from graphstash.models import MoEConfig, MoEModel
config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=1, num_tokens=12)
model = MoEModel(config, mode="plain", group=dist.group.WORLD)
x = torch.randn(12, 16, requires_grad=True)
(model(x) * torch.randn(12, 16)).sum().backward()
assert x.grad.abs().max() > 0
dist.destroy_process_group()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


# ---- on a GPU (CuPy kernels) ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_handle_checks_and_layer_on_the_gpu(gen, dtype):
    """The CuPy path: the layer equals the hand-written recipe bitwise, the regathered
    gradients equal the kept-input ones bitwise, and the handle refuses dropout(permuted) and
    tokens modified in place."""
    x = (tokens(T, H, gen) / T).to("cuda", dtype).requires_grad_()
    idx, w = routing(T, K, E, gen)
    idx, w = idx.cuda(), w.to("cuda", dtype)
    w1, w2 = (p.detach().to("cuda", dtype).requires_grad_() for p in _weights(gen, True))
    proj = torch.randn(T, H, generator=gen).to("cuda", dtype)
    budget = budget_rows(T, K, E, capacity_factor=2.0, pad_multiple=8)
    grads = []
    for regather in (False, True):
        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=8)
        y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True,
                       handle=handle if regather else None)
        out = combine(y, handle, weighted=False)
        grads.append((out.detach(),) + torch.autograd.grad((out.float() * proj).sum(),
                                                           (x, w1, w2)))
    for name, a, b in zip(("out", "x.grad", "w1.grad", "w2.grad"), *grads):
        assert torch.equal(a, b), f"{name}: regathered differs by {(a - b).abs().max()}"
    layer = moe_layer(x, idx, w, w1, w2, E, gated=True, budget=budget, pad_multiple=8)
    assert torch.equal(layer.detach(), grads[0][0])
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=8)
    with pytest.raises(ValueError, match="handle: x must be the very tensor"):
        expert_mlp(torch.nn.functional.dropout(permuted, 0.5), w1, w2, counts, gated=True,
                   handle=handle)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(ValueError, match="handle: the tokens given to dispatch were modified"):
        expert_mlp(permuted, w1, w2, counts, gated=True, handle=handle)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_fallback_ignores_garbage_past_the_counts_on_the_gpu(gen, dtype):
    """Issue 27.3 on a GPU: NaN rows past the counts reach neither the masked product nor its
    gradients, which equal the loop's."""
    from graphstash.moe.experts import grouped_mm_grads

    x = (tokens(32, H, gen) / 32).to("cuda", dtype)
    w = (torch.rand(3, 16, H, generator=gen) - 0.5).to("cuda", dtype)
    g = (torch.rand(32, 16, generator=gen) - 0.5).to("cuda", dtype)
    counts = torch.tensor([9, 0, 14], dtype=torch.int32, device="cuda")
    want = grouped_mm_grads(g, x, w, counts, "loop")
    x[23:], g[23:] = float("nan"), float("nan")
    got = grouped_mm_grads(g, x, w, counts, "masked")
    assert torch.isfinite(got[1]).all()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], **tol)
    torch.testing.assert_close(got[0][:23], want[0][:23], **tol)
