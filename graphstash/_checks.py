"""Argument checks shared by the public API: each raises TypeError/ValueError naming the argument."""
from __future__ import annotations

import torch

from .errors import CaptureError

COUNT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def describe(t: torch.Tensor) -> str:
    """Short description of a tensor for error messages: dtype, shape and device."""
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def require_tensor(name: str, value, expected: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")
    return value


def require_float(name: str, value, expected: str) -> torch.Tensor:
    """``value`` if it is a floating tensor (:data:`FLOAT_DTYPES`) on the CPU or a CUDA
    device; else TypeError (not a tensor, not floating) or ValueError (another device, e.g.
    meta) naming ``name`` and ``expected``."""
    require_tensor(name, value, expected)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected {expected} (bfloat16, float16, float32 or "
                        f"float64), got {describe(value)}")
    if value.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a tensor on a CUDA device or the CPU, got "
                         f"{describe(value)}")
    return value


def require_positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")
    return value


def check_counts(name: str, num_tokens, *, device: torch.device, segments: int) -> torch.Tensor:
    """Validate a live-row count tensor: int32/int64, on ``device``, shape ``(segments,)``."""
    expected = (f"an int32 or int64 tensor of shape ({segments},) on {device}")
    require_tensor(name, num_tokens, expected)
    if num_tokens.dtype not in COUNT_DTYPES or num_tokens.device != device:
        raise TypeError(f"{name}: expected {expected}, got {describe(num_tokens)}")
    if tuple(num_tokens.shape) != (segments,):
        raise ValueError(f"{name}: expected {expected}, got {describe(num_tokens)}")
    if not num_tokens.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {num_tokens.stride()}")
    return num_tokens


def is_capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def forbid_capture(what: str) -> None:
    """Raise CaptureError if the current stream is capturing; ``what`` names the operation."""
    if is_capturing():
        raise CaptureError(
            f"{what} cannot run while a CUDA graph is being captured; "
            "do it before the capture (graphstash.warmup() compiles kernels ahead)")


def normalize_device(device, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` with its index: a CUDA device (needs CUDA) or the CPU.

    ``None`` means the current CUDA device, or the CPU when torch sees no GPU. Raises
    TypeError/ValueError naming ``name``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{name}: expected a torch.device or device string, got {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {device!r} requested but torch sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"{name}: expected a CUDA or CPU device, got {dev}")
    return dev

