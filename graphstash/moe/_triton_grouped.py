"""Grouped GEMM in Triton over device-side expert counts: captured by CUDA graphs in every
training dtype (fp16, bf16, fp32).

``grouped_mm`` (:mod:`graphstash.moe.experts`) runs :func:`forward` and :func:`grads` as
``impl="triton"``; inside a capture ``"auto"`` picks it where ``torch._grouped_mm`` cannot be
captured (NOTE [grouped_mm under capture]). Triton is imported on first use, never by
``import graphstash``. On a CUDA device the kernels are compiled by Triton; on the CPU they
run in Triton's interpreter (slow: for tests). See NOTE [triton grouped GEMM].
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from .._checks import is_capturing

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# NOTE [triton grouped GEMM]
# Three kernels (sources in _triton_grouped_kernels.py), each with a grid fixed by the static
# shapes, so nothing is read back to the host and a graph replays them with new counts:
#   - rows: out[rows of e] = a[rows of e] @ b[e] (forward: a = x, b[e] = weight[e].T;
#     grad_x: a = grad, b[e] = weight[e]). A row tile holds rows of one expert only. An expert
#     with n rows needs ceil(n / BM) tiles, so sum_e ceil(n_e / BM) <= ceil(rows / BM) + E
#     tiles cover any counts that sum to at most ``rows``: the grid has that many row-tile
#     slots times the column tiles. A plan built on the device with a few torch ops (cumsum
#     of counts and of tiles per expert, searchsorted of each slot) tells each slot its
#     expert and first row; slots past the last used tile return at once. Rows past the
#     counts are neither read nor written (their output stays unspecified).
#   - weight: grad_w[e] = grad[rows of e].T @ x[rows of e], one program per (expert, output
#     tile) looping over that expert's rows in order: no atomics, deterministic, zeros for an
#     expert without rows. One expert's share of the work is one expert's share of the rows,
#     so heavily skewed counts leave SMs idle (a split over rows would need atomics).
#   - Counts are clamped at 0 and rows at ``rows``, so counts that lie (summing past the
#     buffer) give wrong values but never touch memory outside the tensors.
# Accumulation is fp32. fp32 inputs use tf32 tensor cores only where the user allows them
# (torch.backends.cuda.matmul.allow_tf32, read at each call), else exact fp32 products
# (input_precision "ieee"). Tiles are fixed per dtype (no autotuning: autotuning launches and
# synchronises, which a capture forbids).
# A capture must not compile or load a kernel (loading a module is not permitted while a
# stream captures), so prepare() compiles and loads all three for an (x, weight) signature
# eagerly; grouped_mm's "auto" calls it on every eager call that a later capture may need
# (graph_step's warmup steps are such calls), and a launch under capture whose signature was
# not prepared raises CaptureError instead of breaking the capture. The row counts are not
# part of a signature (do_not_specialize), only dtype, widths, expert count and precision.


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shape (block sizes: powers of two, at least 16).

    ``block_m`` rows of x per tile (forward, grad_x), ``block_n`` output columns per tile,
    ``block_k`` of the reduced dimension per step; grad_w tiles are ``block_n x block_n`` and
    sum ``block_k`` rows per step. ``group_m`` row tiles share a sweep over the columns.
    """
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


_CONFIGS = {
    "16-bit": TileConfig(),
    "tf32": TileConfig(block_k=32),
    "ieee": TileConfig(block_m=64, block_n=64, block_k=32, num_warps=4),
}


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for ``dtype``: ``"ieee"`` for fp32 unless tf32 is allowed
    (``torch.backends.cuda.matmul.allow_tf32``), else ``"tf32"`` (ignored for 16-bit)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def default_config(dtype: torch.dtype) -> TileConfig:
    """The tiles used for ``dtype`` under the current tf32 setting (NOTE [triton grouped
    GEMM])."""
    return _CONFIGS["16-bit" if dtype != torch.float32 else precision(dtype)]


@functools.cache
def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not installed ({err})"
    return None


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``impl="triton"`` cannot run for ``dtype`` on ``device``, or None if it can."""
    if dtype not in DTYPES:
        return f"the Triton grouped GEMM takes float16, bfloat16 or float32, not {dtype}"
    if device.type not in ("cuda", "cpu"):
        return f"the Triton grouped GEMM runs on CUDA (or the CPU interpreter), not {device}"
    return _triton_missing()


@functools.cache
def _kernels(interpret: bool):
    """The two kernels, compiled by Triton (``interpret=False``) or interpreted (CPU)."""
    import triton

    from . import _triton_grouped_kernels as src

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        wrap = triton.jit
    # Row counts and the row-tile slots follow the tokens: not part of a compiled signature.
    return (wrap(src.grouped_rows, do_not_specialize=["M", "num_tiles"]),
            wrap(src.grouped_weight_grad, do_not_specialize=["M"]))


_ready: set = set()          # signatures compiled and loaded for capture
_failed: dict = {}           # signature -> why it could not be prepared


def _signature(x: torch.Tensor, weight: torch.Tensor,
               config: TileConfig | None = None) -> tuple:
    """What a compiled kernel depends on: device, dtype, weight shape, precision, tiles."""
    device = x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (str(device), x.dtype, tuple(weight.shape), precision(x.dtype),
            config or default_config(x.dtype))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides (also for size-1 dimensions) and a 16-byte aligned base:
    what every compiled signature assumes, so that a view never asks for a new compile."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if tuple(reversed(strides)) == t.stride() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _row_tile_slots(rows: int, experts: int, block_m: int) -> int:
    return (rows + block_m - 1) // block_m + experts


def _plan(counts: torch.Tensor, rows: int, block_m: int):
    """Device-side tile plan (NOTE [triton grouped GEMM]), int64 on counts' device:
    ``(tile_expert [slots], starts [E], ends [E], first_tile [E])``."""
    c = counts.to(torch.int64).clamp(min=0)
    ends = torch.cumsum(c, 0)
    starts = ends - c
    tiles = torch.div(c + (block_m - 1), block_m, rounding_mode="floor")
    tile_end = torch.cumsum(tiles, 0)
    slots = torch.arange(_row_tile_slots(rows, c.shape[0], block_m), device=c.device)
    tile_expert = torch.searchsorted(tile_end, slots, right=True)
    return tile_expert, starts, ends, tile_end - tiles


class _Launcher:
    """Launches (or, with ``warm=True``, only compiles and loads) the kernels for one call."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, *, config: TileConfig | None,
                 warm: bool = False):
        self.cfg = config or default_config(x.dtype)
        self.prec = precision(x.dtype)
        self.warm = warm
        self.interpret = x.device.type != "cuda"
        self.rows_kernel, self.weight_kernel = _kernels(self.interpret)
        # NOTE [interpreted bf16 products]
        self.dot_f32 = self.interpret and x.dtype == torch.bfloat16
        if not warm and x.device.type == "cuda" and is_capturing():
            sig = _signature(x, weight, self.cfg)
            if sig not in _ready:
                from ..errors import CaptureError

                raise CaptureError(
                    f"grouped_mm(impl='triton'): the kernels for {x.dtype}, weight "
                    f"{tuple(weight.shape)} were not compiled before this CUDA graph capture "
                    "(loading a kernel would break it); run one eager step first "
                    "(graph_step's warmup does)" + (f"; preparing them failed: {_failed[sig]}"
                                                    if sig in _failed else ""))

    def _launch(self, kernel, grid, *args, **meta):
        meta.update(num_warps=self.cfg.num_warps, num_stages=self.cfg.num_stages,
                    PREC=self.prec, DOT_F32=self.dot_f32)
        if not self.warm:
            kernel[grid](*args, **meta)
            return
        compiled = kernel.warmup(*args, grid=grid, **meta)
        init = getattr(compiled, "_init_handles", None)     # load the module now, not later
        if init is not None:
            init()

    def rows(self, a, b, b_strides, out, plan, cols: int, inner: int) -> None:
        """``out[rows of e] = a[rows of e] @ b[e]``; ``b[e][k, n]`` at ``b_strides``."""
        cfg = self.cfg
        tile_expert, starts, ends, first_tile = plan
        slots = tile_expert.shape[0]
        grid = (slots * ((cols + cfg.block_n - 1) // cfg.block_n),)
        if cols == 0 or slots == 0:
            return
        self._launch(self.rows_kernel, grid, a, b, out, tile_expert, starts, ends, first_tile,
                     a.shape[0], cols, inner, slots, starts.shape[0],
                     a.stride(0), *b_strides, out.stride(0),
                     BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)

    def weight_grad(self, grad, x, out, plan) -> None:
        """``out[e] = grad[rows of e].T @ x[rows of e]`` (zeros for an expert without rows)."""
        cfg = self.cfg
        _, starts, ends, _ = plan
        experts, n_out, n_in = out.shape
        tiles = (((n_out + cfg.block_n - 1) // cfg.block_n)
                 * ((n_in + cfg.block_n - 1) // cfg.block_n))
        if tiles == 0 or experts == 0:
            return
        self._launch(self.weight_kernel, (tiles, experts), grad, x, out, starts, ends,
                     x.shape[0], n_out, n_in, grad.stride(0), x.stride(0), out.stride(0),
                     out.stride(1), BI=cfg.block_n, BJ=cfg.block_n, BR=cfg.block_k)


def _weight_t_strides(weight):      # b[e] = weight[e].T: [in, out]
    return weight.stride(0), weight.stride(2), weight.stride(1)


def _weight_strides(weight):        # b[e] = weight[e]: [out, in]
    return weight.stride(0), weight.stride(1), weight.stride(2)


# NOTE [fp32 forward operand]: the forward's B tile is weight[e].T, read with the reduced
# dimension contiguous. With 16-bit or tf32 tensor cores that layout costs nothing, but the
# exact fp32 product ("ieee", no tensor cores) then ran several times slower than the same
# kernel computing x's gradient, whose B tile (weight[e]) is row-major. So under "ieee" the
# forward multiplies by a transposed, contiguous copy of the weight instead, made per call: a
# transient copy of the weight, whose time the probe's forward figures include (before and
# after, with the command: docs/moe-performance.md, "Grouped GEMM in every dtype").
def _forward_operand(weight: torch.Tensor, prec: str, *, stand_in: bool = False):
    """``(b, strides)`` of the forward's B operand (``b[e]`` is ``[in, out]``) for ``prec``
    (NOTE [fp32 forward operand]). ``stand_in``: a view of ``weight`` with the strides the
    copy would have, for compiling without copying."""
    if prec != "ieee":
        return weight, _weight_t_strides(weight)
    experts, n_out, n_in = weight.shape
    if stand_in:
        b = weight.as_strided((experts, n_in, n_out), (n_in * n_out, n_out, 1))
    else:
        b = weight.transpose(1, 2).contiguous()
    return b, _weight_strides(b)


def _device_of(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def prepare(x: torch.Tensor, weight: torch.Tensor, *, config: TileConfig | None = None) -> bool:
    """Compile and load the three kernels for ``grouped_mm(x, weight, ...)`` so that a later
    CUDA graph capture can launch them (NOTE [triton grouped GEMM]). Not capturable.

    Args:
        x: float16/bfloat16/float32 CUDA tensor: only its dtype and device matter (the
            widths come from the weight).
        weight: ``[experts, out, in]``, dtype and device of x.
        config: the tiles to prepare (default: :func:`default_config`).
    Returns whether they are ready. A failure to compile is remembered and warned about once;
    nothing is raised. On the CPU (interpreter) there is nothing to prepare.
    """
    if x.device.type != "cuda" or unavailable_reason(x.device, x.dtype) is not None:
        return False
    sig = _signature(x, weight, config)
    if sig in _ready:
        return True
    if sig in _failed:
        return False
    if is_capturing():
        return False
    try:
        weight = _dense(weight)
        with _device_of(x):
            launcher = _Launcher(x, weight, config=config, warm=True)
            plan = _plan(torch.zeros(weight.shape[0], dtype=torch.int64, device=x.device), 0,
                         launcher.cfg.block_m)
            # Warm-up launches nothing, so zero-row stand-ins with the dtype, alignment and
            # row strides the real (dense) operands will have give the signatures the real
            # calls will have: forward x [rows, in] -> [rows, out]; grad_x grad [rows, out]
            # -> [rows, in]; grad_w grad, x -> [experts, out, in] (the weight's own layout).
            # Only x's dtype and device are taken: the caller may pass a tensor of another
            # width (expert_mlp decides for its second GEMM from the first one's output).
            n_out, n_in = weight.shape[1], weight.shape[2]
            rows_in, rows_out = x.new_empty(0, n_in), x.new_empty(0, n_out)
            b, b_strides = _forward_operand(weight, launcher.prec, stand_in=True)
            launcher.rows(rows_in, b, b_strides, rows_out, plan, n_out, n_in)
            launcher.rows(rows_out, weight, _weight_strides(weight), rows_in, plan, n_in, n_out)
            launcher.weight_grad(rows_out, rows_in, weight, plan)
    except Exception as err:    # noqa: BLE001 - any failure means "not available here"
        _failed[sig] = f"{type(err).__name__}: {err}"
        warnings.warn(f"grouped_mm: the Triton grouped GEMM for {x.dtype} on {x.device} could "
                      f"not be compiled ({_failed[sig]}); graphs capture the masked dense "
                      "fallback instead", RuntimeWarning, stacklevel=3)
        return False
    _ready.add(sig)
    return True


def ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`prepare` has made the default kernels for ``(x, weight)`` ready to
    capture."""
    return x.device.type == "cuda" and _signature(x, weight) in _ready


def forward(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor, *,
            config: TileConfig | None = None) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ weight[e].T`` (no autograd: the public, checked and
    differentiable entry point is :func:`graphstash.moe.grouped_mm` with ``impl="triton"``).

    Args:
        x: ``[rows, in]`` float16, bfloat16 or float32, on a CUDA device (or the CPU, in
            Triton's interpreter).
        weight: ``[experts, out, in]``, dtype and device of x.
        tokens_per_expert: int32/int64 ``[experts]`` rows of each expert, on x's device, read
            only by the device (capturable once :func:`prepare` ran for this signature).
        config: overrides the tiles (measurements, tests).
    Returns ``[rows, out]`` in x's dtype; rows past the counts are unspecified. Example::

        y = forward(permuted, w1, counts)     # graphstash.moe.grouped_mm(..., impl="triton")
    """
    x, weight = _dense(x), _dense(weight)
    out = x.new_empty(x.shape[0], weight.shape[1])
    with _device_of(x):
        launcher = _Launcher(x, weight, config=config)
        plan = _plan(tokens_per_expert, x.shape[0], launcher.cfg.block_m)
        b, b_strides = _forward_operand(weight, launcher.prec)
        launcher.rows(x, b, b_strides, out, plan, weight.shape[1], weight.shape[2])
    return out


def grads(grad: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
          tokens_per_expert: torch.Tensor, *, need_x: bool = True, need_weight: bool = True,
          config: TileConfig | None = None):
    """Gradients of ``out = grouped_mm(x, weight, tokens_per_expert)``.

    Args:
        grad: ``[rows, out]`` gradient of ``out``, dtype and device of weight.
        x: ``[rows, in]`` float16/bfloat16/float32; weight ``[experts, out, in]``, same dtype
            and device. ``None`` when only x's gradient is wanted (it does not read x).
        tokens_per_expert: int32/int64 ``[experts]`` on weight's device.
        need_x, need_weight: which of the two to compute (the other is returned as None).
        config: overrides the tiles (measurements, tests).
    Returns ``(grad_x [rows, in], grad_weight [experts, out, in])``: rows of grad_x past the
    counts unspecified, grad_weight of an expert without rows zero. Rows of ``grad`` and
    ``x`` past the counts are not read.
    """
    grad, weight = _dense(grad), _dense(weight)
    x = _dense(x) if x is not None else None
    rows = grad.shape[0]
    grad_x = grad_w = None
    # the kernels' signature depends on dtype, device and weight shape, which grad shares
    like = x if x is not None else grad
    with _device_of(like):
        launcher = _Launcher(like, weight, config=config)
        plan = _plan(tokens_per_expert, rows, launcher.cfg.block_m)
        if need_x:
            grad_x = grad.new_empty(rows, weight.shape[2])
            launcher.rows(grad, weight, _weight_strides(weight), grad_x, plan, weight.shape[2],
                          weight.shape[1])
        if need_weight:
            grad_w = weight.new_empty(weight.shape)
            launcher.weight_grad(grad, x, grad_w, plan)
    return grad_x, grad_w
