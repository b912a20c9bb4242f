"""Static-budget MoE token dispatch/combine (one GPU or expert-parallel), the expert MLP, and
the MoE layer that holds them together (:func:`moe_layer`).

The reference MoE model built from these pieces is :class:`graphstash.models.MoEModel`.

Nothing here touches the GPU at import time.
"""
from ..reference.activation import ExpertActivation
from ._dispatch import (DispatchHandle, NcclChunks, OneDevice, RowExchange, budget_rows,
                        check_routing, combine, default_status, dispatch,
                        register_transport_adapter)
from .budgets import DispatchBudgets, LayerBudget
from .experts import GroupedMMSupport, grouped_mm, prepare_experts
from .layer import moe_layer
from .mlp import expert_mlp

__all__ = ["DispatchBudgets", "DispatchHandle", "ExpertActivation", "GroupedMMSupport", "NcclChunks", "OneDevice",
           "RowExchange", "budget_rows", "check_routing", "combine", "default_status", "dispatch",
           "expert_mlp", "grouped_mm", "LayerBudget", "moe_layer", "prepare_experts",
           "register_transport_adapter"]
