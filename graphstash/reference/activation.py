"""What the experts' activation computes: its kind and constants (:class:`ExpertActivation`).

The expert activation kernels (``raw_kernels/moe_experts.cu``) and their reference
(:mod:`graphstash.reference.experts`) take an activation as its kind, a string, and six float
constants, in :data:`CONSTANTS` order.

NOTE [expert activations]: for a gate value ``g`` and, gated, an up value ``u`` (each in the
accumulator dtype):

    g  <- min(g, gate_limit)                     (no clamp where gate_limit is inf)
    u  <- clamp(u, -up_limit, up_limit)          (no clamp where up_limit is inf)
    u  <- up_cap * tanh(u / up_cap)              (only where up_cap > 0)
    a   = f(g) * (u + up_offset)  (gated)   or   f(g)  (plain)

with ``f`` one of :data:`KINDS`:

    silu          g / (1 + exp(-g))
    glu_alpha     g * sigmoid(alpha * g)                         (GPT-OSS's glu; quick_gelu)
    softcap_silu  gate_cap * tanh(g / gate_cap) * sigmoid(g)     (a softcapped SwiGLU gate)
    gelu          g * 0.5 * (1 + erf(g / sqrt(2)))
    gelu_tanh     0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3)))
    relu          max(g, 0)
    relu2         max(g, 0)^2

The clamps pass their gradient where the value was inside the bounds (``g <= gate_limit``,
``-up_limit <= u <= up_limit``), as ``torch.clamp`` does. These cover every gate and
activation of transformers' MoE experts (the default gate ``act_fn(gate) * up`` with SiLU,
GELU, GELU-tanh or ReLU-squared; GPT-OSS's clamped GLU with its ``+ 1`` on up; clamped and
softcapped SwiGLUs); :mod:`graphstash.integrations.hf_gates` reads them off an experts
module.
"""
from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["CONSTANTS", "KINDS", "SILU", "ExpertActivation"]

KINDS = ("silu", "glu_alpha", "softcap_silu", "gelu", "gelu_tanh", "relu", "relu2")
CONSTANTS = ("alpha", "gate_limit", "up_limit", "up_offset", "gate_cap", "up_cap")


class ExpertActivation(NamedTuple):
    """An expert activation (NOTE [expert activations] in ``graphstash/reference/activation.py``).

    ``kind`` is one of :data:`KINDS`; ``alpha`` is glu_alpha's sigmoid scale; ``gate_limit``
    and ``up_limit`` clamp the gate from above and up on both sides (``math.inf``: no clamp);
    ``up_offset`` is added to up (GPT-OSS: 1); ``gate_cap`` is softcap_silu's cap of the
    gate's linear factor and ``up_cap`` a softcap of up (0: none). Example::

        gpt_oss = ExpertActivation("glu_alpha", alpha=1.702, gate_limit=7.0, up_limit=7.0,
                                   up_offset=1.0)
    """
    kind: str = "silu"
    alpha: float = 1.0
    gate_limit: float = math.inf
    up_limit: float = math.inf
    up_offset: float = 0.0
    gate_cap: float = 0.0
    up_cap: float = 0.0

    def constants(self) -> list[float]:
        """The six constants in :data:`CONSTANTS` order (what the kernels take)."""
        return [float(getattr(self, name)) for name in CONSTANTS]

    def check(self, argument: str = "activation") -> "ExpertActivation":
        """``self`` if valid, else ValueError naming ``argument``."""
        if self.kind not in KINDS:
            raise ValueError(f"{argument}: expected a kind in {KINDS}, got {self.kind!r}")
        values = self.constants()
        if any(math.isnan(v) for v in values):
            raise ValueError(f"{argument}: constants must not be NaN, got {self}")
        if self.gate_limit <= -math.inf or self.up_limit < 0:
            raise ValueError(f"{argument}: expected gate_limit > -inf and up_limit >= 0, got "
                             f"{self}")
        if self.gate_cap < 0 or self.up_cap < 0 or math.isinf(self.gate_cap) or math.isinf(
                self.up_cap):
            raise ValueError(f"{argument}: expected finite caps >= 0, got {self}")
        if self.kind == "softcap_silu" and self.gate_cap == 0:
            raise ValueError(f"{argument}: softcap_silu needs gate_cap > 0, got {self}")
        return self

    @classmethod
    def of(cls, activation, argument: str = "activation") -> "ExpertActivation":
        """``activation`` (a kind name or an ExpertActivation) as a checked ExpertActivation."""
        if isinstance(activation, str):
            return cls(activation).check(argument)
        if isinstance(activation, cls):
            return activation.check(argument)
        raise TypeError(f"{argument}: expected a kind name or a graphstash ExpertActivation, "
                        f"got {type(activation).__name__}")

    @classmethod
    def from_constants(cls, kind: str, constants) -> "ExpertActivation":
        """The activation of a kernel call: ``kind`` and the constants (None: the defaults)."""
        if constants is None:
            return cls(kind)
        if len(constants) != len(CONSTANTS):
            raise ValueError(f"constants: expected {len(CONSTANTS)} floats {CONSTANTS}, got "
                             f"{list(constants)}")
        return cls(kind, *(float(c) for c in constants))


SILU = ExpertActivation()
