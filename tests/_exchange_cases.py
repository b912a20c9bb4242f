"""The cases of the live-row exchange tests, run by every rank of a group (gloo on the CPU,
CUDA IPC on one GPU) against the one-device reference.

Every rank builds the data of every rank from one seed: rank ``r``'s tokens hold ``1000 * r``
plus their index (``_moe_data.tokens``), so a row in the wrong place is a readable diff. The
one-device reference dispatches the tokens of all ranks with every expert (``dispatch(group=
None)``, dropless), runs the same experts and combines; a rank compares its own outputs and the
gradients of its tokens, router weights and local experts with the reference's. The loss is a
fixed random projection of the output (it reaches every parameter), and the reference
gradients are checked to be far from zero.
"""
from __future__ import annotations

import math

import torch

from graphstash import _layout as L
from graphstash.moe import budget_rows, combine, dispatch, expert_mlp

from _moe_data import routing, tokens

H, F, K = 16, 12, 2


def rank_data(seed: int, rank: int, T: int, E: int, device, dtype=torch.float32, skew=None):
    """Rank ``rank``'s tokens ``[T, H]``, routing ``[T, K]`` and output projection."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = tokens(T, H, gen, torch.float64, offset=1000 * rank) / (1000 * (rank + 1))
    idx, w = routing(T, K, E, gen, torch.float64, skew=skew)
    proj = torch.randn(T, H, generator=gen, dtype=torch.float64)
    return x.to(device, dtype), idx.to(device), w.to(device, dtype), proj.to(device, dtype)


def expert_weights(seed: int, E: int, device, dtype=torch.float32, gated=True):
    """Full gated expert weights (HF layout): w1 ``[E, 2F, H]``, w2 ``[E, H, F]``."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, (2 if gated else 1) * F, H, generator=gen, dtype=torch.float64) / math.sqrt(H)
    w2 = torch.randn(E, H, F, generator=gen, dtype=torch.float64) / math.sqrt(F)
    return w1.to(device, dtype), w2.to(device, dtype)


def moe_layer(x, idx, w, w1, w2, E, *, budget, pad, exchange=None, status=None,
              weighted=False, stash=None):
    """dispatch -> gated expert MLP -> combine; the router weights scale the activations
    (``permuted_weights``) or, ``weighted``, the combine."""
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, pad_multiple=pad,
                                        exchange=exchange, status=status)
    row_weight = None if weighted else handle.permuted_weights()

    def experts():
        return expert_mlp(permuted, w1, w2, counts, row_weight, gated=True, handle=handle)

    if stash is not None:
        with stash(handle):
            y = experts()
    else:
        y = experts()
    return combine(y, handle, weighted=weighted), handle


def reference(seed: int, world: int, T: int, E: int, device, *, weighted=False, skew=None,
              layers=1):
    """One device, all ranks' tokens, every expert, dropless: per rank the output, the
    gradients of its tokens and router weights; the gradients of every expert's weights."""
    data = [rank_data(seed, r, T, E, device, skew=skew) for r in range(world)]
    x = torch.cat([d[0] for d in data]).requires_grad_()
    idx = torch.cat([d[1] for d in data])
    w = torch.cat([d[2] for d in data]).requires_grad_()
    proj = torch.cat([d[3] for d in data])
    w1, w2 = (t.requires_grad_() for t in expert_weights(seed, E, device))
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    h = x
    for _ in range(layers):
        out, _ = moe_layer(h, idx, w, w1, w2, E, budget=None, pad=None, status=status,
                           weighted=weighted)
        h = h + out
    (h * proj).sum().backward()
    grads = (x.grad, w.grad, w1.grad, w2.grad)
    for g in grads:
        assert g.abs().max() > 1e-3, "reference gradients must be far from zero"
    return [t.chunk(world) if t is not None else None for t in (h.detach(), x.grad, w.grad)], \
        (w1.grad, w2.grad)


def run_rank(transport, seed: int, T: int, E: int, device, *, budget, pad, weighted=False,
             skew=None, layers=1, stash=None, status=None):
    """This rank's forward and backward through ``transport``; returns its output and
    gradients ``(out, gx, gw, g_w1, g_w2)`` (expert gradients of its local experts)."""
    rank, world = transport.rank, transport.world_size
    x, idx, w, proj = rank_data(seed, rank, T, E, device, skew=skew)
    x.requires_grad_(), w.requires_grad_()
    El = E // world
    w1, w2 = (t[rank * El:(rank + 1) * El].clone().requires_grad_()
              for t in expert_weights(seed, E, device))
    if status is None:
        status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    h = x
    for _ in range(layers):
        out, _ = moe_layer(h, idx, w, w1, w2, E, budget=budget, pad=pad, exchange=transport,
                           status=status, weighted=weighted, stash=stash)
        h = h + out
    (h * proj).sum().backward()
    return h.detach(), x.grad, w.grad, w1.grad, w2.grad, status


def compare(mine, ref, rank: int, world: int, E: int, *, rtol=1e-5, atol=1e-6,
            exact: bool = False) -> None:
    """Assert this rank's results equal the reference's (``exact``: bitwise)."""
    (outs, gxs, gws), (gw1, gw2) = ref
    out, gx, gw, g1, g2 = mine[:5]
    El = E // world
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=rtol, atol=atol)
    pairs = [("output", out, outs[rank]), ("x.grad", gx, gxs[rank]),
             ("topk_weight.grad", gw, gws[rank]),
             ("w1.grad", g1, gw1[rank * El:(rank + 1) * El]),
             ("w2.grad", g2, gw2[rank * El:(rank + 1) * El])]
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"rank {rank} {n}: {m}")


def fitting_budget(T: int, world: int, E: int, pad) -> int:
    """A budget no routing exceeds: every pair of every rank."""
    return budget_rows(T * world, K, E, capacity_factor=float(world), pad_multiple=pad,
                       world_size=world)
