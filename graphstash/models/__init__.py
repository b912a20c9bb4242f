"""The reference models that ``graphstash demo`` and ``graphstash bench`` run (not library core).

:class:`MoEModel` is a complete MoE stack built from :mod:`graphstash.moe` (dispatch, the
expert MLP, combine) and :mod:`graphstash.stash`; :data:`PRESETS` holds configurations at the
layer widths of real models. Nothing here touches the GPU at import time.
"""
from .expert_stack import ExpertStack, make_inputs
from .moe import EXCHANGE_KINDS, PRESETS, MoEConfig, MoEModel, preset
from .routing import Routing, parse_routing, routing_bias

__all__ = ["EXCHANGE_KINDS", "PRESETS", "ExpertStack", "MoEConfig", "MoEModel", "Routing",
           "make_inputs", "parse_routing", "preset", "routing_bias"]
