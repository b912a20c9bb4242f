"""The live-row exchange: a :class:`graphstash.moe.RowExchange` over a :class:`Transport`.

Dispatch plans through the transport (:func:`~graphstash.moe.exchange.plan_exchange`: the
counts of every rank, every row's place in its receiver's buffer) and pushes only the live
rows straight into the experts' ranks; combine sends the results back (NOTE [live-row
exchange layout] in ``plan.py``, NOTE [receive buffer lifetime] in ``autograd.py``). The
transport stays a transport (regions, the peer table, barriers); this is what dispatch and
combine drive through it (NOTE [row exchange] in ``graphstash/moe/_dispatch.py``).

NOTE [resent rows]: the first expert GEMM's weight gradient needs the rows a rank received,
so autograd keeps them from the forward to the layer's backward: one ``[budget, hidden]``
tensor per layer (on four H100s at qwen3-30b-a3b widths, 2439 of the 2474 MiB a live-row rank
held beyond the no-exchange step: docs/exchange.md, "Resent rows"), where one device keeps
only the tokens and gathers them again (NOTE [regathered input] in ``graphstash/moe/mlp.py``). With
``resend=True`` an exchange does the same across ranks: ``expert_mlp`` keeps each rank's
``[tokens, hidden]`` tokens (the router keeps them anyway), and in backward every rank pushes
them again along the same plan (:func:`~graphstash.moe.exchange.exchange_resend`), so the
experts get the very rows they computed with. The price is a fifth push per layer, beside
the rows and the outputs in forward and their gradients in backward, with its two barriers
and its copy-out. It is a
collective inside ``expert_mlp``'s backward: every rank reaches it in the same order, as it
does the other pushes of backward. The checks that make a one-device regather safe (the
permuted rows are the dispatch's own output, untouched, and the tokens unchanged) hold here
too: a resend of changed tokens would give other rows than the experts computed with.
"""
from __future__ import annotations

import torch

from ..._checks import describe, require_positive_int
from .autograd import exchange_combine, exchange_dispatch, exchange_resend, exchange_send_home
from .overlap import DEFAULT_OVERLAP_SMS, Beside, side_stream
from .plan import plan_exchange
from .transport import Transport

__all__ = ["LiveRows"]


class LiveRows:
    """Expert parallel through ``transport``: only the live rows move. Its ranks are the
    exchange's ranks (``world_size``, ``rank``), rows must fit its region (refused naming the
    argument otherwise). ``resend=True``: the experts' backward pushes the rows again instead
    of keeping them (NOTE [resent rows]). ``overlap_sms``: the multiprocessors the experts'
    backward gives a push it runs beside their weight gradients (NOTE [exchange beside the
    experts] in ``overlap.py``); 0 runs every push after the GEMMs, on the whole device;
    None: :data:`~graphstash.moe.exchange.overlap.DEFAULT_OVERLAP_SMS` for a transport on a
    GPU, 0 on the CPU (there the same pushes run in the same order, on one stream). Example::

        exchange = LiveRows(build_transport(group, capacity_rows=rows, row_bytes=2 * H,
                                            max_experts=E))
        permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, exchange=exchange)
    """

    keeps_rows = True           # its plans can leave rows of the budget out (ExchangePlan.keep_rows)

    def __init__(self, transport: Transport, *, resend: bool = False,
                 overlap_sms: int | None = None):
        if not isinstance(transport, Transport):
            raise TypeError(f"transport: expected a graphstash.moe.exchange.Transport, got "
                            f"{type(transport).__name__}")
        if not isinstance(resend, bool):
            raise TypeError(f"resend: expected a bool, got {type(resend).__name__}")
        self.transport = transport
        self.resend = resend
        self.overlap_sms = resolve_overlap_sms(overlap_sms, transport.device)
        if self.overlap_sms and transport.device.type == "cuda":
            side_stream(transport.device)           # here, not first inside a capture

    def __repr__(self) -> str:
        return (f"LiveRows({self.transport!r}{', resend=True' if self.resend else ''}, "
                f"overlap_sms={self.overlap_sms})")

    @property
    def kind(self) -> str:
        return f"live rows over {self.transport.kind}" + (", resent" if self.resend else "")

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def capacity_rows(self) -> int:
        """The most rows a rank receives: the transport's region (a budget past it is refused;
        an adaptive budget stops growing there, NOTE [adaptive budgets])."""
        return self.transport.capacity_rows

    def for_tokens(self, x: torch.Tensor) -> "LiveRows":
        """Itself, after a ValueError naming ``exchange`` or ``x`` if ``x`` cannot travel
        through it."""
        if self.transport.closed:
            raise ValueError("exchange: the transport was closed")
        if x.device != self.transport.device:
            raise ValueError(f"x: expected a tensor on {self.transport.device} (the exchange's "
                             f"device), got {describe(x)}")
        return self

    def plan_dispatch(self, topk_idx, num_experts, budget, pad_multiple, *, row_bytes, status,
                      kernels):
        """:func:`~graphstash.moe.exchange.plan_exchange` over the transport (a collective);
        a dropless plan (``budget=None``) raises no flags."""
        return plan_exchange(topk_idx, num_experts, budget, pad_multiple, self.transport,
                             row_bytes=row_bytes, status=None if budget is None else status,
                             moe_ops=kernels)

    def dispatch_rows(self, x, topk_weight, plan, kernels):
        """``(permuted, row weights)``: :func:`~graphstash.moe.exchange.exchange_dispatch`."""
        return exchange_dispatch(x, topk_weight, plan, kernels)

    def combine_rows(self, y, topk_weight, plan, kernels):
        """``[T, hidden]`` per token: :func:`~graphstash.moe.exchange.exchange_combine`."""
        return exchange_combine(y, topk_weight, plan, kernels)

    def resend_rows(self, x, plan, kernels, out=None):
        """``[R, hidden]``: :func:`~graphstash.moe.exchange.exchange_resend` (NOTE [resent
        rows]), into ``out`` when given."""
        return exchange_resend(x, plan, kernels, out)

    def beside(self) -> Beside | None:
        """What runs this exchange's backward pushes beside the experts' GEMMs (NOTE
        [exchange beside the experts]), or None with ``overlap_sms=0``."""
        if not self.overlap_sms:
            return None
        return Beside(self.transport.device, self.overlap_sms, self.transport)

    def send_home(self, grad_rows, plan) -> None:
        """Push the permuted rows' input gradients (``[R, hidden]``) home ahead of the
        dispatch's backward: :func:`~graphstash.moe.exchange.autograd.exchange_send_home`."""
        exchange_send_home(grad_rows, plan)


def resolve_overlap_sms(overlap_sms, device: torch.device) -> int:
    """``overlap_sms`` checked (TypeError/ValueError naming it): an int of 0 or more, or None
    for the default on ``device`` (NOTE [exchange beside the experts] in ``overlap.py``)."""
    if overlap_sms is None:
        return DEFAULT_OVERLAP_SMS if device.type == "cuda" else 0
    require_positive_int("overlap_sms", overlap_sms, allow_zero=True)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if overlap_sms >= sms:
            raise ValueError(f"overlap_sms: expected fewer than the {sms} multiprocessors of "
                             f"{device} (the GEMMs keep the rest), got {overlap_sms}")
    return overlap_sms
