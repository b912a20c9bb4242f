"""Autograd helpers shared by the offload and swap tests."""
from __future__ import annotations

import torch


class Marker(torch.autograd.Function):
    """Identity that appends ``("bwd", label)`` to ``log`` when its backward runs."""

    @staticmethod
    def forward(ctx, x, log, label):
        ctx.log, ctx.label = log, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("bwd", ctx.label))
        return grad, None, None
