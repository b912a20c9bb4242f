"""Pipeline schedules the stash tests run on :class:`graphstash.models.ExpertStack`:
an interleaved 1F1B order and a runner that executes it, gradients accumulating."""
from __future__ import annotations

import torch

from graphstash.models import ExpertStack


def one_f_one_b(microbatches: int, chunks: int, warmup: int | None = None) -> list:
    """An interleaved 1F1B-like order: ``[("F" | "B", microbatch, chunk), ...]``.

    Forwards run microbatch by microbatch through chunks ``0..C-1``; after ``warmup`` forwards
    (default ``C + 1``) one backward follows each forward where its dependencies allow
    (chunk ``c`` of a microbatch after its chunk ``c + 1`` and after its whole forward).
    """
    warmup = chunks + 1 if warmup is None else warmup
    fwd = [(m, c) for m in range(microbatches) for c in range(chunks)]
    bwd = [(m, c) for m in range(microbatches) for c in reversed(range(chunks))]
    done_f, order, fi, bi = set(), [], 0, 0
    while fi < len(fwd) or bi < len(bwd):
        b_ready = bi < len(bwd) and (bwd[bi][0], chunks - 1) in done_f
        if fi < len(fwd) and (fi < warmup or not b_ready or len(order) % 2 == 0):
            order.append(("F",) + fwd[fi])
            done_f.add(fwd[fi])
            fi += 1
        else:
            order.append(("B",) + bwd[bi])
            bi += 1
    return order


def run_schedule(model: ExpertStack, inputs: list, counts: list, order: list, chunks: int,
                 manager=None) -> torch.Tensor:
    """Forward/backward microbatches in ``order`` (from :func:`one_f_one_b`) as a pipeline
    with ``chunks`` virtual stages; gradients accumulate into the parameters.

    ``inputs[m]``: the microbatch's ``[budget, hidden]`` input; ``counts[m][l]``: layer
    ``l``'s count. Returns the sum of the microbatch losses (detached).
    """
    L = model.num_layers
    per = -(-L // chunks)
    spans = [range(c * per, min(L, (c + 1) * per)) for c in range(chunks)]
    acts, grads, total = {}, {}, None
    for kind, m, c in order:
        if kind == "F":
            src = inputs[m] if c == 0 else acts[(m, c - 1)][1].detach().requires_grad_(True)
            out = model(src, counts[m], spans[c], manager)
            if c == chunks - 1:
                out = out.float().square().mean()
                total = out.detach() if total is None else total + out.detach()
            acts[(m, c)] = (src, out)
        else:
            src, out = acts.pop((m, c))
            if c == chunks - 1:
                out.backward()
            else:
                out.backward(grads.pop((m, c)))
            if c > 0:
                grads[(m, c - 1)] = src.grad
    return total
