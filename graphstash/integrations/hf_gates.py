"""What a transformers experts module computes, read off the module: its activation or gate
(kind and constants, :class:`~graphstash.moe.ExpertActivation`) and its weight layout.

NOTE [reading the gate]: transformers' experts apply ``act_fn`` (plain experts) or the class's
``_apply_gate(gate_up)`` (gated: by default ``act_fn(gate) * up`` over the concatenated halves;
a model may override it: GPT-OSS's clamped GLU over interleaved halves, clamped or softcapped
SwiGLUs, SwiGLU in float32). No list of model names says which; the module itself is asked.
The candidates are every activation of NOTE [expert activations]
(``graphstash/reference/activation.py``) over both gate/up layouts, with the constants taken
from the module (every float attribute of the experts module and of its ``act_fn`` modules:
``limit``, ``alpha``, ``swiglu_limit``, a softcap's ``softcap``; and quick_gelu's 1.702), and
each is run by the reference kernel on random float64 rows wide enough to cross any limit,
next to the module's own function on the same rows: the first candidate that agrees within
1e-5 of the values' scale (a gate computed in float32 agrees to 1e-7) is the activation, so
what runs is exactly what was checked. A gate no candidate reproduces is refused, naming the
function. The answer depends on the class, the activation object and the float constants,
and is kept per (class, activation type, constants).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
from torch import nn

from ..reference.activation import ExpertActivation
from ..reference.experts import act_forward

__all__ = ["ExpertsLayout", "UnsupportedExperts", "read_layout"]

_PROBE_ROWS = 64
_PROBE_FFN = 8
_PROBE_SCALE = 6.0       # |values| past 7 (GPT-OSS's limit) in a quarter of the probe
_TOLERANCE = 1e-5
_LITERALS = (1.702,)     # quick_gelu's sigmoid scale, a literal of its forward
_cache: dict = {}


class UnsupportedExperts(ValueError):
    """An experts module computes something the graphstash backend cannot run (the message
    says what)."""


class ExpertsLayout(NamedTuple):
    """How an experts module's weights and activation map onto :func:`graphstash.moe.moe_layer`.

    ``activation``: its gate or activation; ``interleaved``: gate and up rows alternate;
    ``transposed``: weights kept ``[E, in, out]``; ``has_bias``: ``*_proj_bias`` parameters;
    ``post_norm``: the module applied to each expert's output, or None.
    """
    activation: ExpertActivation
    interleaved: bool
    transposed: bool
    has_bias: bool
    post_norm: nn.Module | None


def _floats_of(module: nn.Module, act) -> tuple[float, ...]:
    """Positive finite float attributes of ``module`` and of ``act``'s modules, plus literals."""
    found = []
    sources = [module] + (list(act.modules()) if isinstance(act, nn.Module) else [])
    for source in sources:
        for value in vars(source).values():
            if (isinstance(value, float) and math.isfinite(value) and value > 0
                    and value not in found):
                found.append(value)
    return tuple(found) + tuple(v for v in _LITERALS if v not in found)


def _probe(gated: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    width = 2 * _PROBE_FFN if gated else _PROBE_FFN
    return torch.randn(_PROBE_ROWS, width, generator=gen, dtype=torch.float64) * _PROBE_SCALE


def _twin(pre: torch.Tensor, act: ExpertActivation, gated: bool,
          interleaved: bool) -> torch.Tensor:
    out = pre.new_empty(pre.shape[0], _PROBE_FFN)
    live = torch.tensor([pre.shape[0]], dtype=torch.int64)
    act_forward(out, pre, None, live, gated=gated, activation=act.kind,
                constants=act.constants(), interleaved=interleaved)
    return out


def _agrees(got: torch.Tensor, want) -> bool:
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return False
    want = want.detach().to(torch.float64)
    if not torch.isfinite(want).all():
        return False
    scale = float(want.abs().max().clamp(min=1e-30))
    return float((got - want).abs().max()) <= _TOLERANCE * scale


def _kinds(floats: tuple[float, ...]):
    """Activation kinds with their own constant (glu_alpha's alpha, softcap_silu's cap)."""
    yield ExpertActivation("silu")
    for kind in ("gelu", "gelu_tanh", "relu2", "relu"):
        yield ExpertActivation(kind)
    for value in floats:
        yield ExpertActivation("glu_alpha", alpha=value)
    for value in floats:
        yield ExpertActivation("softcap_silu", gate_cap=value)


def _gated_candidates(floats: tuple[float, ...]):
    limits = (math.inf,) + floats
    caps = (0.0,) + floats
    for interleaved, base, gate_limit, up_limit, up_offset, up_cap in itertools.product(
            (False, True), _kinds(floats), limits, limits, (0.0, 1.0), caps):
        yield interleaved, base._replace(gate_limit=gate_limit, up_limit=up_limit,
                                         up_offset=up_offset, up_cap=up_cap)


def _call(fn, x: torch.Tensor):
    try:
        with torch.no_grad():
            return fn(x)
    except Exception:          # noqa: BLE001 - a function that cannot take the probe: no match
        return None


def _read_activation(module: nn.Module) -> tuple[ExpertActivation, bool]:
    """``(activation, interleaved)`` of ``module`` (NOTE [reading the gate]), or
    UnsupportedExperts."""
    act = getattr(module, "act_fn", None)
    gated = bool(module.has_gate)
    gate_fn = type(module).__dict__.get("_apply_gate") or getattr(type(module), "_apply_gate",
                                                                  None)
    floats = _floats_of(module, act)
    key = (type(module), gated, type(act), getattr(act, "approximate", None), floats,
           getattr(gate_fn, "__code__", None))
    if key in _cache:
        return _cache[key]
    # on the CPU even inside a default-device context (from_pretrained builds on "meta")
    with torch.device("cpu"):
        _cache[key] = _identify(module, act, gated, gate_fn, floats)
    return _cache[key]


def _identify(module: nn.Module, act, gated: bool, gate_fn, floats) -> tuple:
    pre = _probe(gated)
    if gated:
        if gate_fn is None:
            raise UnsupportedExperts(f"no gate function (_apply_gate) on {type(module).__name__}")
        want = _call(lambda x: gate_fn(module, x), pre)
        candidates = _gated_candidates(floats)
        what = f"the gate {type(module).__name__}._apply_gate"
    else:
        want = _call(act, pre) if callable(act) else None
        candidates = ((False, a) for a in _kinds(floats))
        what = f"the activation {type(act).__name__}"
    for interleaved, candidate in candidates:
        if _agrees(_twin(pre, candidate, gated, interleaved), want):
            return candidate, interleaved
    raise UnsupportedExperts(
        f"{what}: it matches none of the activations the expert kernels compute (SiLU, GELU, "
        "GELU-tanh, ReLU, ReLU², x·sigmoid(αx), a softcapped SwiGLU gate, with clamps, caps "
        "and an offset on up, over concatenated or interleaved gate/up rows)")


def read_layout(module: nn.Module) -> ExpertsLayout:
    """The :class:`ExpertsLayout` of a transformers experts module (a class decorated with
    ``@use_experts_implementation``), or UnsupportedExperts saying what cannot run."""
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedExperts("transformers' own expert parallelism (pass "
                                 "configure(group=...) instead)")
    activation, interleaved = _read_activation(module)
    post_norm = None
    if getattr(module, "has_post_expert_norm", False):
        post_norm = getattr(module, "post_expert_norm", None)
        if not callable(post_norm):
            raise UnsupportedExperts("has_post_expert_norm=True without a post_expert_norm "
                                     "module")
    transposed = bool(getattr(module, "is_transposed", False))
    has_bias = bool(getattr(module, "has_bias", False))
    return ExpertsLayout(activation, interleaved, transposed, has_bias, post_norm)
