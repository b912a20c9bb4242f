"""An MoE-like stack of expert MLPs on static budget buffers: what ``graphstash bench stash``
runs and the stash tests train (not library core).

Each layer computes on a ``[budget, hidden]`` buffer of which a device count of rows is live,
and adds its output to the live rows only; :func:`graphstash.stash_activations` around each
layer pages its saved activations down to those rows.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..stash import stash_activations

__all__ = ["ExpertStack", "make_inputs"]


class ExpertStack(torch.nn.Module):
    """``layers`` expert MLPs on a static budget buffer: ``x <- x + mask_l * W2 gelu(W1 x + b1)``.

    ``x`` is ``[budget, hidden]`` (or ``[S, cap, hidden]`` with ``segments=S``, one expert per
    segment); ``mask_l`` keeps rows ``[0, n_l)`` (of each segment), ``n_l`` a device count.
    ``zero_tail`` is passed to :func:`graphstash.stash_activations` when a manager stashes
    the layers (False: reloads leave the rows past the count unwritten). The benchmark runs it,
    and so do the stash tests (their pipeline schedules are in ``tests/_schedule.py``).
    Example::

        model = ExpertStack(4, 64, 128, device="cuda", dtype=torch.bfloat16)
        out = model(x, counts, manager=manager)     # x: [budget, 64]; counts[l]: int32 (1,)
    """

    def __init__(self, layers: int, hidden: int, ffn: int, *, segments: int = 1,
                 dtype=torch.float32, device="cpu", generator: torch.Generator | None = None,
                 zero_tail: bool = True):
        super().__init__()
        self.segments = segments
        self.zero_tail = zero_tail
        shape1 = (hidden, ffn) if segments == 1 else (segments, hidden, ffn)
        shape2 = (ffn, hidden) if segments == 1 else (segments, ffn, hidden)
        bias = (ffn,) if segments == 1 else (segments, 1, ffn)
        def param(shape, fan_in):
            t = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
            return torch.nn.Parameter(t.to(dtype=dtype, device=device))
        self.w1 = torch.nn.ParameterList([param(shape1, hidden) for _ in range(layers)])
        self.b1 = torch.nn.ParameterList([param(bias, 4.0) for _ in range(layers)])
        self.w2 = torch.nn.ParameterList([param(shape2, ffn) for _ in range(layers)])
        self.compute_events: list | None = None      # set to [] to time each expert MLP

    @property
    def num_layers(self) -> int:
        return len(self.w1)

    def expert(self, l: int, x: torch.Tensor) -> torch.Tensor:
        if self.segments == 1:
            h = torch.addmm(self.b1[l], x, self.w1[l])
            return F.gelu(h) @ self.w2[l]
        h = torch.baddbmm(self.b1[l], x, self.w1[l])
        return torch.bmm(F.gelu(h), self.w2[l])

    def mask(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        if self.segments == 1:
            rows = torch.arange(x.shape[0], device=x.device)
            return (rows < count).to(x.dtype).unsqueeze(1)
        rows = torch.arange(x.shape[1], device=x.device)
        return (rows.unsqueeze(0) < count.unsqueeze(1)).to(x.dtype).unsqueeze(2)

    def forward(self, x: torch.Tensor, counts: list, layers=None, manager=None) -> torch.Tensor:
        """Run ``layers`` (default: all) on ``x``; ``counts[l]``: int32 ``(1,)`` or ``(S,)``
        device tensor of live rows of layer ``l``; stash through ``manager`` if given."""
        for l in (range(self.num_layers) if layers is None else layers):
            timing = self.compute_events is not None and x.is_cuda
            start = torch.cuda.Event(enable_timing=True) if timing else None
            if manager is not None:
                with stash_activations(counts[l], manager=manager, name=f"layer{l}",
                                       zero_tail=self.zero_tail):
                    if timing:          # after the entry's wait for the previous stash
                        start.record()
                    y = self.expert(l, x)
            else:
                if timing:
                    start.record()
                y = self.expert(l, x)
            if timing:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.compute_events.append((l, start, end))
            x = x + self.mask(x, counts[l]) * y
        return x

    def forward_exact(self, x: torch.Tensor, counts_host: list) -> torch.Tensor:
        """Exact-size eager version: layer ``l`` computes on its ``counts_host[l]`` live rows."""
        for l in range(self.num_layers):
            n = counts_host[l]
            y = self.expert(l, x[:n])
            x = torch.cat([x[:n] + y, x[n:]]) if n < x.shape[0] else x + y
        return x


def make_inputs(microbatches: int, rows: int, hidden: int, *, segments: int = 1,
                dtype=torch.float32, device="cpu", generator=None) -> list:
    """Inputs whose row ``i`` holds values derived from ``i`` (plus fresh noise)."""
    out = []
    for m in range(microbatches):
        shape = (rows, hidden) if segments == 1 else (segments, rows, hidden)
        idx = torch.arange(rows, dtype=torch.float32).view(*([1] * (len(shape) - 2)), rows, 1)
        col = torch.arange(hidden, dtype=torch.float32)
        base = torch.sin(idx * 0.37 + col * 0.11 + m) + 0.25 * torch.randn(shape, generator=generator)
        out.append(base.to(dtype=dtype, device=device))
    return out
