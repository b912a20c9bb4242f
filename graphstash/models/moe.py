"""The reference MoE model: what ``graphstash demo`` and ``graphstash bench moe`` run.

``L`` blocks of (optional attention,) RMSNorm, a top-k softmax router, experts run as grouped
GEMMs over the dispatched buffer (SwiGLU with HuggingFace's weight layout when
``MoEConfig.gated``, else SiLU), and a residual. Three modes:

- ``"dropless"``: eager, every dispatch sized from the real counts (host reads);
- ``"budget"``: static-budget dispatch, nothing read back: capturable in a CUDA graph;
- ``"stash"``: ``"budget"`` plus ``stash_activations`` around the experts, so the
  budget-sized activations autograd keeps are paged out down to their live rows;
- ``"plain"``: the peer, a dropless MoE in plain PyTorch (:func:`graphstash.models.plain.plain_moe`:
  sort, histc, ``torch._grouped_mm`` over exactly ``T * K`` rows, ``index_add_``); capturable on
  one GPU, eager only under expert parallelism.

Expert parallel: pass ``group``; each rank holds ``num_experts / W`` experts (a slice of the
same full initialisation on every rank), the rest of the model is replicated.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import normalize_device
from ..moe import DispatchBudgets, moe_layer
from ..moe.exchange import Transport, make_exchange
from .plain import plain_moe
from .routing import parse_routing, routing_bias

MODES = ("dropless", "budget", "stash", "plain")
EXCHANGE_KINDS = ("auto", "live rows", "gathered tokens")      # MoEConfig.exchange_kind


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of :class:`MoEModel`; ``num_tokens`` is the tokens of one step on one rank.

    Frozen: a model holds its config, so a field cannot change under it; derive another with
    ``dataclasses.replace(config, heads=8)`` (validated again) or :func:`preset`."""
    hidden: int = 256
    ffn: int = 512
    num_experts: int = 8
    topk: int = 2
    layers: int = 4
    num_tokens: int = 1024
    capacity_factor: float = 1.25
    pad_multiple: int | None = None
    attention: bool = False
    heads: int = 4
    seq_len: int = 128            # attention only: tokens are [num_tokens / seq_len, seq_len]
    chunk_factor: float | None = None   # expert parallel: chunk = factor x average per rank
    gated: bool = False           # SwiGLU experts: w1 is [E, 2 * ffn, hidden] (gate rows, then up)
    routing: str = "balanced"     # router logit bias: NOTE [training-like routing] in routing.py
    # expert parallel, live rows: push the rows again in backward instead of keeping what
    # arrived (NOTE [resent rows] in graphstash/moe/exchange/live.py)
    resend_rows: bool = False
    # expert parallel, live rows: multiprocessors a backward push takes beside the expert
    # GEMMs; None: the exchange's default, 0: none (NOTE [exchange beside the experts] in
    # graphstash/moe/exchange/overlap.py)
    overlap_sms: int | None = None
    # expert parallel under a group (exchange="auto"): "live rows" (each of a token's rows
    # pushed to its expert's rank), "gathered tokens" (each token once to every rank, NOTE
    # [gathered tokens] in graphstash/moe/exchange/gathered.py) or "auto": the gathered tokens
    # where topk is above the ranks and NCCL (gloo on the CPU) runs them, else the live rows
    # (NOTE [auto exchange] in graphstash/moe/exchange/factory.py)
    exchange_kind: str = "auto"

    def __post_init__(self):
        for name in ("hidden", "ffn", "num_experts", "topk", "layers", "num_tokens", "heads",
                     "seq_len"):
            _require_int(name, getattr(self, name), minimum=1)
        if self.topk > self.num_experts:
            raise ValueError(f"topk: expected at most num_experts={self.num_experts} experts "
                             f"per token, got {self.topk}")
        _require_float("capacity_factor", self.capacity_factor)
        if self.chunk_factor is not None:
            _require_float("chunk_factor", self.chunk_factor)
        if self.pad_multiple is not None:
            _require_int("pad_multiple", self.pad_multiple, minimum=1)
        if self.overlap_sms is not None:
            _require_int("overlap_sms", self.overlap_sms, minimum=0)
        for name in ("attention", "gated", "resend_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        parse_routing(self.routing)
        if self.exchange_kind not in EXCHANGE_KINDS:
            raise ValueError(f"exchange_kind: expected one of {EXCHANGE_KINDS}, got "
                             f"{self.exchange_kind!r}")
        if self.attention and self.hidden % self.heads:
            raise ValueError(f"heads: expected a divisor of hidden={self.hidden}, got "
                             f"{self.heads}")


def _require_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")


def _require_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite float > 0, got {value}")


# Layer widths of real models (one MoE layer each; attention left out: the experts are what
# graphstash changes). 8192 tokens per rank; on one GPU capacity_factor=1.0 is the dropless
# budget (T x K rows, see budget_rows); expert-parallel runs pass their own factor.
PRESETS = {
    "qwen3-30b-a3b": MoEConfig(hidden=2048, ffn=768, num_experts=128, topk=8, layers=48,
                               num_tokens=8192, capacity_factor=1.0, gated=True),
    "mixtral-8x7b": MoEConfig(hidden=4096, ffn=14336, num_experts=8, topk=2, layers=32,
                              num_tokens=8192, capacity_factor=1.0, gated=True),
}


def preset(name: str, **overrides) -> MoEConfig:
    """The :data:`PRESETS` entry ``name`` with ``overrides`` applied (any MoEConfig field).

    Example: ``preset("qwen3-30b-a3b", layers=4, num_tokens=4096)``."""
    if name not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)}, got {name!r}")
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"overrides: unknown MoEConfig field(s) {unknown}")
    return dataclasses.replace(PRESETS[name], **overrides)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        T, H = x.shape
        q, k, v = self.qkv(self.norm(x)).view(T // seq_len, seq_len, 3, self.heads,
                                              H // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(T, H))


class MoEBlock(nn.Module):
    """One block: ``x + combine(experts(dispatch(norm(x))))`` (after optional attention)."""

    def __init__(self, config: MoEConfig, local_experts: int, first_expert: int,
                 generator: torch.Generator, dtype: torch.dtype | None = None):
        super().__init__()
        c = config
        self.config = c
        device = generator.device
        self.attn = _Attention(c.hidden, c.heads) if c.attention else None
        self.norm = nn.RMSNorm(c.hidden, device=device)
        self.router = nn.Linear(c.hidden, c.num_experts, bias=False, device=device)
        # NOTE [training-like routing] in routing.py: written in place between steps
        bias = None if parse_routing(c.routing).kind == "balanced" else \
            torch.zeros(c.num_experts, device=device)
        self.register_buffer("routing_bias", bias, persistent=False)
        # Full expert weights drawn from one generator on every rank; this rank keeps a slice.
        rows_in = 2 * c.ffn if c.gated else c.ffn
        sl = slice(first_expert, first_expert + local_experts)

        def draw(*shape):
            full = torch.randn(*shape, generator=generator, device=device) / math.sqrt(shape[-1])
            return nn.Parameter(full[sl].to(dtype).clone() if dtype else full[sl].clone())

        self.w1 = draw(c.num_experts, rows_in, c.hidden)
        self.w2 = draw(c.num_experts, c.hidden, c.ffn)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(c.num_experts, c.hidden, generator=generator,
                                                 device=device) / math.sqrt(c.hidden))
        if dtype is not None:
            self.to(dtype)

    def route(self, x: torch.Tensor):
        """Top-k softmax router: int64 ``[T, K]`` experts and ``[T, K]`` weights (x's dtype)."""
        logits = self.router(x).float()
        if self.routing_bias is not None:
            logits = logits + self.routing_bias.float()
        probs = torch.softmax(logits, dim=-1)
        weight, idx = torch.topk(probs, self.config.topk, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        return idx, weight.to(x.dtype)

    def forward(self, x: torch.Tensor, *, mode: str, group=None, stash_manager=None,
                status=None, exchange=None, budget=None) -> torch.Tensor:
        c = self.config
        if self.attn is not None:
            x = self.attn(x, c.seq_len)
        h = self.norm(x)
        idx, weight = self.route(h)
        if mode == "plain":
            return x + plain_moe(h, idx, weight, self.w1, self.w2, c.num_experts,
                                 gated=c.gated, group=group)
        stash = False
        if mode == "stash":
            stash = stash_manager if stash_manager is not None else True
        # NOTE [moe layer] in graphstash/moe/layer.py: the budget, dispatch, stash group,
        # expert MLP and unweighted combine, paired as they must be
        # the budget: the block's adaptive one (NOTE [adaptive budgets]), else the config's
        budgets = dict(budget=budget) if budget is not None else \
            dict(capacity_factor=None if mode == "dropless" else c.capacity_factor)
        return x + moe_layer(h, idx, weight, self.w1, self.w2, c.num_experts, gated=c.gated,
                             pad_multiple=c.pad_multiple, exchange=exchange, stash=stash,
                             name="moe.experts", status=status, **budgets)


class MoEModel(nn.Module):
    """``layers`` MoE blocks over ``[num_tokens, hidden]`` tokens.

    Args:
        config: sizes (:class:`MoEConfig`).
        mode: ``"dropless"``, ``"budget"``, ``"stash"`` or ``"plain"`` (see the module
            docstring).
        group: ``torch.distributed`` group for expert parallelism (``None``: one device).
        exchange: how tokens travel under ``group``: ``"auto"`` (default) runs the exchange
            ``config.exchange_kind`` names; with its default, also ``"auto"``, that is the
            gathered tokens where ``topk`` is above the group's ranks and NCCL (gloo on the
            CPU) runs the tokens' collectives, else the live rows (NOTE [auto exchange] in
            ``graphstash/moe/exchange/factory.py``). The live-row exchange's transport is built
            at the first forward, on the device and dtype the model then has, and again after
            a move (:class:`graphstash.moe.exchange.GroupExchange`: symmetric memory, CUDA IPC
            on one GPU, gloo on the CPU; a collective every rank meets at that forward), and
            NCCL's fixed chunks are kept where none can be built; a
            :class:`~graphstash.moe.exchange.Transport` to use that one (its ranks are the
            model's; ``group`` may then be None, as for in-process ranks); None for the
            chunks. :attr:`exchange_kind` says which runs. With ``config.resend_rows`` the
            live rows are pushed again in backward instead of kept (NOTE [resent rows] in
            ``graphstash/moe/exchange/live.py``; refused with the chunks or the plain peer;
            on one device the experts gather their rows again anyway).
        stash_manager: ``graphstash.stash.StashManager`` for ``mode="stash"`` (default: the
            current one, ``graph_step(stash=...)``'s or an enclosing ``with manager:``; with
            none current the experts run unstashed).
        status: int32 ``[8]`` status for every dispatch (default: the running step's or
            manager's, NOTE [current step] in ``graphstash/status.py``; nothing needs to set
            it).
        seed: initialisation seed; equal seeds and devices give equal models (and equal expert
            slices under expert parallelism).
        device: where the parameters are drawn and live (default: the CPU; drawing a large
            model on its GPU is much faster than moving it there).
        dtype: parameter dtype, a ``torch.dtype`` (default: float32).

    ``budgets`` (modes ``"budget"`` and ``"stash"``) is the blocks' adaptive dispatch budgets
    (:class:`graphstash.moe.DispatchBudgets`, one layer ``"blocks.<i>"`` per block, starting at
    ``config.capacity_factor``): under ``graph_step`` a block whose routing needed more rows
    than its budget grows it after the rerun, with no user code (NOTE [adaptive budgets]);
    ``model.budgets.table()`` prints them, ``state_dict()`` / ``load_state_dict()`` keep them
    with a checkpoint.

    ``forward(x)`` takes ``[num_tokens, hidden]`` tokens on the model's device and dtype and
    returns the same shape. Train it in bf16 on a GPU (``.to(device, torch.bfloat16)``): that
    is what the benchmark and the demo measure, and the dtype whose grouped GEMM
    (``torch._grouped_mm``) CUTLASS runs inside a CUDA graph; float16 and float32 capture a
    Triton grouped GEMM instead, or without Triton a masked dense product (NOTE [grouped_mm
    under capture] in ``graphstash/moe/experts.py``). Example::

        model = MoEModel(MoEConfig(hidden=64, ffn=128), mode="budget").to(device, torch.bfloat16)
        loss = model(x).float().pow(2).mean()     # x: [num_tokens, 64] bf16 on device
    """

    def __init__(self, config: MoEConfig, *, mode: str = "budget", group=None,
                 stash_manager=None, status=None, seed: int = 0, device=None,
                 dtype: torch.dtype | None = None, exchange="auto"):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a graphstash.models.MoEConfig, got "
                            f"{type(config).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype (e.g. torch.bfloat16) or None, got "
                            f"{type(dtype).__name__} {dtype!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype}")
        config.__post_init__()        # validated again (a config is frozen, not unbreakable)
        world, rank = 1, 0
        if exchange not in (None, "auto"):              # a transport: its ranks (in-process too)
            if not isinstance(exchange, Transport):
                raise TypeError(f"exchange: expected 'auto', None or a graphstash.moe.exchange."
                                f"Transport, got {type(exchange).__name__}")
            world, rank = exchange.world_size, exchange.rank
        elif group is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(group), dist.get_rank(group)
        if config.num_experts % world:
            raise ValueError(f"config.num_experts: expected a multiple of the group size "
                             f"{world}, got {config.num_experts}")
        self.config = config
        self.mode = mode
        self.group = group
        self._world = world
        self.stash_manager = stash_manager
        self.status = status
        local = config.num_experts // world
        device = normalize_device(device if device is not None else "cpu")
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.random.fork_rng(devices=[]):      # attention's default init, seeded too
            torch.manual_seed(seed)
            self.blocks = nn.ModuleList(MoEBlock(config, local, rank * local, gen, dtype)
                                        for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.hidden, device=device, dtype=dtype)
        self.to(device=device, dtype=dtype)          # attention's modules, made on the CPU
        # NOTE [adaptive budgets] in graphstash/moe/budgets.py: one budget per block
        self.budgets = DispatchBudgets(config.capacity_factor) if mode in ("budget", "stash") \
            else None
        # made here, not in the forward torch.compile traces (NOTE [budgets under torch.compile])
        self._layer_budgets = [None] * config.layers if self.budgets is None else \
            [self.budgets.layer(f"blocks.{i}") for i in range(config.layers)]
        self._exchange = None             # LiveRows, or a GroupExchange (NOTE [row exchange])
        if config.resend_rows and world > 1 and (exchange is None or mode == "plain"):
            raise ValueError("config.resend_rows: only the live-row exchange pushes rows again "
                             "(NOTE [resent rows]); NCCL's chunks and the plain peer keep what "
                             "arrived: pass exchange='auto' or a Transport with a mode other "
                             "than 'plain', or resend_rows=False")
        if config.exchange_kind == "gathered tokens" and world > 1 and exchange != "auto":
            raise ValueError(f"config.exchange_kind: {config.exchange_kind!r} runs over the "
                             f"group with exchange='auto'; got exchange={exchange!r}")
        if exchange not in (None, "auto"):
            if mode == "plain":
                raise ValueError("exchange: the plain peer sends its rows with all_to_all; "
                                 "pass exchange=None (or 'auto') with mode='plain'")
            self._exchange = make_exchange(transport=exchange, resend=config.resend_rows,
                                           overlap_sms=config.overlap_sms)
        elif group is not None and mode != "plain" and exchange == "auto":
            self._exchange = make_exchange(
                group, kind=config.exchange_kind, topk=config.topk, num_experts=config.num_experts,
                capacity_factor=config.capacity_factor, pad_multiple=config.pad_multiple,
                num_tokens=config.num_tokens, owner="MoEModel", budgets=self.budgets,
                resend=config.resend_rows, overlap_sms=config.overlap_sms)
        self._warned_unstashed = False
        self.set_routing_step(0)

    def set_routing_step(self, step: int) -> None:
        """Write every block's router bias for training step ``step`` under
        ``config.routing`` (NOTE [training-like routing] in ``routing.py``; only ``drift``
        changes with the step). In place, between steps: a captured graph reads the new bias."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        bias = routing_bias(self.config.routing, self.config.num_experts, self._world, step)
        with torch.no_grad():
            for block in self.blocks:
                if block.routing_bias is not None:
                    block.routing_bias.copy_(bias)

    def expert_parameters(self):
        """This rank's expert weights (``w1`` and ``w2`` of every block): under expert
        parallelism each rank holds its own slice, and the exchange brings it the gradients of
        every rank's tokens."""
        for block in self.blocks:
            yield block.w1
            yield block.w2

    def replicated_parameters(self):
        """Every parameter but the experts' (routers, norms, attention): the same on every
        rank of ``group``, so a training step sums their gradients over the ranks
        (``dist.all_reduce(p.grad)``), as data parallelism does."""
        experts = {id(p) for p in self.expert_parameters()}
        for p in self.parameters():
            if id(p) not in experts:
                yield p

    @property
    def exchange(self):
        """The :class:`~graphstash.moe.exchange.Transport` the experts' rows travel through
        (None: one device, NCCL's chunks, or not built before the first forward)."""
        return None if self._exchange is None else self._exchange.transport

    @property
    def exchange_kind(self) -> str:
        """Which expert-parallel exchange runs: ``"one device"``, ``"nccl chunks"``, or the
        live-row exchange's transport (``"live rows over ipc"``, ``"... symmetric"``, ...)."""
        if self._exchange is not None:
            return self._exchange.kind
        if self.group is None:
            return "one device"
        return "nccl chunks" if self.mode != "plain" else "all_to_all (plain peer)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block over ``x`` (``[num_tokens, hidden]``, the model's device and dtype); same shape out."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a [num_tokens, {self.config.hidden}] tensor, got "
                            f"{type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.config.hidden:
            raise ValueError(f"x: expected [num_tokens, {self.config.hidden}] tokens, got "
                             f"shape {tuple(x.shape)}")
        dtype = self.norm.weight.dtype
        if x.dtype != dtype:
            raise TypeError(f"x: expected the model's dtype {dtype}, got {x.dtype} (convert "
                            f"the input with x.to({dtype}) or the model with .to(dtype))")
        if x.device != self.norm.weight.device:
            raise ValueError(f"x: expected a tensor on the model's device "
                             f"{self.norm.weight.device}, got {x.device}")
        if self.config.attention and x.shape[0] % self.config.seq_len:
            raise ValueError(f"x: with attention, num_tokens must be a multiple of "
                             f"seq_len={self.config.seq_len}, got {x.shape[0]}")
        exchange = self._row_exchange(x)
        if self.mode == "stash" and self.stash_manager is None:
            self._warn_unstashed()
        for block, budget in zip(self.blocks, self._layer_budgets):
            x = block(x, mode=self.mode, group=self.group, stash_manager=self.stash_manager,
                      status=self.status, exchange=exchange, budget=budget)
        return self.norm(x)

    def _row_exchange(self, x: torch.Tensor):
        """The exchange the experts' rows take for tokens ``x`` (NOTE [row exchange] in
        ``graphstash/moe/_dispatch.py``): the one made at construction, else NCCL's chunks of
        ``chunk_factor`` x the average rows per rank under a group (their size follows the
        tokens), else None (one device)."""
        if self._exchange is not None or self.group is None or self.mode == "plain":
            return self._exchange
        c = self.config
        chunk = None
        if c.chunk_factor is not None and self.mode != "dropless":
            chunk = max(1, math.ceil(c.chunk_factor * x.shape[0] * c.topk / self._world))
        return make_exchange(self.group, kind="nccl chunks", chunk_rows=chunk)

    def _warn_unstashed(self) -> None:
        """Say once that ``mode="stash"`` runs unstashed when no StashManager is current."""
        if self._warned_unstashed or not torch.is_grad_enabled() or \
                torch.compiler.is_compiling():
            return
        from ..stash import current_manager

        if current_manager() is None:
            import warnings

            self._warned_unstashed = True
            warnings.warn("MoEModel(mode='stash'): no StashManager is current (no graph_step("
                          "stash=...) running, no `with manager:`, no stash_manager=), so the "
                          "experts' activations are kept whole, as in mode='budget'; run the "
                          "step under graph_step(stash=graphstash.StashConfig()) or pass "
                          "stash_manager=", RuntimeWarning, stacklevel=3)
