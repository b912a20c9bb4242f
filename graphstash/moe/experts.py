"""Expert compute over the permuted buffer: a grouped GEMM with device offsets.

``torch._grouped_mm`` where it works for the device, dtype and layout, otherwise a
per-expert loop (eager only: it reads the counts back) or, while a CUDA graph is being
captured, a Triton grouped GEMM over device offsets (fp16, bf16, fp32) or, without Triton,
a masked dense product over every expert (capturable, ``E`` times the work).
See NOTE [grouped_mm under capture].
"""
from __future__ import annotations

import warnings

from typing import NamedTuple

import torch

from .. import _layout as L
from .._checks import (COUNT_DTYPES, FLOAT_DTYPES, describe, is_capturing, normalize_device,
                       require_float, require_tensor)
from ..status import check_status, raise_flag, resolve
from . import _triton_grouped

__all__ = ["GroupedMMSupport", "TRUSTED", "check_counts", "check_grouped_args", "grouped_mm",
           "grouped_mm_grads", "grouped_mm_resolved", "grouped_product", "is_transposed_weight",
           "prepare_experts", "resolve_impl"]

# NOTE [grouped_mm under capture]
# On CUDA, torch._grouped_mm has a CUTLASS path only for bf16 on sm90/sm100 with 16-byte
# aligned rows; every other dtype, device or layout takes a fallback that copies the offsets
# to the host (``offs.cpu()``) and loops. That fallback is correct eagerly but breaks a CUDA
# graph capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture").
# So two facts are kept per (device, dtype), both established outside any capture, once:
#   - eager: _grouped_mm forward and backward run and agree with a per-expert loop;
#   - capture: the fast-path gate holds (bf16, compute capability 9.x or 10.x) AND the same
#     forward and backward captured into a throwaway CUDA graph (under saved-tensor hooks of
#     our own, so an enclosing stash_activations does not see the probe) replay correctly.
# Inside a capture "auto" uses the native op when the capture fact holds (and the layout
# fits). Otherwise it uses the Triton grouped GEMM (_triton_grouped.py, NOTE [triton grouped
# GEMM]: fp16, bf16 and fp32, device offsets, static grid) when its kernels were compiled
# and loaded before the capture: every eager "auto" call that a capture could not serve
# natively prepares them (graph_step's warmup steps are such calls; the first costs a
# compile). Failing that (no Triton, float64, never ran eagerly) it takes the masked dense
# product (E times the work) and warns once.
# Eagerly "auto" keeps the native op (or the loop) and never picks Triton: whether Triton is
# faster than the eager native fallback at a given shape is measured on a GPU
# (benchmarks/probes/grouped_gemm.py), not assumed. A capture that meets a (device, dtype)
# never probed eagerly cannot probe (a capture inside a capture is not allowed): run one
# eager step first.

# NOTE [expert counts]
# tokens_per_expert says which rows of x each expert reads. A negative count, or counts that
# sum past the rows of x, would make the experts read and write rows that are not there (the
# per-expert loop returned 44 rows for 32; the native grouped GEMM would read past the
# buffer). Counts on the host, and counts an implementation reads back anyway ("loop"), are
# checked there: ValueError naming tokens_per_expert. Counts on the device are not read back
# (a graph could not hold that): a check of two device scalars raises OVERFLOW_COUNT in the
# status's SS_OVERFLOW slot (as a stash of a bad count does, so graph_step skips the update and
# reruns the step), and the offsets the GEMMs use (already a per-call tensor) are zeroed in
# place, so every group is empty and nothing outside x is touched (the Triton GEMM clamps the
# counts itself: NOTE [triton grouped GEMM]); the output is then unspecified. No host read, no
# allocation beyond the scalars. While torch.compile traces, counts are values of the graph
# wherever they live, so host counts take the device path too (:func:`_counts_readable`).
# A dispatch's tokens_per_expert are valid by construction (padded, clamped to the budget):
# expert_mlp given that dispatch's handle passes TRUSTED and runs no check, so a layer's four
# grouped products launch no extra kernels for it; other counts are checked once per
# expert_mlp call and the result reused by all four.

_eager_ok: dict[tuple, bool] = {}
_capture_ok: dict[tuple, bool] = {}
_warned_masked: set = set()


def _grouped_mm_native(x, weight, offsets):
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def _loop(x, weight, counts_list):
    pieces, start = [], 0
    for e, n in enumerate(counts_list):
        if n:
            pieces.append(x[start:start + n] @ weight[e].t())
        start += n
    pieces.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(pieces)


# NOTE [rows past the counts]: the rows of x (and of the output gradient) past the expert
# counts hold whatever the buffer held: a budget's unused rows, rows a stash reload left
# unwritten (zero_tail=False), rows the count-aware activation kernels did not compute. The
# native grouped GEMM, the Triton one and the loop read only the rows inside the offsets.
# The masked dense fallback multiplies every row by every expert, so it selects the rows of
# each expert with torch.where on both operands of every product: a NaN or Inf there
# (NaN * 0 is NaN) never reaches an output or a gradient. So no implementation needs those
# rows zeroed, and the MoE layer stashes with zero_tail=False whatever runs.
def _masked_dense(x, weight, tokens_per_expert, bad=None):
    starts, ends = _group_bounds(tokens_per_expert, bad)
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    for e in range(weight.shape[0]):
        mask = (rows >= starts[e]) & (rows < ends[e])
        out = out + torch.where(mask, x @ weight[e].t(), zero)
    return out


def _layout_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows and weights laid out as the CUTLASS path needs: unit inner stride, 16-byte rows
    and base pointers (checked for every call: a view can break what the probe saw)."""
    return (_strides_ok(x, weight)
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _strides_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The part of :func:`_layout_ok` fixed by shapes and strides (no addresses)."""
    size = x.element_size()
    return (x.stride(1) == 1 and (x.stride(0) * size) % 16 == 0
            and (x.shape[1] * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0
            and (weight.is_contiguous() or is_transposed_weight(weight)))


def is_transposed_weight(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[experts, out, in]`` is the transposed view of a contiguous
    ``[experts, in, out]`` tensor (NOTE [transposed expert weights])."""
    return not weight.is_contiguous() and weight.transpose(-2, -1).is_contiguous()


# NOTE [transposed expert weights]: some checkpoints keep an expert's projection as
# [in, out] (GPT-OSS, Aria: HuggingFace's is_transposed). The experts take the [out, in] view
# (weight.transpose(1, 2)), never a copy: torch._grouped_mm multiplies by the view's transpose,
# which is then the contiguous tensor itself, and the weight gradient is computed as
# x^T @ grad per expert, [experts, in, out], the parameter's own layout, and handed back
# through the view (NOTE [weight gradient layout]). The loop, the masked product and the
# Triton GEMM read the view through its strides.


def _fast_path_device(device: torch.device, dtype: torch.dtype) -> bool:
    """The static half of the capture fact: bf16 on a CUDA device of compute capability 9/10."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major in (9, 10)


def _key(device: torch.device, dtype: torch.dtype) -> tuple:
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (device.type, device.index, dtype)


def _native_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm may run here, now (NOTE [grouped_mm under capture])."""
    if torch.compiler.is_compiling():
        return (hasattr(torch, "_grouped_mm") and _strides_ok(x, weight)
                and _traced_native_ok(x.device.type, x.device.index, str(x.dtype)))
    if not hasattr(torch, "_grouped_mm") or not _layout_ok(x, weight):
        return False
    key = _key(x.device, x.dtype)
    capturing = is_capturing()
    if key not in _eager_ok:
        if capturing:
            return False
        _probe(x.device, x.dtype)
    return _capture_ok[key] if capturing else _eager_ok[key]


def _auto(x: torch.Tensor, weight: torch.Tensor) -> str:
    """What ``impl="auto"`` runs here, now (NOTE [grouped_mm under capture], NOTE
    [grouped_mm under torch.compile])."""
    if torch.compiler.is_compiling():
        return "grouped" if _native_ok(x, weight) else "masked"
    native = _native_ok(x, weight)
    if not is_capturing():
        if x.device.type == "cuda" and not (
                _layout_ok(x, weight) and _capture_ok.get(_key(x.device, x.dtype), False)):
            _triton_grouped.prepare(x, weight)        # for a capture that may follow
        return "grouped" if native else "loop"
    if native:
        return "grouped"
    if _triton_grouped.ready(x, weight):
        return "triton"
    key = _key(x.device, x.dtype)
    if key not in _warned_masked:
        _warned_masked.add(key)
        why = (_triton_grouped.unavailable_reason(x.device, x.dtype)
               or "its kernels were not compiled before the capture")
        warnings.warn(
            f"grouped_mm: inside this CUDA graph capture neither torch._grouped_mm nor the "
            f"Triton grouped GEMM can run for {x.dtype} on {x.device} ({why}); using the "
            "masked dense fallback (num_experts times the work). Run one eager step before "
            "capturing (graph_step's warmup does).", RuntimeWarning, stacklevel=4)
    return "masked"


# NOTE [grouped_mm under torch.compile]
# A traced graph may be replayed inside a CUDA graph capture later (graph_step, or
# torch.compile's own cudagraphs), and tracing cannot run the probes (they need real tensors
# and, for the capture fact, a throwaway capture). So while torch.compile traces, "auto"
# picks the native op only where the *capture* fact holds, and the masked dense product
# elsewhere (never the loop: it reads the counts back, a graph break; the Triton grouped
# GEMM is not offered to the compiler yet). The facts are established by running the probes
# once, eagerly, at trace time (``assume_constant_result`` makes the answer a constant of
# the graph). Addresses are not known while tracing, so only the shape and stride half of
# the layout check applies; the compiler's buffers and parameters are 16-byte aligned.
@torch.compiler.assume_constant_result
def _traced_native_ok(device_type: str, device_index, dtype_name: str) -> bool:
    """The capture fact for (device, dtype) as a trace-time constant (NOTE [grouped_mm under
    torch.compile]); ``dtype_name`` is ``str(dtype)``, e.g. ``"torch.bfloat16"``."""
    dtype = getattr(torch, dtype_name.rpartition(".")[2])
    device = torch.device(device_type, device_index)
    return _probe(device, dtype)[1]


class GroupedMMSupport(NamedTuple):
    """What :func:`prepare_experts` established for a (device, dtype): whether
    ``torch._grouped_mm`` runs eagerly, and whether a CUDA graph may capture it."""
    native_eager: bool
    native_capture: bool


def prepare_experts(device, dtype: torch.dtype) -> GroupedMMSupport:
    """Decide, before any capture, how the expert GEMMs run on ``device`` in ``dtype`` (NOTE
    [grouped_mm under capture]): probe ``torch._grouped_mm`` eagerly and in a throwaway
    capture, once per (device, dtype). ``grouped_mm`` does it on its first eager call; call
    this first when a capture may come before any eager expert call (a tool that captures at
    once, a step whose warmup skips the experts). Not capturable (CaptureError).

    Args:
        device: a ``torch.device`` or string (ValueError naming ``device`` if torch cannot use
            it).
        dtype: the experts' floating dtype (TypeError naming ``dtype`` otherwise).
    Example::

        graphstash.moe.prepare_experts("cuda", torch.bfloat16)
    """
    device = normalize_device(device)
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected a floating torch.dtype (bfloat16, float16, float32 "
                        f"or float64), got {dtype!r}")
    return GroupedMMSupport(*_probe(device, dtype))


def _probe(device, dtype: torch.dtype) -> tuple[bool, bool]:
    """Establish (once) whether torch._grouped_mm works eagerly and under capture.

    Not capturable. Returns ``(eager_ok, capture_ok)`` for ``device`` and ``dtype``; later
    calls return the cached pair (:func:`prepare_experts` is the public entry).
    """
    device = torch.device(device)
    key = _key(device, dtype)
    if key in _eager_ok:
        return _eager_ok[key], _capture_ok[key]
    if is_capturing():
        from ..errors import CaptureError

        raise CaptureError("grouped_mm probe: cannot run while a CUDA graph is being captured")
    eager = capture = False
    if hasattr(torch, "_grouped_mm"):
        with _probe_context(device):
            eager = _probe_eager(device, dtype)
            if eager and _fast_path_device(device, dtype):
                capture = _probe_capture(device, dtype)
    _eager_ok[key], _capture_ok[key] = eager, capture
    return eager, capture


class _probe_context:
    """Grad on, autocast off, and identity saved-tensor hooks shadowing any enclosing ones."""

    def __init__(self, device: torch.device):
        self._stack = [torch.inference_mode(False), torch.enable_grad(),
                       torch.autocast(device.type, enabled=False),
                       torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)]

    def __enter__(self):
        for c in self._stack:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self._stack):
            c.__exit__(*exc)
        return False


_PROBE_COUNTS = [8, 0, 16]     # a group with no rows, and 4 rows past the last group
_PROBE_ROWS = 28


def _probe_inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(_PROBE_ROWS, 16, generator=gen).to(device=device, dtype=dtype)
    ws = torch.randn(3, 32, 16, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(_PROBE_ROWS, 32, generator=gen).to(device=device, dtype=dtype)
    return xs, ws, g


def _probe_reference(xs, ws, g):
    xr = xs.detach().clone().requires_grad_()
    wr = ws.detach().clone().requires_grad_()
    yr = _loop(xr, wr, _PROBE_COUNTS)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), g)
    return yr, gxr, gwr


def _probe_agrees(got, want) -> bool:
    n = sum(_PROBE_COUNTS)       # rows past the groups are unspecified
    tol = dict(rtol=5e-2, atol=5e-2)
    y, gx, gw = got
    yr, gxr, gwr = want
    return (torch.allclose(y[:n].float(), yr[:n].float(), **tol)
            and torch.allclose(gx[:n].float(), gxr[:n].float(), **tol)
            and torch.allclose(gw.float(), gwr.float(), **tol))


def _probe_eager(device, dtype) -> bool:
    xs, ws, g = _probe_inputs(device, dtype)
    offsets = torch.tensor(_PROBE_COUNTS, device=device).cumsum(0).to(torch.int32)
    try:
        x = xs.clone().requires_grad_()
        w = ws.clone().requires_grad_()
        y = _grouped_mm_native(x, w, offsets)
        gx, gw = torch.autograd.grad(y, (x, w), g)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return _probe_agrees((y, gx, gw), _probe_reference(xs, ws, g))


def _probe_capture(device, dtype) -> bool:
    """Capture the probe's forward and backward in a throwaway graph; replay and check it."""
    xs, ws, g = _probe_inputs(device, dtype)
    x = xs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    offsets = torch.tensor(_PROBE_COUNTS, device=device).cumsum(0).to(torch.int32)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    captured = False
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                y = _grouped_mm_native(x, w, offsets)
                gx, gw = torch.autograd.grad(y, (x, w), g)
            finally:
                graph.capture_end()
        captured = True
        graph.replay()
        torch.cuda.synchronize(device)
        ok = _probe_agrees((y, gx, gw), _probe_reference(xs, ws, g))
    except Exception:       # noqa: BLE001 - any failure means "not capturable here"
        ok = False
    finally:
        try:
            torch.cuda.synchronize(device)
        except Exception:   # noqa: BLE001
            pass
        del graph
    return ok and captured


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
               *, impl: str = "auto", status: torch.Tensor | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ weight[e].T`` for consecutive row groups.

    Args:
        x: ``[rows, in]`` permuted tokens (the dispatch output), any float dtype.
        weight: ``[num_local_experts, out, in]`` expert weights, dtype and device of x.
        tokens_per_expert: int32/int64 ``[num_local_experts]`` rows of each expert, on x's
            device; each >= 0, their sum at most ``rows``. Rows past the sum are not computed
            (their values are unspecified). Bad counts raise ValueError where they are on the
            host or read back (``"loop"``); on the device they set the overflow flag of
            ``status`` instead (NOTE [expert counts]).
        impl: ``"auto"``, ``"grouped"`` (torch._grouped_mm), ``"triton"`` (a Triton kernel
            over device offsets: float16, bfloat16, float32; capturable), ``"loop"`` (eager,
            reads the counts back) or ``"masked"`` (capturable dense fallback).
        status: int32 ``[8]`` status tensor on x's device (or its
            :class:`~graphstash.status.StepStatus`) that device-side counts out of range
            flag (default: the running step's, :func:`~graphstash.moe.default_status`).
    Returns ``[rows, out]``; differentiable in x and weight (the weight's gradient in its
    own contiguous layout, NOTE [weight gradient layout]). Example::

        y = grouped_mm(permuted, w1, counts)
    """
    check_grouped_args(x, weight, tokens_per_expert)
    if status is not None:
        check_status("status", status, x.device)
    impl = resolve_impl(x, weight, impl)
    bad = check_counts(tokens_per_expert, x.shape[0], impl, status=status)
    return grouped_mm_resolved(x, weight, tokens_per_expert, impl, bad)


def grouped_mm_resolved(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                        impl: str, bad) -> torch.Tensor:
    """:func:`grouped_mm` after its checks: ``impl`` as :func:`resolve_impl` returned it,
    ``bad`` as :func:`check_counts` did (or :data:`TRUSTED`). Differentiable in x and
    weight; tensors as for :func:`grouped_mm`."""
    return _GroupedMM.apply(x, weight, tokens_per_expert, impl, bad)


# Counts valid by construction (a dispatch's tokens_per_expert: padded, clamped to the budget):
# no check, no flag (NOTE [expert counts]).
TRUSTED = "trusted"


def _resolve_bad(bad, tokens_per_expert: torch.Tensor, rows: int, impl: str):
    """The count check to apply: ``None`` for none (trusted counts, or the loop, which checks
    on the host), else a 0-dim bool on the device (computed when ``bad`` is None)."""
    if bad is TRUSTED or impl == "loop":
        return None
    return _bad_counts(tokens_per_expert, rows) if bad is None else bad


def grouped_product(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                    impl: str, bad=None) -> torch.Tensor:
    """The product of :func:`grouped_mm` by ``impl``, without autograd; ``bad`` as
    :func:`check_counts` returns it, ``TRUSTED``, or ``None`` to check here (NOTE [expert
    counts]). Tensors as for :func:`grouped_mm`."""
    if impl == "loop":
        return _loop(x, weight, _host_counts(tokens_per_expert, x.shape[0]))
    if impl == "triton":        # clamps the counts itself (NOTE [triton grouped GEMM])
        return _triton_grouped.forward(x, weight, tokens_per_expert)
    bad = _resolve_bad(bad, tokens_per_expert, x.shape[0], impl)
    if impl == "grouped":
        return _grouped_mm_native(x, weight, _offsets(tokens_per_expert, bad))
    return _masked_dense(x, weight, tokens_per_expert, bad)      # NOTE [rows past the counts]


def _host_counts(tokens_per_expert: torch.Tensor, rows: int) -> list[int]:
    """The counts as ints, or ValueError if one is negative or they sum past ``rows``."""
    counts = [int(n) for n in tokens_per_expert.tolist()]
    shown = counts if len(counts) <= 16 else counts[:16] + ["..."]
    if any(n < 0 for n in counts):
        raise ValueError(f"tokens_per_expert: expected counts >= 0, got {shown}")
    if sum(counts) > rows:
        raise ValueError(f"tokens_per_expert: expected counts summing to at most the {rows} "
                         f"rows of x, got {sum(counts)} ({shown})")
    return counts


def _counts_readable(tokens_per_expert: torch.Tensor) -> bool:
    """Whether the counts are checked by reading them (host counts, not being traced)."""
    return tokens_per_expert.device.type == "cpu" and not torch.compiler.is_compiling()


def _bad_counts(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor | None:
    """0-dim bool on the device: some count is negative or they sum past ``rows``; None for
    counts on the host (checked eagerly). NOTE [expert counts]"""
    if _counts_readable(tokens_per_expert):
        return None
    return (tokens_per_expert.min() < 0) | (tokens_per_expert.sum() > rows)


def check_counts(tokens_per_expert: torch.Tensor, rows: int, impl: str, *, status=None):
    """The count check of NOTE [expert counts] for a product of ``impl`` over ``rows`` rows:
    None where there is nothing left to check on the device (host counts were checked by
    :func:`check_grouped_args`; ``"loop"`` checks them when it reads them), else the 0-dim
    bool device tensor "some count is out of range", which is also OR-ed into ``status``
    (int32 ``[8]``, or its StepStatus; default: the running step's) as ``OVERFLOW_COUNT``.

    Args:
        tokens_per_expert: int32/int64 ``[experts]`` counts on x's device.
        rows: rows of x.
    """
    if impl == "loop":
        return None
    bad = _bad_counts(tokens_per_expert, rows)
    if bad is not None:
        flag_bad_counts(bad, tokens_per_expert.device, status)
    return bad


def flag_bad_counts(bad: torch.Tensor, device: torch.device, status=None) -> None:
    """OR ``OVERFLOW_COUNT`` into ``status[SS_OVERFLOW]`` where the 0-dim bool ``bad`` holds
    (on the device, no host read); ``status`` as for :func:`check_counts`."""
    tensor, _ = resolve(status, device)
    raise_flag(tensor, L.SS_OVERFLOW, bad.to(torch.int32) * L.OVERFLOW_COUNT)


def _offsets(tokens_per_expert: torch.Tensor, bad: torch.Tensor | None) -> torch.Tensor:
    """int32 end offsets of the groups; all zero (every group empty) where ``bad`` holds."""
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    if bad is not None:
        offsets.masked_fill_(bad, 0)
    return offsets


def _group_bounds(tokens_per_expert: torch.Tensor, bad: torch.Tensor | None):
    """int64 ``(starts, ends)`` of the groups; every group empty where ``bad`` holds."""
    ends = torch.cumsum(tokens_per_expert.long(), 0)
    if bad is not None:
        ends.masked_fill_(bad, 0)
    return ends - tokens_per_expert.long(), ends


class _GroupedMM(torch.autograd.Function):
    """:func:`grouped_mm` with the explicit gradients of :func:`grouped_mm_grads`: the weight
    gradient comes out in the weight's own layout (NOTE [weight gradient layout])."""

    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, impl, bad):
        ctx.save_for_backward(x, weight, tokens_per_expert)
        ctx.impl, ctx.bad = impl, bad
        return grouped_product(x, weight, tokens_per_expert, impl, bad)

    @staticmethod
    def backward(ctx, grad):
        x, weight, tokens_per_expert = ctx.saved_tensors
        grad_x, grad_w = grouped_mm_grads(grad.contiguous(), x, weight, tokens_per_expert,
                                          ctx.impl, bad=ctx.bad)
        return grad_x, grad_w, None, None, None


def check_grouped_args(x, weight, tokens_per_expert, *, x_name: str = "x",
                       weight_name: str = "weight", out_name: str = "out") -> None:
    """The argument checks of :func:`grouped_mm` (TypeError/ValueError naming the argument by
    the names given: :func:`~graphstash.moe.expert_mlp` calls its first weight ``w1``).
    Counts on the host are checked here too (NOTE [expert counts])."""
    require_float(x_name, x, "a 2-D floating tensor [rows, in]")
    if x.dim() != 2:
        raise ValueError(f"{x_name}: expected a 2-D floating tensor [rows, in], got "
                         f"{describe(x)}")
    expected = f"a 3-D tensor [experts, {out_name}, {x.shape[1]}] in {x.dtype} on {x.device}"
    require_float(weight_name, weight, expected)
    if weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        transposed = weight.dim() == 3 and weight.shape[1] == x.shape[1]
        raise ValueError(f"{weight_name}: expected {expected} (the layout "
                         f"[experts, out, in], as nn.Linear and HuggingFace's experts hold "
                         f"it), got {describe(weight)}"
                         + ("; it looks transposed" if transposed else ""))
    if weight.dtype != x.dtype:
        raise TypeError(f"{weight_name}: expected {expected}, got {describe(weight)}")
    if weight.device != x.device:
        raise ValueError(f"{weight_name}: expected {expected}, got {describe(weight)}")
    expected = f"an int32 or int64 tensor of shape ({weight.shape[0]},) on {x.device}"
    require_tensor("tokens_per_expert", tokens_per_expert, expected)
    if tokens_per_expert.dtype not in COUNT_DTYPES:
        raise TypeError(f"tokens_per_expert: expected {expected}, got {describe(tokens_per_expert)}")
    if tuple(tokens_per_expert.shape) != (weight.shape[0],) or tokens_per_expert.device != x.device:
        raise ValueError(f"tokens_per_expert: expected {expected}, got "
                         f"{describe(tokens_per_expert)}")
    if weight.shape[0] == 0:
        raise ValueError(f"{weight_name}: expected at least one expert, got {describe(weight)}")
    if _counts_readable(tokens_per_expert):          # NOTE [expert counts]
        _host_counts(tokens_per_expert, x.shape[0])


def resolve_impl(x: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> str:
    """The implementation ``grouped_mm(x, weight, ..., impl=impl)`` runs here, now:
    ``"grouped"``, ``"triton"``, ``"loop"`` or ``"masked"`` (``"auto"`` decides as NOTE
    [grouped_mm under capture] says). Raises ValueError for an unknown ``impl``, TypeError for
    ``"triton"`` with a dtype it does not take, BackendUnavailableError for ``"triton"``
    without Triton, and CaptureError for ``"loop"`` under capture."""
    if impl == "auto":
        return _auto(x, weight)
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected 'auto', {', '.join(map(repr, _IMPLS))}, got {impl!r}")
    if impl == "loop" and is_capturing():
        from ..errors import CaptureError

        raise CaptureError("grouped_mm(impl='loop') reads the expert counts back to the "
                           "host and cannot run while a CUDA graph is being captured")
    if impl == "triton":
        why = _triton_grouped.unavailable_reason(x.device, x.dtype)
        if x.dtype not in _triton_grouped.DTYPES:
            raise TypeError(f"x: impl='triton' expected float16, bfloat16 or float32, got "
                            f"{describe(x)}")
        if why is not None:
            from ..errors import BackendUnavailableError

            raise BackendUnavailableError(f"grouped_mm(impl='triton'): {why}")
        if not is_capturing():
            _triton_grouped.prepare(x, weight)
    return impl


_IMPLS = ("grouped", "triton", "loop", "masked")


def grouped_mm_grads(grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     tokens_per_expert: torch.Tensor, impl: str, *, bad=None,
                     need_x: bool = True, need_weight: bool = True):
    """Gradients of ``out = grouped_mm(x, weight, tokens_per_expert, impl=impl)``.

    Args:
        grad: ``[rows, out]`` gradient of ``out``, dtype and device of weight.
        x: ``[rows, in]`` the forward's input; ``None`` is allowed when ``need_weight`` is
            False (x's gradient does not read x). weight ``[experts, out, in]``.
        tokens_per_expert: int ``[experts]`` rows of each expert (as in the forward).
        impl: the implementation the forward ran (:func:`resolve_impl`), not ``"auto"``.
        bad: the forward's count check (0-dim bool on the device), ``TRUSTED`` for counts
            valid by construction, or ``None`` to check them here (NOTE [expert counts]).
        need_x, need_weight: which of the two to compute (the other is returned as None).
            Computing them in two calls lets a caller free x between them (NOTE [expert
            backward temporaries] in ``mlp.py``); the values are the same either way.
    Returns ``(grad_x [rows, in], grad_weight [experts, out, in])``. Rows of ``grad_x`` past
    the counts are unspecified, as are those of a forward's output; rows of ``grad`` and
    ``x`` past the counts never reach a result (NOTE [rows past the counts]).
    """
    if need_weight and x is None:
        raise ValueError("x: the weight gradient needs the forward's input, got None")
    if impl == "triton":
        return _triton_grouped.grads(grad, x, weight, tokens_per_expert, need_x=need_x,
                                     need_weight=need_weight)
    rows = grad.shape[0]
    bad = _resolve_bad(bad, tokens_per_expert, rows, impl)
    grad_x = grad_w = None
    if impl == "grouped":
        # NOTE [weight gradient layout]: grad_w[e] = grad_e^T @ x_e is computed as one grouped
        # product with grad^T as the first operand, so it comes out [experts, out, in], the
        # weight's own layout. Computing x^T @ grad and transposing the result (what autograd
        # does for torch._grouped_mm) hands AccumulateGrad a transposed view, which it copies
        # into a contiguous gradient: a strided pass over every expert weight (its time per
        # layer, with the command: docs/moe-performance.md, change 2).
        offsets = _offsets(tokens_per_expert, bad)
        if need_x:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)
        if need_weight and is_transposed_weight(weight):   # NOTE [transposed expert weights]
            grad_w = torch._grouped_mm(x.transpose(0, 1), grad, offs=offsets).transpose(-2, -1)
        elif need_weight:
            grad_w = torch._grouped_mm(grad.transpose(0, 1), x, offs=offsets)
        return grad_x, grad_w
    if impl == "masked":
        # NOTE [rows past the counts]: both operands are selected, not multiplied by zero
        starts, ends = _group_bounds(tokens_per_expert, bad)
        where = torch.arange(rows, device=grad.device).unsqueeze(1)
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
        if need_x:
            grad_x = grad.new_zeros(rows, weight.shape[2])
        per_expert = []
        for e in range(weight.shape[0]):
            mine = (where >= starts[e]) & (where < ends[e])
            g = torch.where(mine, grad, zero)
            if need_x:
                grad_x = grad_x + g @ weight[e]
            if need_weight:
                per_expert.append(g.t() @ torch.where(mine, x, zero))
        return grad_x, (torch.stack(per_expert) if need_weight else None)
    if impl == "loop":
        counts = _host_counts(tokens_per_expert, rows)
        if need_x:
            grad_x = grad.new_zeros(rows, weight.shape[2])
        if need_weight:
            grad_w = weight.new_zeros(weight.shape)
        start = 0
        for e, n in enumerate(counts):
            if n:
                if need_x:
                    grad_x[start:start + n] = grad[start:start + n] @ weight[e]
                if need_weight:
                    grad_w[e] = grad[start:start + n].t() @ x[start:start + n]
            start += n
        return grad_x, grad_w
    raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")
