"""The one place that sizes an expert-parallel exchange and builds it where it runs.

NOTE [exchange sizing]: a rank's region receives, in dispatch, at most its budget
(:func:`~graphstash.moe.budget_rows` over the tokens of the whole group, padding included)
and, in combine, every row it sent: its own ``tokens x topk`` pairs. So the region holds
``max(budget, tokens x topk)`` rows of the widest row it carries. :func:`receive_rows` is that
formula; the reference model, the transformers backend and the bench all size through it.

NOTE [exchange built where it runs]: PyTorch users build a model, then move it
(``MoEModel(config, group=g).to("cuda", torch.bfloat16)``), so the device and the row width a
transport needs are known only when the first tokens arrive. :class:`GroupExchange` builds the
transport then, on the tokens' device for their dtype, and again whenever a later forward
brings another device or a wider row (a collective, which every rank meets at the same
forward, since every rank moves its model the same way). Building is refused while a CUDA
graph captures: the first forward runs eagerly (graph_step's warmup does). Where no transport
can be built (ranks on several hosts), it warns once and the dispatch sends NCCL's fixed
chunks.

NOTE [auto exchange]: which exchange moves a group's tokens when the user names none
(``kind="auto"``, the default of :func:`make_exchange`, ``MoEConfig.exchange_kind`` and
``configure(exchange_kind=)``). The live rows move each token once per expert it is routed
to, about ``T x K x (W - 1) / W`` rows a rank in each direction; the gathered tokens (NOTE
[gathered tokens] in ``gathered.py``) once per rank, ``T x (W - 1)``. Their ratio is
``K / W``: at top-K above the ranks the gathered tokens move fewer bytes, and measured
they win (docs/exchange.md, "Gathered tokens": qwen3-30b-a3b widths, top-8, on two and four
H200, 1.90x and 1.88x the eager peer balanced against the live rows' 1.74x and 1.76x, and on
four 1.87x to 1.91x under skew, zipf and drift against 1.51x to 1.52x, with less activation);
at top-K at or below the ranks they move as many or more (mixtral-8x7b widths, top-2 over
four ranks: 1.5x the bytes, and the live rows are faster). Nor does a dense gather overflow
under skew: only the experts' own budget can, as on one GPU. So ``"auto"`` is the gathered
tokens where ``topk > world_size`` and NCCL (CUDA tokens) or gloo (CPU tokens) runs the
group's collectives, decided per device at the forward that brings the tokens
(:meth:`GroupExchange.for_tokens`), and the live rows otherwise: ranks sharing one GPU,
whose group is gloo and whose tokens are on the GPU, take the live rows over CUDA IPC; an
``overlap_sms`` names the live rows' pushes, so it keeps them too.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..._checks import forbid_capture, require_positive_int
from .. import NcclChunks, budget_rows
from .build import build_transport
from .gathered import GatheredTokens
from .live import LiveRows
from .transport import DEFAULT_TIMEOUT_S, Transport

__all__ = ["GroupExchange", "KINDS", "collectives_run", "make_exchange", "receive_rows"]


def receive_rows(num_tokens: int, topk: int, num_experts: int, *, world_size: int,
                 capacity_factor: float, pad_multiple: int | None = None) -> int:
    """Rows one rank's region must hold (NOTE [exchange sizing]): the budget of a rank that
    receives ``capacity_factor`` x the average rows, or the ``num_tokens x topk`` rows it
    sends, whichever is more. ``num_tokens`` counts one rank's tokens.

    Example: ``receive_rows(8192, 8, 128, world_size=2, capacity_factor=1.25)`` is 81920.
    """
    require_positive_int("num_tokens", num_tokens)
    budget = budget_rows(num_tokens * world_size, topk, num_experts,
                         capacity_factor=capacity_factor, pad_multiple=pad_multiple,
                         world_size=world_size)
    return max(budget, num_tokens * topk)


KINDS = ("auto", "live rows", "nccl chunks", "gathered tokens")


def collectives_run(group, device: torch.device) -> bool:
    """Whether ``group``'s collectives run on tensors of ``device`` inside a step: NCCL for
    CUDA tensors, gloo for CPU ones (NOTE [auto exchange])."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if device.type == "cuda":
        return "nccl" in backend
    return device.type == "cpu" and "gloo" in backend


def make_exchange(group=None, *, transport=None, kind: str = "auto", topk: int | None = None,
                  num_experts: int | None = None, capacity_factor: float = 1.25,
                  pad_multiple: int | None = None, num_tokens: int | None = None,
                  chunk_rows: int | None = None, owner: str = "make_exchange",
                  timeout_s: float = DEFAULT_TIMEOUT_S, budgets=None, resend: bool = False,
                  overlap_sms: int | None = None):
    """The one factory of row exchanges (NOTE [row exchange] in ``graphstash/moe/_dispatch.py``),
    for ``exchange=`` of :func:`~graphstash.moe.dispatch` and :func:`~graphstash.moe.moe_layer`:

    - nothing: None, every expert on this device;
    - ``transport``: :class:`LiveRows` over it (its ranks are the exchange's);
    - ``group`` and ``kind="nccl chunks"``: :class:`~graphstash.moe.NcclChunks` of
      ``chunk_rows`` rows (None: the budget's);
    - ``group`` and ``kind="gathered tokens"``: :class:`GatheredTokens` (each token moved
      once per rank, NOTE [gathered tokens] in ``gathered.py``);
    - ``group`` and ``kind="auto"`` (the default): a :class:`GroupExchange` that moves the
      gathered tokens where ``topk`` is above the group's ranks and NCCL or gloo runs the
      tokens' collectives, else the live rows (NOTE [auto exchange]);
    - ``group`` and ``kind="live rows"``: a :class:`GroupExchange`, which builds the live-row
      transport at the first forward, sized by :func:`receive_rows` from ``topk``,
      ``num_experts``, ``capacity_factor`` (or the largest factor of ``budgets``, a
      :class:`~graphstash.moe.DispatchBudgets`, once a layer grew past it), ``pad_multiple``
      and ``num_tokens``, and falls back to NCCL's chunks where none can be built;
      ``num_experts`` must be a multiple of the group's ranks (ValueError naming it).

    ``resend=True`` (live rows, gathered tokens): the experts' backward pushes the rows (or
    gathers the tokens) again instead of keeping what arrived, one ``[budget, hidden]`` tensor
    less per layer for one more exchange (NOTE [resent rows] in ``live.py``). ``overlap_sms`` (live rows only): the
    multiprocessors a backward push takes beside the experts' GEMMs (:class:`LiveRows`; NOTE
    [exchange beside the experts] in ``overlap.py``).

    Example: ``exchange = make_exchange(group, topk=8, num_experts=128, capacity_factor=1.25)``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if not isinstance(resend, bool):
        raise TypeError(f"resend: expected a bool, got {type(resend).__name__}")
    if transport is not None:
        if kind not in ("auto", "live rows"):
            raise ValueError(f"kind: a transport carries live rows; got kind={kind!r} with "
                             "transport= (pass kind='live rows', or group= alone)")
        if group is not None and group is not transport.group:
            raise ValueError("group: expected None or the group the transport was built over")
        return LiveRows(transport, resend=resend, overlap_sms=overlap_sms)
    if group is None:
        if chunk_rows is not None:
            raise ValueError("chunk_rows: NCCL's chunks need a group")
        if resend:
            raise ValueError("resend: only an expert-parallel live-row exchange pushes rows "
                             "again; with no group or transport every expert is on this "
                             "device (pass resend=False)")
        if overlap_sms is not None:
            raise ValueError("overlap_sms: only an expert-parallel live-row exchange runs "
                             "pushes beside the experts; with no group or transport every "
                             "expert is on this device (pass overlap_sms=None)")
        return None
    if kind == "nccl chunks":
        if resend:
            raise ValueError("resend: NCCL's chunks keep what arrived; only kind='live rows' "
                             "pushes rows again (pass resend=False)")
        if overlap_sms is not None:
            raise ValueError("overlap_sms: NCCL's chunks run on NCCL's own kernels; only "
                             "kind='live rows' runs pushes beside the experts (pass "
                             "overlap_sms=None)")
        return NcclChunks(group, chunk_rows)
    if kind == "gathered tokens":
        if chunk_rows is not None:
            raise ValueError("chunk_rows: gathered tokens send no chunks; pass "
                             "kind='nccl chunks'")
        if overlap_sms is not None:
            raise ValueError("overlap_sms: gathered tokens run on NCCL's own kernels; only "
                             "kind='live rows' runs pushes beside the experts (pass "
                             "overlap_sms=None)")
        return GatheredTokens(group, resend=resend)
    if chunk_rows is not None:
        raise ValueError("chunk_rows: the live-row exchange sends no chunks; pass "
                         "kind='nccl chunks'")
    if topk is None or num_experts is None:
        raise ValueError("topk: the live-row exchange is sized from topk and num_experts; "
                         "pass both")
    return GroupExchange(group, topk=topk, num_experts=num_experts,
                         capacity_factor=capacity_factor, pad_multiple=pad_multiple,
                         num_tokens=num_tokens, owner=owner, timeout_s=timeout_s,
                         budgets=budgets, resend=resend, overlap_sms=overlap_sms,
                         gather=kind == "auto")


class GroupExchange:
    """The live-row transport of one expert-parallel group, built at the first forward on the
    tokens' device and dtype, rebuilt when they change (NOTE [exchange built where it runs]).

    Args:
        group: the ``torch.distributed`` group of the expert-parallel ranks.
        topk, num_experts: the routing's slots per token and experts over all ranks.
        capacity_factor, pad_multiple: the dispatch budget's (:func:`receive_rows`).
        num_tokens: one rank's tokens per step; None: the most any rank brings to the forward
            that builds the transport.
        owner: who builds it, for warnings (``"MoEModel"``, ``"configure"``).
        timeout_s: the transport's wait for a peer.
        budgets: the :class:`~graphstash.moe.DispatchBudgets` of the layers it serves, or
            None: the region holds the largest of their factors (NOTE [adaptive budgets]),
            and is built again, larger, at the first eager forward after one grew past it.
        resend: the live rows' ``resend`` (NOTE [resent rows] in ``live.py``); NCCL's chunks,
            where no transport can be built, keep what arrived.
        overlap_sms: the live rows' ``overlap_sms`` (NOTE [exchange beside the experts] in
            ``overlap.py``), checked when their transport is built.
        gather: move the gathered tokens instead (:class:`GatheredTokens`, with ``resend``)
            for tokens whose collectives the group runs, where ``topk`` is above its ranks
            and ``overlap_sms`` is None (NOTE [auto exchange]; :func:`make_exchange`'s
            ``kind="auto"``).
    """

    def __init__(self, group, *, topk: int, num_experts: int, capacity_factor: float,
                 pad_multiple: int | None = None, num_tokens: int | None = None,
                 owner: str = "the exchange", timeout_s: float = DEFAULT_TIMEOUT_S,
                 budgets=None, resend: bool = False, overlap_sms: int | None = None,
                 gather: bool = False):
        import torch.distributed as dist

        require_positive_int("topk", topk)
        require_positive_int("num_experts", num_experts)
        if num_tokens is not None:
            require_positive_int("num_tokens", num_tokens)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world_size:       # here, not as a fallback at the first forward
            raise ValueError(f"num_experts: expected a multiple of the group's "
                             f"{self.world_size} ranks (experts are split evenly over the "
                             f"ranks), got {num_experts}")
        self.topk, self.num_experts = topk, num_experts
        self.capacity_factor, self.pad_multiple = capacity_factor, pad_multiple
        self.num_tokens = num_tokens
        self.owner = owner
        self.timeout_s = timeout_s
        self.budgets = budgets
        if not isinstance(resend, bool):
            raise TypeError(f"resend: expected a bool, got {type(resend).__name__}")
        self.resend = resend
        if overlap_sms is not None:
            require_positive_int("overlap_sms", overlap_sms, allow_zero=True)
        self.overlap_sms = overlap_sms
        if not isinstance(gather, bool):
            raise TypeError(f"gather: expected a bool, got {type(gather).__name__}")
        # NOTE [auto exchange]: the gathered tokens where they move fewer bytes
        self._gathered = GatheredTokens(group, resend=resend) if gather and \
            topk > self.world_size and overlap_sms is None else None
        self._last = None                           # the exchange the last tokens took
        self._tokens: int | None = None             # the tokens the transport was sized for
        self.transport: Transport | None = None
        self._live: LiveRows | None = None
        self._chunks: NcclChunks | None = None
        self._unavailable: tuple | None = None      # (device, row_bytes) that found none

    @property
    def kind(self) -> str:
        """``"gathered tokens"`` (``", resent"`` after it with ``resend``) where the last
        tokens took them (NOTE [auto exchange]), ``"live rows over <transport>"`` (the same
        suffix), ``"nccl chunks"`` where no transport could be built, or ``"live rows (built
        at the first forward)"``, or ``"gathered tokens or live rows (chosen at the first
        forward)"`` before any tokens where the gathered tokens may run."""
        if self._last is not None and self._last is self._gathered:
            return "gathered tokens" + (", resent" if self.resend else "")
        if self._last is None and self._gathered is not None:
            return "gathered tokens or live rows (chosen at the first forward)"
        if self.transport is not None:
            return f"live rows over {self.transport.kind}" + (", resent" if self.resend else "")
        if self._unavailable is not None:
            return "nccl chunks"
        return "live rows (built at the first forward)"

    def transport_for(self, x: torch.Tensor) -> Transport | None:
        """The transport for tokens like ``x`` (``[T, hidden]`` on this rank's device), built
        or rebuilt here if it does not fit them (a collective); None: NCCL chunks."""
        row_bytes = x.shape[1] * x.element_size()
        t = self.transport
        if t is not None and not t.closed and t.device == x.device and \
                t.row_bytes >= row_bytes and t.capacity_rows >= self._rows(self._tokens):
            return t
        if self._unavailable == (x.device, row_bytes):
            return None
        forbid_capture(f"{self.owner}: building the live-row exchange for tokens on "
                       f"{x.device} ({x.dtype}) (a collective; the first forward on a device "
                       f"or dtype must run eagerly, as graph_step's warmup does)")
        if t is not None:
            t.close()
            self.transport = None
        # the collectives below run on the tokens' GPU, whatever device is current
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            try:
                self.transport = self._build(x, row_bytes)
            except ValueError as exc:
                self._unavailable = (x.device, row_bytes)
                warnings.warn(f"{self.owner}: no live-row exchange here ({exc}); the dispatch "
                              "sends NCCL's fixed chunks", RuntimeWarning, stacklevel=3)
                return None
        self._unavailable = None
        return self.transport

    def _build(self, x: torch.Tensor, row_bytes: int) -> Transport:
        tokens = self.num_tokens
        if tokens is None:
            import torch.distributed as dist

            seen = [None] * self.world_size
            dist.all_gather_object(seen, int(x.shape[0]), group=self.group)
            tokens = max(max(seen), 1)
        self._tokens = tokens
        rows = self._rows(tokens)
        return build_transport(self.group, capacity_rows=rows, row_bytes=row_bytes,
                               max_experts=self.num_experts, device=x.device,
                               timeout_s=self.timeout_s)

    def _rows(self, tokens: int | None) -> int:
        """The rows a region must hold for ``tokens`` per rank at the largest factor in use
        (0 before the first build)."""
        if tokens is None:
            return 0
        factor = self.capacity_factor
        if self.budgets is not None:
            factor = max(factor, self.budgets.largest_factor())
        return receive_rows(tokens, self.topk, self.num_experts, world_size=self.world_size,
                            capacity_factor=factor, pad_multiple=self.pad_multiple)

    def for_tokens(self, x: torch.Tensor):
        """The exchange that moves tokens like ``x`` (``[T, hidden]``): the
        :class:`~graphstash.moe.exchange.LiveRows` over :meth:`transport_for` ``(x)``, or
        NCCL's budget-sized chunks where no transport can be built (NOTE [row exchange] in
        ``graphstash/moe/_dispatch.py``: this makes a GroupExchange an ``exchange=``); with
        ``gather`` the :class:`GatheredTokens` where NOTE [auto exchange] picks them."""
        self._last = self._exchange_for(x)
        return self._last

    def _exchange_for(self, x: torch.Tensor):
        if self._gathered is not None and collectives_run(self.group, x.device):
            return self._gathered
        transport = self.transport_for(x)
        if transport is None:
            if self._chunks is None:
                self._chunks = NcclChunks(self.group)
            return self._chunks
        if self._live is None or self._live.transport is not transport:
            self._live = LiveRows(transport, resend=self.resend, overlap_sms=self.overlap_sms)
        return self._live

    def close(self) -> None:
        """Release the transport (a collective for process-group transports)."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
