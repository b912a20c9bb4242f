"""The rows of ``graphstash bench moe --ep N``: one expert-parallel training step each, built
the same way on every rank, from the same initialisation and batches.

NOTE [expert-parallel bench rows]: every row is a full training step (forward, backward,
AdamW) of :class:`graphstash.models.MoEModel` with the loss of
:mod:`graphstash.tools.training` (NOTE [training loss]); only the way tokens reach the experts'
ranks, and the buffers they land in, change:

- ``eager peer``: the plain-PyTorch dropless MoE (``mode="plain"``): ``all_to_all_single``
  with split sizes read back to the host every layer, eager (it cannot be captured); it needs a
  process group that can run it (NCCL ranks);
- ``nccl chunks``: graphstash's static-budget dispatch over NCCL's fixed, budget-sized chunks
  (``exchange=None``, NOTE [send layout]), under ``graph_step``;
- ``worst-case buffers``: the live-row exchange with receive room for every row any rank could
  send (``capacity_rows = W x T x K``) and a static budget of that size (capacity factor
  ``W``): torchtitan's graphable design, built from graphstash's own kernels, under
  ``graph_step``;
- ``live rows``: the live-row exchange sized by ``--capacity-factor``, under ``graph_step``;
- ``live rows + stash``: the same with ``graph_step(stash=...)``;
- ``live rows + resend``: the live rows pushed again in backward instead of kept
  (``MoEConfig(resend_rows=True)``, NOTE [resent rows] in
  ``graphstash/moe/exchange/live.py``);
- ``gathered tokens``: each token sent once to every rank and each token's output summed
  back (``MoEConfig(exchange_kind="gathered tokens")``, NOTE [gathered tokens] in
  ``graphstash/moe/exchange/gathered.py``), NCCL's all-gather and reduce-scatter under
  ``graph_step``; ``gathered tokens + resend``: the same, the tokens gathered again in
  backward instead of their rows kept;
- ``no exchange``: no expert parallelism, the baseline of what the exchange costs (NOTE
  [no-exchange row]).

The budgets of the three ``live rows`` rows adapt to the routing (NOTE [adaptive
budgets] in ``graphstash/moe/budgets.py``). Where the ranks have a process group and the
transport is chosen automatically (torchrun), those rows run the model as README shows it,
``MoEModel(config, group=g)``, with ``exchange_kind="live rows"`` (README's default,
``"auto"``, is the ``gathered tokens`` row where top-K is above the ranks and these rows
otherwise: NOTE [auto exchange] in ``graphstash/moe/exchange/factory.py``); the gathered rows
run it the same way. The live-row exchange is built at the first forward and built again,
larger, when a budget outgrows it; the flags and needs travel through the group. Elsewhere
(ranks sharing one GPU, in-process ranks, a ``--transport`` named) the row is given its
transport, sized by ``--capacity-factor``, whose region bounds how far a budget grows, and
registers it as the step's flag reducer, so the over-budget decision is shared through the exchange itself (no NCCL; the
only way on ranks sharing one GPU). Bytes per step: the transport rows read the device counters
(:meth:`~graphstash.moe.exchange.Transport.counters`); the peers count what their collectives
send from the split sizes (:func:`graphstash.tools.bench.moe.count_exchange`).
"""
from __future__ import annotations

import dataclasses

import torch

from ...graph import graph_step
from ...models import MoEConfig, MoEModel, parse_routing
from ...moe.exchange import receive_rows
from ..training import WARMUP, TrainingRun, eager_step, forward_backward_of, routed_step

ROWS = ("eager peer", "nccl chunks", "worst-case buffers", "live rows", "live rows + stash",
        "live rows + resend", "gathered tokens", "gathered tokens + resend", "no exchange")
GRAPHED = ROWS[1:]
# rows whose tokens travel through torch.distributed collectives
PEER_ROWS = ("eager peer", "nccl chunks", "gathered tokens", "gathered tokens + resend")
# rows whose tokens travel through a live-row transport
TRANSPORT_ROWS = ("worst-case buffers", "live rows", "live rows + stash", "live rows + resend")
LOCAL_ROWS = ("no exchange",)   # rows whose tokens never leave their rank
GATHERED_ROWS = ("gathered tokens", "gathered tokens + resend")   # exchange_kind's
MODEL_MODE = {"eager peer": "plain", "nccl chunks": "budget", "worst-case buffers": "budget",
              "live rows": "budget", "live rows + stash": "stash", "live rows + resend": "budget",
              "gathered tokens": "budget", "gathered tokens + resend": "budget",
              "no exchange": "budget"}
BUILDS_OWN = ("live rows", "live rows + stash", "live rows + resend")   # MoEModel(config, group=g)

# NOTE [no-exchange row]: what does the exchange cost a step? Not the one-GPU step of the
# whole model: it holds every expert, so its optimizer updates W times the expert parameters
# a rank holds (fused AdamW was 24.8 ms, 40 % of the one-GPU step at qwen3-30b-a3b widths,
# docs/moe-performance.md), and a comparison with it hides the exchange behind the optimizer
# it saves. The ``no exchange`` row is one rank doing what a rank of the live rows does, less
# the exchange: each rank's own E / W experts (so its parameters, gradients and AdamW state
# are a rank's), its own T tokens routed top-K among them (the T x K rows a rank receives on
# average), a budget at the same capacity factor, graph + budget. Under balanced routing that
# is a live-row rank's work, so a row's step over this one is what its exchange costs.
# Under any other routing the rows a rank receives depend on every rank's routing (the
# favoured rank gets several times the average), which no rank alone reproduces: there the
# row is not run, and says why.

# How the ranks of a run are laid out (moe_ep's launch), and why a row cannot run there.
LAUNCHES = ("torchrun", "processes", "threads")
_NO_GROUP = {
    "processes": "the ranks share one GPU, where NCCL refuses to run ('Duplicate GPU detected')",
    # (processes on the CPU run their collectives over gloo)
    "threads": "in-process ranks have no process group to run its collectives",
}


def unavailable(row: str, launch: str, transport: str, config: MoEConfig | None = None,
                world_size: int | None = None) -> str | None:
    """Why ``row`` cannot run with ranks laid out as ``launch`` (one of :data:`LAUNCHES`) over
    ``transport`` (``--transport``), or None if it can; with ``config`` and ``world_size``,
    also why the ``no exchange`` row cannot stand for that configuration (NOTE [no-exchange
    row])."""
    if row not in ROWS:
        raise ValueError(f"row: expected one of {ROWS}, got {row!r}")
    if launch not in LAUNCHES:
        raise ValueError(f"launch: expected one of {LAUNCHES}, got {launch!r}")
    if row in LOCAL_ROWS and config is not None:
        why = _no_exchange_unavailable(config, world_size)
        return None if why is None else f"not available: {why}"
    if row in PEER_ROWS and launch in _NO_GROUP and not (launch == "processes"
                                                         and transport == "gloo"):
        return f"not available: {_NO_GROUP[launch]}"
    if row in TRANSPORT_ROWS and transport == "nccl":
        return "not available: --transport nccl builds no live-row transport"
    return None


def _no_exchange_unavailable(config: MoEConfig, world_size: int | None) -> str | None:
    """Why the ``no exchange`` row cannot stand for ``config`` on ``world_size`` ranks, or
    None (NOTE [no-exchange row])."""
    if world_size is None or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1 with config, got {world_size!r}")
    routing = parse_routing(config.routing)
    if routing.kind != "balanced":
        return (f"under routing {routing} the rows a rank receives depend on every rank's "
                "routing (NOTE [no-exchange row]); balanced routing only")
    local = config.num_experts // world_size
    if config.topk > local:
        return (f"top-{config.topk} of a rank's {local} experts ({config.num_experts} over "
                f"{world_size} ranks)")
    return None


def no_exchange_config(config: MoEConfig, world_size: int) -> MoEConfig:
    """``config`` for the ``no exchange`` row: one rank's ``num_experts / world_size`` experts
    on one device (NOTE [no-exchange row])."""
    if config.num_experts % world_size:
        raise ValueError(f"world_size: {config.num_experts} experts do not divide over "
                         f"{world_size} ranks")
    why = _no_exchange_unavailable(config, world_size)
    if why is not None:
        raise ValueError(f"config: {why}")
    return dataclasses.replace(config, num_experts=config.num_experts // world_size)


def worst_case_config(config: MoEConfig, world_size: int) -> MoEConfig:
    """``config`` with a static budget that holds every row any rank could send: capacity
    factor ``world_size``, so :func:`~graphstash.moe.budget_rows` gives ``W x T x K`` rows
    (plus padding room) and no routing is ever over it."""
    return dataclasses.replace(config, capacity_factor=float(world_size))


def row_config(row: str, config: MoEConfig, world_size: int) -> MoEConfig:
    """The model configuration ``row`` runs: the worst-case budget for ``worst-case buffers``,
    NCCL chunks of the capacity factor for ``nccl chunks``, one rank's experts for ``no
    exchange``, the live rows' ``exchange_kind`` for theirs (resent for ``live rows +
    resend``), the gathered tokens' for theirs, else ``config``."""
    if row in GATHERED_ROWS:
        return dataclasses.replace(config, exchange_kind="gathered tokens",
                                   resend_rows=row == "gathered tokens + resend")
    if row in BUILDS_OWN:              # the live rows, whatever NOTE [auto exchange] picks
        return dataclasses.replace(config, exchange_kind="live rows",
                                   resend_rows=row == "live rows + resend")
    if row == "worst-case buffers":
        return worst_case_config(config, world_size)
    if row == "no exchange":
        return no_exchange_config(config, world_size)
    if row == "nccl chunks" and config.chunk_factor is None:
        return dataclasses.replace(config, chunk_factor=config.capacity_factor)
    return config


def transport_sizes(row: str, config: MoEConfig, world_size: int, dtype: torch.dtype) -> dict:
    """The keyword sizes of the transport a transport row is given (``capacity_rows``,
    ``row_bytes``, ``max_experts``): room for the row's budget and for each rank's
    ``tokens x topk`` pairs (the combine sends every pair back), rows of ``dtype``. A budget
    that adapts (NOTE [adaptive budgets]) grows no further than this region."""
    if row not in TRANSPORT_ROWS:
        raise ValueError(f"row: expected one of {TRANSPORT_ROWS}, got {row!r}")
    c = row_config(row, config, world_size)
    element = torch.empty((), dtype=dtype).element_size()
    rows = receive_rows(c.num_tokens, c.topk, c.num_experts, world_size=world_size,
                        capacity_factor=c.capacity_factor, pad_multiple=c.pad_multiple)
    return {"capacity_rows": rows,
            "row_bytes": c.hidden * element, "max_experts": c.num_experts}


def build_row(row: str, config: MoEConfig, device: torch.device, dtype: torch.dtype, *,
              world_size: int, group=None, transport=None, stash=None, seed: int = 0,
              lr: float = 1e-4, warmup: int = WARMUP,
              release_warmup_cache: bool = True) -> TrainingRun:
    """This rank's model, AdamW and step of ``row`` (NOTE [expert-parallel bench rows]).

    Args:
        row: one of :data:`ROWS`.
        config: the sizes, with the capacity factor of the live rows (``num_tokens`` per rank).
        device: this rank's device (CUDA; the CPU runs every step eagerly with the reference
            backend and the gloo transport).
        dtype: parameter dtype (bf16 is what the bench measures).
        world_size: ranks of the expert-parallel group.
        group: the ``torch.distributed`` group the peers' collectives run over (peer rows;
            the ``no exchange`` row takes none).
        transport: this rank's :class:`~graphstash.moe.exchange.Transport` (transport rows),
            sized by :func:`transport_sizes`.
        stash: ``graph_step``'s ``stash=`` for ``live rows + stash``.
        seed, lr: initialisation seed (the same on every rank and row) and AdamW's rate.
        warmup: ``graph_step``'s eager calls before the capture.
        release_warmup_cache: ``graph_step``'s option of that name (False for ranks that are
            threads of one process: NOTE [in-process bench ranks] in ``ep_ranks.py``).

    ``run.step(x, y)`` takes a batch of :func:`graphstash.tools.training.batches`. Example::

        t = build_transport(group, **transport_sizes("live rows", config, 2, torch.bfloat16))
        run = build_row("live rows", config, device, torch.bfloat16, world_size=2, transport=t)
    """
    if row not in ROWS:
        raise ValueError(f"row: expected one of {ROWS}, got {row!r}")
    built_here = row in TRANSPORT_ROWS and transport is None and group is not None
    if row in TRANSPORT_ROWS and not built_here:
        if transport is None:
            raise ValueError(f"transport: the {row!r} row exchanges live rows through a "
                             "transport or builds one over group; got neither")
        if transport.world_size != world_size:
            raise ValueError(f"transport: built for {transport.world_size} ranks, the row runs "
                             f"{world_size}")
    elif group is None and row not in LOCAL_ROWS:
        raise ValueError(f"group: the {row!r} row sends its rows with torch.distributed "
                         "collectives and needs their process group; got None")
    on_gpu = device.type == "cuda"
    graphed = row in GRAPHED
    if built_here or row in GATHERED_ROWS:   # README's path: the exchange made by the model
        exchange = "auto"
    else:
        exchange = transport if row in TRANSPORT_ROWS else None
    model = MoEModel(row_config(row, config, world_size), mode=MODEL_MODE[row],
                     group=group if row in PEER_ROWS or built_here else None,
                     exchange=exchange, seed=seed, device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=on_gpu or None,
                            capturable=on_gpu and graphed)

    forward_backward = forward_backward_of(model)
    if not graphed:
        return TrainingRun(model, opt, routed_step(model, eager_step(forward_backward, opt)),
                           None)
    # a rank of the no-exchange row talks to no other: its flags stay its own (NOTE
    # [no-exchange row]); a collective over the world would be gloo's where ranks share a GPU,
    # and a capture cannot hold one
    train_step = graph_step(forward_backward, optimizer=opt, warmup=warmup, device=device,
                            stash=stash if row == "live rows + stash" else None,
                            release_warmup_cache=release_warmup_cache,
                            distributed="auto" if row not in LOCAL_ROWS else False)
    if transport is not None:
        train_step.step_status.register_reducer(transport)
    return TrainingRun(model, opt, routed_step(model, train_step), train_step)


def transport_bytes(before: dict, after: dict, steps: int) -> dict:
    """Bytes one step moved through a transport, from two of its
    :meth:`~graphstash.moe.exchange.Transport.counters` readings ``steps`` steps apart:
    ``sent`` (rows and router weights written into other ranks' regions), ``local`` (into its
    own), ``meta`` (counts, flags and signals), and ``rows`` (rows pushed), per step."""
    if steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps}")

    def per_step(key):
        return (after[key] - before[key]) / steps

    return {"sent": per_step("row_bytes_remote"), "local": per_step("row_bytes_local"),
            "meta": per_step("meta_bytes"), "rows": per_step("rows_sent")}
