"""One MoE layer's experts over routed tokens: budget, dispatch, stash, expert MLP, combine.

NOTE [moe layer]: the pieces of :mod:`graphstash.moe` pair in ways a caller must not have to
know, so :func:`moe_layer` is the one place that pairs them (the reference model, the
transformers backend and the expert-parallel exchange call it):

- the budget is ``capacity_factor`` x the average rows a rank receives (:func:`budget_rows`
  over the tokens of the whole group), or a given number of rows, or a layer's adaptive
  budget (:class:`~graphstash.moe.LayerBudget`: its factor now, and the rows the dispatch
  asked for go back to it, NOTE [adaptive budgets] in ``budgets.py``), or none (dropless:
  eager only); under :func:`graphstash.dropless` dispatch ignores it;
- the router weights scale the activation rows (``handle.permuted_weights()`` into
  :func:`expert_mlp`), so :func:`combine` sums unweighted rows (``weighted=False``); the
  weighted combine with permuted weights would apply them twice;
- ``handle=`` lets the expert MLP gather its input again in backward instead of keeping it
  (NOTE [regathered input] in ``mlp.py``): ``permuted`` goes to it untouched;
- the stash group around the experts counts ``handle.live_rows`` over ``handle.budget_rows``
  and reloads without zeroing the rows past the count (``zero_tail=False``): no grouped GEMM
  lets those rows reach a result (NOTE [rows past the counts] in ``experts.py``);
- with no gradient to compute, or in dropless mode, nothing is stashed.
"""
from __future__ import annotations

import torch

from .._checks import describe
from .._mode import is_dropless
from ._dispatch import as_exchange, budget_rows, combine, dispatch
from .budgets import LayerBudget
from .mlp import expert_mlp

__all__ = ["moe_layer"]


def moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
              w1: torch.Tensor, w2: torch.Tensor, num_experts: int, *, gated: bool = False,
              capacity_factor: float | None = None, budget: "int | LayerBudget | None" = None,
              pad_multiple: int | None = None, exchange=None, stash=False,
              name: str = "moe.experts", status=None, impl: str = "auto",
              activation="silu", interleaved: bool = False, bias1: torch.Tensor | None = None,
              bias2: torch.Tensor | None = None, post_norm=None, group=None,
              chunk_rows: int | None = None) -> torch.Tensor:
    """``out[t] = sum_k topk_weight[t, k] * mlp_{topk_idx[t, k]}(x[t])`` over a static-budget
    dispatch, the count-aware expert MLP and combine (NOTE [moe layer]).

    Args:
        x: ``[T, hidden]`` tokens (bfloat16, float16, float32 or float64), on the GPU or the CPU.
        topk_idx: int32/int64 ``[T, K]`` expert of each slot, x's device.
        topk_weight: ``[T, K]`` router weights, x's dtype and device.
        w1: ``[E_local, ffn, hidden]`` or gated ``[E_local, 2 * ffn, hidden]`` (HuggingFace's
            ``gate_up_proj``: gate rows, then up rows), x's dtype and device.
        w2: ``[E_local, hidden, ffn]`` (``down_proj``), x's dtype and device.
        num_experts: experts over all ranks of the exchange (``E_local * world``).
        gated: SwiGLU (``silu(gate) * up``) or SiLU experts.
        capacity_factor: the budget as this multiple of the average rows a rank receives
            (:func:`budget_rows`); or
        budget: the budget in rows, or a :class:`~graphstash.moe.LayerBudget` (its factor
            now; the rows this dispatch asked for are raised as its need, NOTE [adaptive
            budgets]); neither: dropless (buffers sized from the counts, eager only). Not
            both.
        pad_multiple: round each expert's rows up to this multiple.
        exchange: how rows reach the experts, as for :func:`dispatch` (NOTE [row exchange]):
            None (one device), :class:`~graphstash.moe.NcclChunks`, or
            :class:`graphstash.moe.exchange.LiveRows` (or its Transport).
        stash: ``False`` (default) or None: nothing stashed; ``True``: the current
            :class:`~graphstash.StashManager` (``graph_step(stash=...)``'s or an enclosing
            ``with manager:``), none current: nothing stashed; a StashManager: that one.
        name: the stash group's name (schedules, plans and error messages).
        status: int32 ``[8]`` status for the dispatch's flags (default: the running step's,
            :func:`default_status`).
        impl: the grouped GEMM, as for :func:`grouped_mm`.
        activation, interleaved, bias1, bias2: as for :func:`expert_mlp` (the activation's
            kind and constants, gate and up rows interleaved, per-expert biases).
        post_norm: a module or function applied to each expert's ``[rows, hidden]`` output
            before the router weight (HuggingFace's ``post_expert_norm``), or None. With one,
            the router weights are applied by the combine (``weighted=True``), after it.
        group, chunk_rows: deprecated: ``exchange=NcclChunks(group, chunk_rows)``.
    Returns ``[T, hidden]`` in x's dtype, differentiable in x, topk_weight, w1 and w2.
    Example::

        weight, idx = router(x).float().softmax(-1).topk(2)
        x = x + moe_layer(x, idx, weight.to(x.dtype), gate_up_proj, down_proj, E,
                          gated=True, capacity_factor=1.25, stash=True)
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a [T, hidden] floating tensor, got {type(x).__name__}")
    if isinstance(w1, torch.Tensor) and x.dtype != w1.dtype:
        raise TypeError(f"x: expected the experts' dtype {w1.dtype} (that of w1), got "
                        f"{describe(x)}")
    if capacity_factor is not None and budget is not None:
        raise ValueError(f"budget: give capacity_factor or budget, not both (got "
                         f"capacity_factor={capacity_factor!r}, budget={budget!r})")
    manager = _stash_manager(stash)
    exchange = as_exchange(exchange, group, chunk_rows, caller="moe_layer")
    layer_budget = budget if isinstance(budget, LayerBudget) else None
    if capacity_factor is not None or layer_budget is not None:
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError("topk_idx: expected an int32 or int64 [T, K] tensor, got "
                             + (describe(topk_idx) if isinstance(topk_idx, torch.Tensor)
                                else type(topk_idx).__name__))
        world = exchange.world_size
        # budget_rows takes the tokens of the whole group: x holds this rank's share
        sizing = dict(num_tokens=x.shape[0] * world, topk=topk_idx.shape[1],
                      num_experts=num_experts, pad_multiple=pad_multiple, world_size=world)
        if layer_budget is not None:
            budget = layer_budget.rows(**sizing)
        else:
            budget = budget_rows(capacity_factor=capacity_factor, **sizing)
    stashing = manager is not None and torch.is_grad_enabled() and not is_dropless()
    keep = _rows_kept(manager, exchange, budget, x) if stashing else None
    permuted, counts, handle = dispatch(x, topk_idx, topk_weight, num_experts, budget=budget,
                                        pad_multiple=pad_multiple, exchange=exchange,
                                        status=status, keep_rows=keep)
    if keep is not None:            # NOTE [stash growth ahead] in graphstash/graph/_step.py
        manager.raise_fill(handle.plan.demand_rows, keep)

    def experts() -> torch.Tensor:
        # NOTE [moe layer]: the router weights scale the activation, unless a norm follows
        # the expert (it would undo the scale): then the combine weighs the normed rows
        weights = handle.permuted_weights() if post_norm is None else None
        y = expert_mlp(permuted, w1, w2, counts, weights, gated=gated, impl=impl,
                       handle=handle, activation=activation, interleaved=interleaved,
                       bias1=bias1, bias2=bias2)
        if post_norm is None:
            return combine(y, handle, weighted=False)
        return combine(post_norm(y), handle, weighted=True)

    if not stashing:
        out = experts()
    else:
        from ..stash import stash_activations

        with stash_activations(handle.live_rows, manager=manager, name=name,
                               max_tokens=handle.budget_rows, zero_tail=False):
            out = experts()
    if layer_budget is not None:
        # the rows asked for go back to the layer's budget; a transport given as it is
        # cannot grow, so its region bounds the budget (NOTE [adaptive budgets])
        layer_budget.record(handle.plan.demand_rows, status,
                            max_rows=getattr(exchange, "capacity_rows", None), **sizing)
    return out


def _rows_kept(manager, exchange, budget, x) -> int | None:
    """The rows the stash lets this layer's experts compute on when tokens ``x`` go through a
    live-row exchange (NOTE [rows the stash keeps] in ``graphstash/stash/plan.py``), or None:
    the budget."""
    if budget is None or exchange.world_size < 2 or x.dim() != 2:    # dispatch refuses x
        return None
    if not getattr(exchange.for_tokens(x), "keeps_rows", False):   # the one dispatch takes
        return None
    rows = manager.next_group_rows()
    return rows if rows is not None and rows < budget else None


def _stash_manager(stash):
    """The StashManager ``stash`` names (NOTE [moe layer]), or None."""
    if stash is False or stash is None:
        return None
    from ..stash import StashManager, current_manager

    if stash is True:
        return current_manager()
    if isinstance(stash, StashManager):
        return stash
    raise TypeError(f"stash: expected False, True (the current StashManager) or a "
                    f"graphstash.StashManager, got {type(stash).__name__}")
