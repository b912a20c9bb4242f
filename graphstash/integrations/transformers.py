"""graphstash as an experts backend of HuggingFace transformers (``ExpertsInterface``).

transformers (5.17 and later) runs the experts of its MoE models (Qwen3-MoE, Mixtral, OLMoE,
Qwen2-MoE, DeepSeek-V3 and every other model whose experts class is decorated with
``@use_experts_implementation``) through a function chosen by name. This module adds
``"graphstash"``: the tokens go through graphstash's static-budget :func:`~graphstash.moe.dispatch`,
the gated expert MLP (:func:`~graphstash.moe.expert_mlp`, HuggingFace's ``gate_up_proj`` /
``down_proj`` used as they are) and :func:`~graphstash.moe.combine`, so nothing reads a count
back to the host and the whole training step can be captured by :func:`graphstash.graph_step`::

    import graphstash.integrations.transformers as gst

    gst.register()                                   # adds "graphstash" to the ExpertsInterface
    model.set_experts_implementation("graphstash")   # or experts_implementation= at load
    gst.configure(model, capacity_factor=1.25, stash=True, group=None)   # optional; the defaults

Budgets (NOTE [experts budget]): on one GPU the dispatch buffer holds ``T * top_k`` rows, every
row a step can ask for, so it never drops a token (dropless by construction, whatever
``capacity_factor`` above 1 says; a factor below 1 gives a smaller buffer whose over-budget
steps :func:`graphstash.graph_step` reruns dropless). With ``group=`` each rank receives
``capacity_factor * T * top_k`` rows at first; a step that routes more to one rank raises the
over-budget flag and the step reruns dropless, updating once, and under ``graph_step`` the
budgets of the experts modules that overflowed grow to what their routing needed (NOTE
[adaptive budgets]; :func:`dispatch_budgets` gives them).

Inside a :func:`graphstash.graph_step` the flag reaches the step by itself (NOTE [current step]
in ``graphstash/status.py``); outside one (evaluation, ``generate``) a budget that dropped rows
warns at the caller (NOTE [eager over budget] in ``graphstash/moe/_dispatch.py``). With
``stash=True`` the budget-sized activations of every experts call go through the step's stash
manager (``graph_step(..., stash=StashConfig())``); with no stash manager current the experts
run unstashed. The experts run as one :func:`graphstash.moe.moe_layer` (NOTE [moe layer]). The manager decides whether stashing
pays (NOTE [stash plan] in ``graphstash/stash/plan.py``): on one GPU the buffer has no dead
rows, so under ``StashConfig(policy="auto")`` it steps aside; expert-parallel budgets above the
live rows are where it saves memory.

Around the experts (NOTE [capture hazards in HF MoE models]): the router jitter noise
(Mixtral's ``router_jitter_noise``) draws from the default CUDA generator, which
:func:`graphstash.graph_step` registers with the graph, so it captures and its dropless rerun
draws the same noise; padding masks are built without host reads while a stream captures
(transformers checks for capture itself); the router auxiliary loss
(``output_router_logits=True``) is capturable when an ``attention_mask`` is passed, and
without one only on transformers versions that count with ``torch.histc`` (5.17 calls
``torch.bincount``, which syncs; :func:`configure` warns then). Pass ``use_cache=False`` when
training (no key/value cache is filled for nothing).

Every experts layout of transformers runs: expert biases (``has_bias``, GPT-OSS), transposed
weights (``is_transposed``: used as views, never copied), interleaved gate/up rows, a norm after
each expert (``has_post_expert_norm``), and every gate or activation the expert kernels compute
(SiLU, GELU, GELU-tanh, ReLU, ReLU², GPT-OSS's clamped GLU with ``+ 1`` on up, clamped and
softcapped SwiGLUs, SwiGLU in float32), read off the module itself (NOTE [reading the gate] in
``hf_gates.py``). What remains refused (a gate no kernel reproduces, transformers' own expert
parallelism) raises ``ValueError`` naming the module, the reason and the implementation to
keep, when the model is built with ``experts_implementation="graphstash"`` after
:func:`register` (NOTE [refusal at build]), else at :func:`configure` or the first forward.
``docs/hf-compatibility.md`` lists every family and what its experts use.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .._checks import describe, require_positive_int
from ..errors import BackendUnavailableError
from .hf_gates import ExpertsLayout, UnsupportedExperts, read_layout

__all__ = ["IMPLEMENTATION", "ExpertsSettings", "configure", "dispatch_budgets",
           "experts_forward", "experts_modules", "register", "settings_of"]

IMPLEMENTATION = "graphstash"
MIN_VERSION = (5, 17)
_SETTINGS_ATTR = "_graphstash_experts"
_CHECKED_ATTR = "_graphstash_supported"
_INSTALL_HINT = "pip install 'graphstash[hf]' (transformers>=5.17)"


# NOTE [capture hazards in HF MoE models]
# What else in transformers' MoE models could stop a capture (read in the sources of 5.17 and
# 5.23; the GPU tests capture each case):
# - the router auxiliary loss (load_balancing_loss_func, run when output_router_logits is on)
#   counts each expert's tokens. Without an attention_mask, 5.17 uses torch.bincount, whose
#   output size depends on the data (a host read: the capture fails); later versions use
#   torch.histc with fixed bins. With an attention_mask both take scatter_add_, which is fine,
#   so passing attention_mask=torch.ones_like(input_ids) is the workaround on 5.17;
# - masks: transformers skips its host-side "is the mask all ones?" shortcut while a CUDA
#   stream captures (is_tracing() includes stream capture) and builds the mask on the device;
# - router jitter (Mixtral): uniform_ noise from the default CUDA generator, registered with
#   the graph by graph_step; the eager rerun restores the generator's offset first.


# NOTE [experts budget]
# HuggingFace calls the experts with T tokens and K experts per token, so one step asks for
# exactly T * K rows. On one GPU every row lands on this device: a buffer of T * K rows (what
# budget_rows gives at capacity_factor 1) holds any routing, so a larger factor would only waste
# memory and is capped at 1. Under expert parallelism a rank receives T * K rows on average over
# W ranks, anywhere from 0 to W * T * K; capacity_factor sizes its buffer (W fits any routing).
# There each experts module's budget adapts to what its routing needs (NOTE [adaptive budgets]
# in graphstash/moe/budgets.py): configure makes one DispatchBudgets for the model, starting at
# capacity_factor, and graph_step grows a module's budget after a step it overflowed.


@dataclasses.dataclass(frozen=True)
class ExpertsSettings:
    """How the ``"graphstash"`` backend runs one experts module (set by :func:`configure`).

    ``group`` is the expert-parallel process group (None: one device); this rank holds experts
    ``[first_expert, first_expert + num_experts / world_size)``.
    """
    capacity_factor: float = 1.25
    stash: bool = True
    group: object = None
    world_size: int = 1
    first_expert: int = 0
    name: str = "experts"
    exchange: object = None          # NcclChunks, LiveRows or GroupExchange (None: one device)
    budget: object = None            # LayerBudget under expert parallelism (NOTE [adaptive budgets])


_DEFAULTS = ExpertsSettings()


def _transformers_moe():
    """transformers' ``integrations.moe`` module; BackendUnavailableError if it is missing or
    older than 5.17 (no ``ExpertsInterface``)."""
    try:
        import transformers
    except ImportError as exc:
        raise BackendUnavailableError(
            f"graphstash.integrations.transformers needs transformers, which is not installed: "
            f"{_INSTALL_HINT}") from exc
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    try:
        from transformers.integrations import moe
        moe.ExpertsInterface, moe.use_experts_implementation     # noqa: B018 - presence check
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"graphstash.integrations.transformers needs transformers' ExpertsInterface "
            f"(transformers>=5.17), got transformers {transformers.__version__}: "
            f"{_INSTALL_HINT}") from exc
    if version and version < MIN_VERSION:
        raise BackendUnavailableError(
            f"graphstash.integrations.transformers needs transformers>=5.17, got "
            f"{transformers.__version__}: {_INSTALL_HINT}")
    return moe


def register() -> None:
    """Add ``"graphstash"`` to transformers' ``ExpertsInterface`` (for every model; idempotent).

    Raises :class:`~graphstash.BackendUnavailableError` when transformers (>= 5.17) is missing.
    Example::

        gst.register()
        model = AutoModelForCausalLM.from_config(config, experts_implementation="graphstash")
    """
    _transformers_moe().ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    _install_build_check()          # NOTE [refusal at build]


def dispatch_budgets(model: nn.Module):
    """The :class:`~graphstash.moe.DispatchBudgets` of ``model``'s experts modules under expert
    parallelism (one layer per module, named as :func:`experts_modules` names it; NOTE
    [adaptive budgets]), or None (one device, or not configured). ``.table()`` prints them;
    ``state_dict()`` / ``load_state_dict()`` keep them with a checkpoint."""
    for _, module in experts_modules(model):
        budget = settings_of(module).budget
        if budget is not None:
            return budget.owner
    return None


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of ``model`` that transformers' ExpertsInterface
    drives (a class decorated with ``@use_experts_implementation``), in module order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]


def settings_of(module: nn.Module) -> ExpertsSettings:
    """The :class:`ExpertsSettings` the backend uses for ``module`` (the defaults until
    :func:`configure` runs)."""
    return getattr(module, _SETTINGS_ATTR, _DEFAULTS)


def _unsupported(module: nn.Module) -> str | None:
    """What of ``module`` the backend cannot run (None: everything is supported)."""
    try:
        read_layout(module)
    except UnsupportedExperts as exc:
        return str(exc)
    return None


def _support_key(module: nn.Module) -> tuple:
    """What :func:`read_layout` reads of ``module``, compared by identity (NOTE [support
    check]): the flags, the class (its ``_apply_gate``), the activation object and the float
    constants the gate may use."""
    return (type(module), getattr(module, "has_bias", False),
            getattr(module, "is_transposed", False), getattr(module, "is_concatenated", True),
            getattr(module, "has_post_expert_norm", False),
            getattr(module, "_is_expert_parallel", False), module.has_gate,
            getattr(module, "act_fn", None),
            tuple(v for v in vars(module).values() if isinstance(v, float)))


# NOTE [support check]: the forward checks its module on every call, cheaply: the first call
# reads the module's layout and activation (read_layout, NOTE [reading the gate] in
# hf_gates.py) and keeps it with the key of what it read; later calls compare the key (a tuple
# of flags, object identities and constants) and read again only when it changed. So
# `experts.act_fn = nn.GELU()` after a first forward runs GELU at the next one instead of
# SiLU (which a cache of the verdict alone did: 0.28 off transformers' grouped_mm), and an
# activation nothing reproduces is refused there.
def _check_supported(module: nn.Module, name: str, argument: str) -> ExpertsLayout:
    key = _support_key(module)
    checked = module.__dict__.get(_CHECKED_ATTR)
    if checked is not None and checked[0] == key:
        return checked[1]
    try:
        layout = read_layout(module)
    except UnsupportedExperts as exc:
        module.__dict__.pop(_CHECKED_ATTR, None)
        raise ValueError(_refusal(argument, module, name, str(exc))) from None
    module.__dict__[_CHECKED_ATTR] = (key, layout)
    return layout


def _refusal(argument: str, module: nn.Module, name: str, why: str) -> str:
    return (f"{argument}: the graphstash experts backend does not support {why} of "
            f"{type(module).__name__} at {name!r}; keep experts_implementation='grouped_mm' "
            "for this model")


def _is_experts_module(module) -> bool:
    return (isinstance(module, nn.Module) and hasattr(module, "has_gate")
            and hasattr(module, "down_proj") and hasattr(module, "num_experts"))


# NOTE [refusal at build]: transformers builds every experts module inside the model's
# constructor (from_config, from_pretrained) with the experts implementation already in the
# config. register() installs one torch module-registration hook, which sees each experts
# module as it is attached to its parent, fully constructed: one the backend cannot run under
# "graphstash" raises there, naming the module, so the model is never built, instead of failing
# at configure() or at the first forward. A model switched later with
# set_experts_implementation() is checked by configure() and the forward.
def _on_module_registered(parent: nn.Module, name: str, module):
    if not _is_experts_module(module):
        return None
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != IMPLEMENTATION:
        return None
    _check_supported(module, f"{type(parent).__name__}.{name}", "experts_implementation")
    return None


_hook_handle = None


def _install_build_check() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.nn.modules.module import register_module_module_registration_hook

        _hook_handle = register_module_module_registration_hook(_on_module_registered)


def _first_weight_name(module: nn.Module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _shard(module: nn.Module, name: str, group, world: int, rank: int) -> int:
    """Replace the expert weights of ``module`` by this rank's slice; returns the first expert."""
    E = module.num_experts
    if E % world:
        raise ValueError(f"group: the {E} experts of {name!r} do not split evenly over "
                         f"{world} ranks")
    local = E // world
    previous = settings_of(module)
    for pname in (_first_weight_name(module), "down_proj"):
        p = getattr(module, pname)
        if previous.world_size > 1:
            if previous.world_size != world or previous.first_expert != rank * local:
                raise ValueError(
                    f"group: {name!r} is already sharded over {previous.world_size} ranks "
                    f"(first expert {previous.first_expert}); build the model again to shard "
                    f"it over {world}")
            continue
        if p.shape[0] != E:
            raise ValueError(f"model: {name}.{pname} has {p.shape[0]} experts, expected "
                             f"num_experts={E}")
        shard = nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone(),
                             requires_grad=p.requires_grad)
        setattr(module, pname, shard)
    return rank * local


def configure(model: nn.Module, capacity_factor: float = 1.25, stash: bool = True,
              group=None, exchange="auto", num_tokens: int | None = None,
              resend_rows: bool = False, overlap_sms: int | None = None,
              exchange_kind: str = "auto") -> list[str]:
    """Set how the ``"graphstash"`` experts backend runs the experts of ``model``.

    Call it after ``model.set_experts_implementation("graphstash")`` (or loading with
    ``experts_implementation="graphstash"``) and, with ``group``, before creating the optimizer.

    Args:
        model: a transformers model whose experts use the ``ExpertsInterface``.
        capacity_factor: expert-parallel budget per rank, in units of the average rows a rank
            receives (NOTE [experts budget]); on one GPU values above 1 change nothing.
        stash: stash the experts' budget-sized activations through the current
            :class:`~graphstash.StashManager` (the one ``graph_step(stash=...)`` provides).
        group: ``torch.distributed`` process group for expert parallelism, or None. Every rank
            must build the same full model (same initialisation or checkpoint); ``configure``
            then keeps this rank's slice of ``gate_up_proj`` / ``down_proj`` (rank ``r`` owns
            experts ``[r * E / W, (r + 1) * E / W)``) as new parameters, so gradients, optimizer
            state and ``state_dict()`` hold the slice. Tokens travel through
            the exchange (``exchange=``); every rank must pass the same number of tokens per step.
            The other parameters stay replicated: all-reduce their gradients as usual (DDP).
        exchange: with ``group``, how tokens travel: ``"auto"`` runs the exchange
            ``exchange_kind`` names, the live-row one built at the first forward, where the
            model then runs, and again after a move
            (:class:`graphstash.moe.exchange.GroupExchange`, a collective every rank meets
            at that forward), or keeps NCCL's fixed chunks where none can be built; a
            :class:`~graphstash.moe.exchange.Transport` to use it; None for chunks.
        num_tokens: tokens per rank per step (``batch x seq``), to size the exchange's
            receive region (:func:`graphstash.moe.exchange.receive_rows`); None: the most
            tokens any rank brings to the first forward.
        resend_rows: with ``group`` and the live-row exchange, each experts module keeps its
            tokens instead of the rows that arrived and pushes them again in backward: a
            ``[budget, hidden]`` tensor less per layer for one more push (NOTE [resent rows]
            in ``graphstash/moe/exchange/live.py``); refused with NCCL's chunks
            (``exchange=None``). Ignored on one device, where the rows are gathered again
            anyway.
        overlap_sms: with ``group`` and the live-row exchange, the multiprocessors a backward
            push takes beside the experts' GEMMs (NOTE [exchange beside the experts] in
            ``graphstash/moe/exchange/overlap.py``); 0: none; None: the exchange's default.
        exchange_kind: with ``group`` and ``exchange="auto"``, ``"live rows"`` (each of a
            token's rows pushed to its expert's rank), ``"gathered tokens"`` (each token
            sent once to every rank, its outputs summed back: NOTE [gathered tokens] in
            ``graphstash/moe/exchange/gathered.py``; ``resend_rows`` then gathers the tokens
            again in backward) or ``"auto"`` (default): the gathered tokens where the model's
            top-k is above the group's ranks and NCCL (gloo on the CPU) runs the tokens'
            collectives, else the live rows (NOTE [auto exchange] in
            ``graphstash/moe/exchange/factory.py``).

    Returns the names of the experts modules configured. Raises ValueError when ``model`` has no
    experts module, uses another experts implementation, or has experts the backend does not
    support (see the module docstring). Example::

        model.set_experts_implementation("graphstash")
        gst.configure(model, capacity_factor=1.25, stash=True)
    """
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"model: no experts module found in {type(model).__name__} (expected "
                         "a transformers MoE model whose experts use the ExpertsInterface, "
                         "e.g. Qwen3-MoE, Mixtral, OLMoE)")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor: expected a float, got {type(capacity_factor).__name__}")
    if not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor: expected a finite float > 0, got {capacity_factor}")
    if not isinstance(stash, bool):
        raise TypeError(f"stash: expected a bool, got {type(stash).__name__}")
    world, rank = 1, 0
    if group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call "
                             "init_process_group() first or pass group=None")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, module in modules:
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if implementation != IMPLEMENTATION:
            raise ValueError(
                f"model: the experts at {name!r} use experts_implementation={implementation!r}; "
                f"call graphstash.integrations.transformers.register() and "
                f"model.set_experts_implementation({IMPLEMENTATION!r}) before configure()")
        _check_supported(module, name, "model")
    _warn_bincount_aux_loss(model)
    if num_tokens is not None:
        require_positive_int("num_tokens", num_tokens)
    if not isinstance(resend_rows, bool):
        raise TypeError(f"resend_rows: expected a bool, got {type(resend_rows).__name__}")
    if overlap_sms is not None:
        require_positive_int("overlap_sms", overlap_sms, allow_zero=True)
    if exchange_kind not in ("auto", "live rows", "gathered tokens"):
        raise ValueError(f"exchange_kind: expected 'auto', 'live rows' or 'gathered tokens', "
                         f"got {exchange_kind!r}")
    if exchange_kind == "gathered tokens" and world > 1 and exchange != "auto":
        raise ValueError(f"exchange_kind: {exchange_kind!r} runs over the group with "
                         f"exchange='auto'; got exchange={exchange!r}")
    if resend_rows and world > 1 and exchange is None:
        raise ValueError("resend_rows: NCCL's chunks (exchange=None) keep what arrived; only the "
                         "live-row exchange pushes rows again (NOTE [resent rows]): pass "
                         "exchange='auto' or a Transport, or resend_rows=False")
    row_exchange = None             # NOTE [row exchange] in graphstash/moe/_dispatch.py
    budgets = None
    if world > 1:
        from ..moe import DispatchBudgets
        from ..moe.exchange import Transport, make_exchange

        budgets = DispatchBudgets(float(capacity_factor))     # NOTE [experts budget]
        if exchange == "auto" and exchange_kind == "gathered tokens":
            row_exchange = make_exchange(group, kind=exchange_kind, resend=resend_rows,
                                         overlap_sms=overlap_sms)
        elif exchange == "auto":
            row_exchange = _group_exchange(model, modules, capacity_factor, group, num_tokens,
                                           budgets, resend_rows, overlap_sms, exchange_kind)
        elif exchange is None:
            row_exchange = make_exchange(group, kind="nccl chunks")
        elif isinstance(exchange, Transport):
            row_exchange = make_exchange(transport=exchange, resend=resend_rows,
                                         overlap_sms=overlap_sms)
        else:
            raise TypeError(f"exchange: expected 'auto', None or a graphstash.moe.exchange."
                            f"Transport, got {type(exchange).__name__}")
    for name, module in modules:
        first = _shard(module, name, group, world, rank) if world > 1 else 0
        if world == 1 and settings_of(module).world_size > 1:
            raise ValueError(f"group: {name!r} is already sharded over "
                             f"{settings_of(module).world_size} ranks; pass that group again")
        setattr(module, _SETTINGS_ATTR, ExpertsSettings(
            capacity_factor=float(capacity_factor), stash=stash, group=group, world_size=world,
            first_expert=first, name=name or "experts", exchange=row_exchange,
            budget=None if budgets is None else budgets.layer(name or "experts")))
    return [name for name, _ in modules]


def _group_exchange(model: nn.Module, modules, capacity_factor: float, group,
                    num_tokens: int | None, budgets, resend_rows: bool,
                    overlap_sms: int | None, kind: str):
    """The exchange every experts module of ``model`` shares (``kind``: ``"live rows"`` or
    ``"auto"``), its live-row transport built at the first forward where the model then runs
    (NOTE [exchange built where it runs] in ``graphstash/moe/exchange/factory.py``)."""
    from ..moe.exchange import make_exchange

    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    if not top_k:
        raise ValueError("model: its config names no num_experts_per_tok; pass exchange=None "
                         "(NCCL chunks) or a Transport built for it")
    E = max(m.num_experts for _, m in modules)
    return make_exchange(group, kind=kind, topk=top_k, num_experts=E,
                         capacity_factor=capacity_factor, num_tokens=num_tokens,
                         owner="configure", budgets=budgets, resend=resend_rows,
                         overlap_sms=overlap_sms)


def _warn_bincount_aux_loss(model: nn.Module) -> None:
    """Warn when ``model`` computes its router auxiliary loss with ``torch.bincount`` (NOTE
    [capture hazards in HF MoE models])."""
    import inspect
    import sys
    import warnings

    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return
    loss_fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    try:
        source = inspect.getsource(loss_fn) if loss_fn is not None else ""
    except (OSError, TypeError):
        return
    if "bincount" in source:
        warnings.warn(
            f"model: {type(model).__name__} has output_router_logits=True and this transformers "
            "counts the router auxiliary loss with torch.bincount, which reads the counts back to "
            "the host and stops a CUDA graph capture unless an attention_mask is passed: call "
            "the model with attention_mask=torch.ones_like(input_ids) inside graph_step",
            RuntimeWarning, stacklevel=3)


def _router_weights(top_k_weights: torch.Tensor, top_k_index: torch.Tensor,
                    num_experts: int) -> torch.Tensor:
    """``[T, K]`` router weights from HuggingFace's ``[T, K]`` or ``[T, num_experts]`` form."""
    if top_k_weights.shape == top_k_index.shape:
        return top_k_weights
    if top_k_weights.dim() == 2 and tuple(top_k_weights.shape) == (top_k_index.shape[0],
                                                                  num_experts):
        return top_k_weights.gather(1, top_k_index.long())
    raise ValueError(f"top_k_weights: expected shape {tuple(top_k_index.shape)} or "
                     f"({top_k_index.shape[0]}, {num_experts}), got {tuple(top_k_weights.shape)}")


def _weights(module: nn.Module, layout: ExpertsLayout):
    """``(w1, w2, bias1, bias2)`` of ``module`` as :func:`~graphstash.moe.moe_layer` takes them:
    ``[E, out, in]``, transposed weights as views (NOTE [transposed expert weights] in
    ``graphstash/moe/experts.py``), biases or None."""
    first = _first_weight_name(module)
    w1, w2 = getattr(module, first), module.down_proj
    if layout.transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    if not layout.has_bias:
        return w1, w2, None, None
    return w1, w2, getattr(module, f"{first}_bias"), module.down_proj_bias


def _check_experts_module(self) -> None:
    if not isinstance(self, nn.Module) or not all(
            hasattr(self, a) for a in ("down_proj", "has_gate", "num_experts")) or not hasattr(
            self, _first_weight_name(self)):
        raise TypeError(f"self: expected a transformers experts module (a class decorated "
                        f"with @use_experts_implementation: gate_up_proj or up_proj, "
                        f"down_proj, num_experts, has_gate), got {type(self).__name__}")


def _check_experts_args(hidden_states, top_k_index, top_k_weights, w1) -> None:
    """The checks of :func:`experts_forward` that name its tensor arguments."""
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states: expected a [T, hidden] tensor, got "
                        f"{type(hidden_states).__name__}")
    hidden = w1.shape[-1]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states: expected [T, {hidden}] tokens (hidden={hidden} of "
                         f"the experts' weights), got {describe(hidden_states)}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states: expected a floating tensor, got "
                        f"{describe(hidden_states)}")
    if not isinstance(top_k_index, torch.Tensor):
        raise TypeError(f"top_k_index: expected an int [T, K] tensor, got "
                        f"{type(top_k_index).__name__}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"top_k_index: expected an int [{hidden_states.shape[0]}, K] tensor "
                         f"(K experts for each of the {hidden_states.shape[0]} tokens), got "
                         f"{describe(top_k_index)}")
    if not isinstance(top_k_weights, torch.Tensor):
        raise TypeError(f"top_k_weights: expected a floating [T, K] tensor, got "
                        f"{type(top_k_weights).__name__}")


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"graphstash"`` experts function: ``out[t] = sum_k w[t, k] * expert_k(x[t])``.

    Args:
        self: the experts module (``gate_up_proj [E, 2 * ffn, hidden]`` or ``up_proj
            [E, ffn, hidden]``, ``down_proj [E, hidden, ffn]``; under expert parallelism this
            rank's slice, see :func:`configure`).
        hidden_states: ``[T, hidden]`` tokens, floating, on the experts' device.
        top_k_index: int ``[T, K]`` expert of each slot, same device.
        top_k_weights: floating ``[T, K]`` (or ``[T, num_experts]``) router weights, same device.
    Returns ``[T, hidden]`` in ``hidden_states``' dtype. Nothing is read back to the host
    unless the step runs dropless (:func:`graphstash.dropless`, the graph manager's rerun).
    Example (what transformers calls after ``set_experts_implementation("graphstash")``)::

        out = experts_forward(experts, x, top_k_index, top_k_weights)
    """
    from ..moe import moe_layer

    _check_experts_module(self)
    settings = settings_of(self)
    layout = _check_supported(self, settings.name, "self")
    w1, w2, bias1, bias2 = _weights(self, layout)
    _check_experts_args(hidden_states, top_k_index, top_k_weights, w1)
    E = self.num_experts
    if w1.shape[0] * settings.world_size != E:
        raise ValueError(
            f"self: {settings.name} holds {w1.shape[0]} experts, expected "
            f"{E // settings.world_size} (num_experts={E} over {settings.world_size} ranks); "
            "configure(model, group=...) shards the full weights once")
    T, K = top_k_index.shape
    if T == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    x = hidden_states.to(w1.dtype)
    weights = _router_weights(top_k_weights, top_k_index, E).to(w1.dtype)
    W = settings.world_size
    # NOTE [experts budget]: on one GPU a factor above 1 would only waste rows; under expert
    # parallelism the module's adaptive budget
    if settings.budget is not None:
        budget = dict(budget=settings.budget)
    else:
        budget = dict(capacity_factor=settings.capacity_factor if W > 1
                      else min(settings.capacity_factor, 1.0))
    # NOTE [moe layer] in graphstash/moe/layer.py: budget, dispatch, stash group (the
    # current manager's, when stash=True and one is current), expert MLP, unweighted combine
    out = moe_layer(x, top_k_index, weights, w1, w2, E, gated=self.has_gate,
                    exchange=settings.exchange, stash=settings.stash, **budget,
                    name=settings.name, activation=layout.activation,
                    interleaved=layout.interleaved, bias1=bias1, bias2=bias2,
                    post_norm=layout.post_norm)
    return out.to(hidden_states.dtype)
