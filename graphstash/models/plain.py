"""The peer: a dropless MoE layer written in plain PyTorch, as users write it.

This is what graphstash's MoE path is measured against (docs/design.md, "Measured against what
users would run instead"): HuggingFace's ``grouped_mm`` experts backend and torchtitan sort the
(token, slot) pairs by expert, count them with ``histc``, run ``torch._grouped_mm`` over exactly
``T * K`` rows with ``cumsum`` offsets, gather the tokens in and ``index_add_`` the weighted
rows out. Under expert parallelism they exchange the rows with ``all_to_all_single`` (the
autograd version) whose split sizes are read back to the host every layer.

On one GPU every shape here is static (``T * K`` rows), so the layer is capturable by a CUDA
graph; under expert parallelism the host reads make it eager only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` (weight ``[E, out, in]``): torch._grouped_mm, or on the
    CPU a loop over experts where this torch has no CPU grouped GEMM (the CPU tests)."""
    if x.device.type == "cuda":
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    try:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    except (AttributeError, NotImplementedError, RuntimeError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        ends = offsets.tolist()
        pieces, start = [], 0
        for e, end in enumerate(ends):
            pieces.append(x[start:end] @ weight[e].t())
            start = end
        pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
        return torch.cat(pieces)


def _experts(rows: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int,
             w1: torch.Tensor, w2: torch.Tensor, gated: bool) -> torch.Tensor:
    """The expert MLP over rows sorted by expert (``expert_of_row`` non-decreasing)."""
    counts = torch.histc(expert_of_row.float() if rows.device.type == "cpu"
                         else expert_of_row.int(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = _grouped(rows, w1, offsets)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
    else:
        a = F.silu(h)
    return _grouped(a, w2, offsets)


def plain_moe(h: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
              w1: torch.Tensor, w2: torch.Tensor, num_experts: int, *, gated: bool,
              group=None) -> torch.Tensor:
    """``out[t] = sum_k topk_weight[t, k] * mlp_{topk_idx[t, k]}(h[t])``, the peer's way.

    Args:
        h: ``[T, hidden]`` tokens, floating, on any device.
        topk_idx: int ``[T, K]`` expert of each slot (in ``[0, num_experts)``), h's device.
        topk_weight: ``[T, K]`` router weights, h's dtype and device.
        w1: ``[E_local, ffn or 2 * ffn, hidden]`` (gated: gate rows, then up rows).
        w2: ``[E_local, hidden, ffn]``.
        num_experts: experts over all ranks of ``group`` (``E_local * world``).
        gated: SwiGLU (``silu(gate) * up``) or SiLU experts.
        group: ``torch.distributed`` group for expert parallelism (rank r owns experts
            ``[r * E_local, (r + 1) * E_local)``), or ``None``.
    Returns ``[T, hidden]``, differentiable in h, topk_weight, w1 and w2.
    """
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    sorted_expert, order = torch.sort(flat, stable=True)
    token = order // K
    rows = h[token]                                            # [T * K, hidden]
    if group is None:
        y = _experts(rows, sorted_expert, num_experts, w1, w2, gated)
    else:
        y = _exchange_and_run(rows, sorted_expert, num_experts, w1, w2, gated, group)
    y = y * topk_weight.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(h).index_add_(0, token, y)


class _AllToAllRows(torch.autograd.Function):
    """``dist.all_to_all_single`` of ``[rows, hidden]`` with host split sizes, differentiable:
    the backward sends the gradients back the reverse way (what
    ``torch.distributed.nn.functional.all_to_all_single`` did before torch deprecated it)."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        import torch.distributed as dist

        out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        ctx.recv_splits, ctx.send_splits, ctx.group = recv_splits, send_splits, group
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        back = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all_single(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                      group) -> torch.Tensor:
    """``rows`` (``[sum(send_splits), hidden]``) exchanged over ``group``: returns
    ``[sum(recv_splits), hidden]``; differentiable in ``rows``."""
    return _AllToAllRows.apply(rows, recv_splits, send_splits, group)


def _exchange_and_run(rows, sorted_expert, num_experts, w1, w2, gated, group):
    """Expert parallel: send each row to its expert's rank with ``all_to_all_single`` (split
    sizes read back to the host), run the local experts, send the results back."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    local = num_experts // world
    per_expert = torch.histc(sorted_expert.float(), bins=num_experts, min=0,
                             max=num_experts - 1).long()
    send_counts = per_expert.view(world, local)                        # [dst, local expert]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)      # [src, local expert]
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = all_to_all_single(rows, recv_splits, send_splits, group)
    # received rows are grouped by source rank, then by local expert: regroup by expert.
    expert_of_received = torch.repeat_interleave(
        torch.arange(local, device=rows.device).repeat(world), recv_counts.reshape(-1))
    regroup = torch.sort(expert_of_received, stable=True)
    out = _experts(received[regroup.indices], regroup.values, local, w1, w2, gated)
    back = out.new_zeros(out.shape).index_copy(0, regroup.indices, out)
    return all_to_all_single(back, send_splits, recv_splits, group)
