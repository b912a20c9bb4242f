"""Static-budget MoE token dispatch/combine (one GPU or expert-parallel) and the expert MLP.

The reference MoE model built from these pieces is :class:`graphstash.models.MoEModel`.

Nothing here touches the GPU at import time.
"""
from ._dispatch import (DispatchHandle, budget_rows, check_routing, combine, default_status,
                       dispatch)
from .experts import grouped_mm
from .mlp import expert_mlp

__all__ = ["DispatchHandle", "budget_rows", "check_routing", "combine",
           "default_status", "dispatch", "expert_mlp", "grouped_mm"]
