"""Exchange pushes beside the expert GEMMs: a side stream for the push, a carveout for the GEMM.

NOTE [exchange beside the experts]: in a layer's backward two pushes wait on nothing the
expert GEMMs' weight gradients compute: the input gradients going home (they need only the
first GEMM's input gradient) and, with the rows resent (NOTE [resent rows] in ``live.py``),
the resend (it needs only the tokens, and only the first GEMM's weight gradient needs what it
brings). So, in ``graphstash/moe/mlp.py`` (``_Overlap``), the second GEMM's backward:

- starts the resend on a side stream, first thing;
- computes its input gradient and the activation's backward, then the first GEMM's input
  gradient (``w1`` is a parameter, so the second GEMM can keep it for free), beside the
  resend;
- pushes that gradient home on the side stream, and computes its weight gradient beside the
  push; the first GEMM's backward then computes its own weight gradient beside the rest of
  the push, and the main stream joins the side stream.

The dispatch's backward then finds its rows already home (``ExchangePlan.sent_home``: the
same tensor, the same version) and pushes only the router weights' gradients, a ``[rows]``
vector; any other gradient is pushed again there, as before. Both ``[rows, hidden]`` tensors
(the rows resent and the input gradient) are alive at once, where the in-line order frees one
before the other (NOTE [expert backward temporaries] in ``mlp.py``): one layer's
``[budget, hidden]`` more at the backward's peak.

Two streams alone do not overlap them: torch's grouped GEMM keeps one block resident on
every multiprocessor, so a copy beside it waits for SMs and the two take turns
(docs/kernel-tuning.md, "Copies beside the expert GEMMs"). While a push is in flight the
GEMMs on the main stream are launched under ``torch._C._set_sm_carveout_experimental(sms)``
(torch's CUTLASS grouped GEMM then sizes its persistent grid to the multiprocessors less
``sms``), and the push runs on at most ``sms`` blocks (``Transport.push_blocks``). On four
H100s a 192 MiB push on 24 blocks beside a grouped GEMM with 24 SMs carved out lost 85 % of
its time (``benchmarks/probes/exchange_bandwidth.py --beside-gemm``); in the whole step 16 SMs
did better than 32 on one machine, and than 24 on another with an earlier cut of this
design (docs/exchange.md, "The exchange beside the expert GEMMs").

Every transport call between the fork and the join runs on the side stream, in the order
every rank issues it; the main stream issues none until it has waited for the side stream,
so the barriers' epochs stay in one order per rank. Tensors the side stream reads or writes
are allocated on the main stream before the fork and stay referenced until the join, so the
caching allocator never hands their memory to the main stream while a push still reads it.
On the CPU (the gloo reference) there is one stream: the same calls run in the same order,
one after the other, so the CPU tests check what the GPU overlaps.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["DEFAULT_OVERLAP_SMS", "Beside", "side_stream"]

# the SMs a push takes beside the GEMMs: NOTE [exchange beside the experts] (docs/exchange.md)
DEFAULT_OVERLAP_SMS = 16

_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    """The side stream of ``device`` (a CUDA device), made at the first call: make it before a
    capture."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class Beside:
    """One overlap of exchange work with GEMMs on ``device`` (NOTE [exchange beside the
    experts]): :meth:`side` runs a block on the side stream after everything the main stream
    issued so far, :meth:`carved` launches GEMMs with ``sms`` multiprocessors left to it,
    :meth:`wait` makes the main stream wait for what the side stream did until a mark, and
    :meth:`join` for all of it. On a CPU device all four run in line."""

    def __init__(self, device: torch.device, sms: int, transport):
        self.device = device
        self.sms = sms
        self.transport = transport
        self.cuda = device.type == "cuda" and not torch.compiler.is_compiling()
        self._stream = side_stream(device) if self.cuda else None
        self._forked = False

    @contextlib.contextmanager
    def side(self):
        """Run the block on the side stream, its pushes on at most ``sms`` blocks."""
        if not self.cuda:
            yield
            return
        # after everything the main stream issued so far, the first time and every time
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._forked = True
        before = self.transport.push_blocks
        self.transport.push_blocks = self.sms
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            self.transport.push_blocks = before

    def mark(self):
        """An event after what the side stream was given so far (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, mark) -> None:
        """The main stream waits for the side stream's work up to ``mark``."""
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    @contextlib.contextmanager
    def carved(self):
        """GEMMs launched in the block leave ``sms`` multiprocessors to the side stream."""
        if not self.cuda or not hasattr(torch._C, "_set_sm_carveout_experimental"):
            yield
            return
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(self.sms)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(before)

    def join(self) -> None:
        """The main stream waits for everything the side stream was given."""
        if self.cuda and self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._forked = False
