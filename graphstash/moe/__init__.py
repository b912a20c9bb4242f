"""Static-budget MoE token dispatch/combine (one GPU or expert-parallel) and the reference
MoE model that ``graphstash demo`` and ``graphstash bench moe`` run.

Nothing here touches the GPU at import time.
"""
from .dispatch import (DispatchHandle, budget_rows, check_routing, combine, default_status,
                       dispatch)
from .experts import grouped_mm
from .mlp import expert_mlp
from .model import MoEConfig, MoEModel

__all__ = ["DispatchHandle", "MoEConfig", "MoEModel", "budget_rows", "check_routing", "combine",
           "default_status", "dispatch", "expert_mlp", "grouped_mm"]
