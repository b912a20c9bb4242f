"""Expert-parallel exchange that moves only the live rows, inside a CUDA graph.

A :class:`Transport` gives each rank a shared region and a device table of every rank's
addresses (NOTE [exchange transport]); the kernels of ``raw_kernels/moe_exchange.cu`` exchange
the per-expert counts, lay out every receiver, and copy each live row straight into the
receiver's region (NOTE [live-row exchange layout]); dispatch and combine are each other's
backward (NOTE [receive buffer lifetime]). Build a transport once, before any capture, and
pass it to :func:`graphstash.moe.dispatch` as ``exchange=``::

    transport = build_transport(group, capacity_rows=receive_rows(tokens, topk, E, world_size=W,
                                capacity_factor=1.25), row_bytes=hidden * x.element_size(),
                                max_experts=E)
    permuted, counts, handle = dispatch(x, idx, w, E, budget=budget, exchange=transport)
    y = expert_mlp(permuted, w1, w2, counts, handle.permuted_weights(), gated=True)
    out = combine(y, handle, weighted=False)

The same transport sums the step's flags across ranks (:meth:`Transport.all_reduce_flags_`).
:func:`make_exchange` ``(group, topk=..., num_experts=...)`` builds one where the model runs,
or moves the gathered tokens instead where ``topk`` is above the ranks (:class:`GatheredTokens`,
NOTE [auto exchange] in ``factory.py``). Nothing here touches the GPU at import time.
"""
from .. import register_transport_adapter
from .autograd import exchange_combine, exchange_dispatch
from .build import build_transport, describe_exchange, transport_kind
from .factory import GroupExchange, collectives_run, make_exchange, receive_rows
from .gathered import GatheredPlan, GatheredTokens
from .gloo import GlooTransport, build_gloo_transport
from .ipc import build_ipc_transport
from .live import LiveRows
from .local import build_local_transports
from .plan import ExchangePlan, plan_exchange
from .symmetric import build_symmetric_transport
from .transport import DEFAULT_TIMEOUT_S, PeerTransport, Transport

# NOTE [row exchange] in graphstash/moe/_dispatch.py: exchange=transport means its live rows
register_transport_adapter(Transport, LiveRows)

__all__ = ["DEFAULT_TIMEOUT_S", "ExchangePlan", "GatheredPlan", "GatheredTokens", "GlooTransport", "GroupExchange", "LiveRows",
           "PeerTransport", "Transport",
           "build_gloo_transport", "build_ipc_transport", "build_local_transports",
           "build_symmetric_transport", "build_transport", "collectives_run", "describe_exchange",
           "exchange_combine",
           "exchange_dispatch", "make_exchange", "plan_exchange", "receive_rows",
           "transport_kind"]
