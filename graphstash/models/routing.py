"""Routing that looks like training: a bias on the router's logits, per expert.

NOTE [training-like routing]: random routers spread tokens evenly; real ones do not, early in
training above all, and a budget tuned on random routers is not a budget. The reference model
adds a per-expert bias to its router logits (the same for every mode, the plain peer
included), chosen by a spec:

- ``"balanced"``: no bias (the random router as it is);
- ``"skew:X"``: the experts of one rank favoured by ``X`` in the logits: the first
  ``ceil(E / G)`` experts, with ``G`` the expert-parallel ranks (2 on one device);
- ``"zipf:S"``: expert ``e`` favoured by ``-S * log(e + 1)``, popularity by a Zipf law
  (expert 0 the most popular, so rank 0 receives most);
- ``"drift"``, ``"drift:X"`` or ``"drift:X:P"``: ``skew:X`` (default 1.5) whose favoured group
  moves to the next rank's experts every ``P`` steps (default 10): the favoured experts
  wander as a router learns.

The bias lives in a fixed buffer of each block, written in place between steps
(:meth:`graphstash.models.MoEModel.set_routing_step`), so a captured graph reads the new bias.
"""
from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["Routing", "parse_routing", "routing_bias"]

KINDS = ("balanced", "skew", "zipf", "drift")


@dataclasses.dataclass(frozen=True)
class Routing:
    """A parsed routing spec (NOTE [training-like routing])."""
    kind: str = "balanced"
    strength: float = 0.0          # X of skew and drift, S of zipf
    period: int = 10               # drift: steps before the favoured group moves

    def __str__(self) -> str:
        if self.kind == "balanced":
            return "balanced"
        if self.kind == "drift":
            return f"drift:{self.strength:g}:{self.period}"
        return f"{self.kind}:{self.strength:g}"


def parse_routing(spec) -> Routing:
    """The :class:`Routing` of ``spec`` (``"balanced"``, ``"skew:1.5"``, ``"zipf:1.2"``,
    ``"drift"``, ``"drift:1.5:10"``, or a Routing); ValueError naming ``routing`` otherwise."""
    if isinstance(spec, Routing):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"routing: expected a spec string such as 'skew:1.5', got "
                        f"{type(spec).__name__}")
    parts = spec.strip().split(":")
    kind, args = parts[0], parts[1:]
    usage = ("expected 'balanced', 'skew:X', 'zipf:S', 'drift', 'drift:X' or 'drift:X:P' "
             "(X, S finite numbers >= 0, P an int >= 1)")
    if kind not in KINDS or (kind == "balanced" and args) or \
            (kind in ("skew", "zipf") and len(args) != 1) or (kind == "drift" and len(args) > 2):
        raise ValueError(f"routing: {usage}, got {spec!r}")
    if kind == "balanced":
        return Routing()
    try:
        strength = float(args[0]) if args else 1.5
        period = int(args[1]) if len(args) > 1 else 10
    except ValueError:
        raise ValueError(f"routing: {usage}, got {spec!r}") from None
    if not math.isfinite(strength) or strength < 0 or period < 1:
        raise ValueError(f"routing: {usage}, got {spec!r}")
    return Routing(kind, strength, period)


def routing_bias(routing, num_experts: int, world_size: int = 1, step: int = 0) -> torch.Tensor:
    """float32 ``[num_experts]`` on the CPU: the logit bias of each expert at ``step`` under
    ``routing`` (a spec or a :class:`Routing`), with the experts spread over ``world_size``
    ranks (NOTE [training-like routing]).

    Example: ``routing_bias("skew:1.5", 8, world_size=2)`` is 1.5 for experts 0-3, else 0."""
    r = parse_routing(routing)
    bias = torch.zeros(num_experts, dtype=torch.float32)
    if r.kind == "balanced":
        return bias
    if r.kind == "zipf":
        return -r.strength * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64)) \
            .to(torch.float32)
    groups = max(world_size, 2)
    size = -(-num_experts // groups)            # a rank's experts (rounded up on one device)
    group = 0 if r.kind == "skew" else (step // r.period) % groups
    bias[group * size:(group + 1) * size] = r.strength
    return bias
