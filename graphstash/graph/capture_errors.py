"""Why a CUDA graph capture failed, read from the exception chain, and what to change.

NOTE [capture failure causes]: a failed capture surfaces as whatever the first illegal
operation raised, often deep inside torch or a compiler, and several different mistakes end
in similar CUDA errors. :func:`classify` reads the whole chain (``__cause__`` and
``__context__``: dynamo wraps the error of a compile in ``BackendCompilerFailed``) and picks
the first cause that matches, in this order:

- ``"compile"``: torch.compile compiled inside the capture. graph_step refuses it before
  Inductor starts (NOTE [compile and capture] in ``compile_guard.py``: the refusal names the
  function and the guard that failed); an Inductor or dynamo compile that still got there is
  recognised by its exception types and by the compiler's frames in the traceback. It comes
  first because a compile inside a capture fails with any of the errors below;
- ``"legacy_stream"``: work on the legacy default stream while a *blocking* stream captures
  (``cudaErrorStreamCaptureImplicit``). graph_step's own stream does not block (torch's
  streams are created non-blocking), so this needs a blocking stream joined to the capture
  (CuPy's streams block by default); work on the legacy stream beside graph_step's stream
  alone is not refused: it runs at once and is missing from the graph (measured on torch
  2.11);
- ``"pageable_copy"``: a host-device copy from pageable memory (torch refuses it before the
  driver does);
- ``"outside_pool"``: memory or work the graph does not own: an allocation on a stream the
  capture does not include (the caching allocator then calls cudaMalloc outside the capture,
  which the capturing thread may not: "operation not permitted when stream is capturing",
  told from a host sync by the ``with ... stream(...)`` block around the line that raised),
  CuPy allocating or launching by itself, a dependency on uncaptured work
  (``cudaErrorStreamCaptureIsolation``) or a fork never joined back
  (``cudaErrorStreamCaptureUnjoined``). A pinned host buffer allocated inside the step is not
  refused by torch (measured on torch 2.11): the graph then copies from memory it does not
  own, and nothing here can see it;
- ``"capturable_optimizer"``: an optimizer step that cannot be captured;
- ``"graphstash"``: graphstash's own refusal (a :class:`~graphstash.errors.CaptureError`
  raised inside the step, e.g. a stash buffer that the warmup did not size): its message
  already says what to do and is kept;
- ``"host_sync"``: the step read the device from the host or synchronised
  (``cudaErrorStreamCaptureUnsupported``: ``.item()``, ``.tolist()``, ``nonzero``, ...), or
  the capture was invalidated by such an operation;
- ``"other"``: anything else the step raised while it was captured.
"""
from __future__ import annotations

import dataclasses
import linecache
import os
import re
import traceback

import torch

from ..errors import CaptureError, GraphstashError
from . import compile_guard

CAUSES = ("compile", "legacy_stream", "pageable_copy", "outside_pool", "capturable_optimizer",
          "graphstash", "host_sync", "other")

_COMPILE_TYPES = ("BackendCompilerFailed", "RecompileError", "InternalTorchDynamoError",
                  "TorchRuntimeError", "Unsupported")
# frames that only compile: dynamo's tracing, the backend call, Inductor's compile functions
# (compile_fx.py also holds the runtime wrappers of cudagraph-compiled code: its compile
# functions are told by name); a lazy backward compile passes through compile_fx_inner
_COMPILER_FILES = ("/torch/_dynamo/convert_frame.py", "/torch/_dynamo/output_graph.py",
                   "/torch/_dynamo/symbolic_convert.py")
_COMPILER_FUNCTIONS = ("compile_fx", "compile_fx_inner", "fx_codegen_and_compile",
                       "_compile_fx_inner", "codegen_and_compile")
# torch.compile(mode="reduce-overhead"): Inductor's own CUDA graphs (cudagraph trees)
_CUDAGRAPH_FILES = ("/torch/_inductor/cudagraph_trees.py", "/torch/_inductor/cudagraph_utils.py")
_LEGACY = ("legacy stream", "cudaerrorstreamcaptureimplicit")
_PAGEABLE = ("cannot copy between cpu and cuda tensors during cuda graph capture",)
_OUTSIDE_POOL = ("uncaptured work in another stream", "cudaerrorstreamcaptureisolation",
                 "unjoined work", "fork that was not joined", "cudaerrorstreamcaptureunjoined")
# the line that raised sits in a ``with <...>.stream(...)`` block
_STREAM_BLOCK = re.compile(r"^\s*with\b.*\bstream\s*\(")
_HOST_SYNC = ("not permitted when stream is capturing", "cudaerrorstreamcaptureunsupported",
              "cudaerrorstreamcaptureinvalidated", "previous error during capture",
              "synchron", "during cuda graph capture")

_HINTS = {
    "compile": (
        "every compile and recompile must happen in an eager call (graph_step's warmup, or the "
        "first call of a new input signature), never inside the capture. A failed guard shows "
        "what differs from the warmup call: a Python value the compiled code reads (a global, "
        "an attribute, a counter, a flag) must keep its warmup value or become a tensor; a "
        "tensor must keep its shape, dtype, device and requires_grad; grad mode and autocast "
        "must match. A compiled function first called at the capture needs warmup >= 1; "
        "torch.compile(mode='reduce-overhead') captures graphs of its own and cannot run "
        "inside graph_step: compile with the default mode"),
    "legacy_stream": (
        "a kernel or copy was issued on the legacy default stream (stream 0) while the step "
        "was being captured on graph_step's own stream. Launch everything on "
        "torch.cuda.current_stream() or on side streams forked from it: no "
        "torch.cuda.default_stream() or torch.cuda.stream(torch.cuda.default_stream()) inside "
        "the step, CuPy, Numba or Triton launches given stream=torch.cuda.current_stream()"
        ".cuda_stream, no synchronous cudaMemcpy in extensions"),
    "pageable_copy": (
        "a copy between the host and the GPU used pageable host memory, which a CUDA graph "
        "cannot hold. Make the tensor on the GPU with a factory (torch.full, torch.zeros, "
        "torch.arange(..., device=...)) or keep a Python number a number (x * 0.5 copies "
        "nothing), or pin the host tensor once before the step (.pin_memory()) and copy it "
        "with non_blocking=True; torch.tensor(value, device='cuda') and .cuda() of a host "
        "tensor inside the step are such copies"),
    "outside_pool": (
        "the step used memory or a stream that the graph does not own: the graph's memory "
        "pool holds only device memory allocated on the capturing stream and streams forked "
        "from it. Allocate pinned host buffers before the step (graphstash's offload and stash "
        "buffers are created in the warmup), fork a side stream from the current stream "
        "(side.wait_stream(torch.cuda.current_stream())) before using it inside the step and "
        "join it back (torch.cuda.current_stream().wait_stream(side)) before the step returns"),
    "capturable_optimizer": (
        "construct the optimizer with capturable=True (graphstash.graph_step checks this "
        "before capturing)"),
    "graphstash": "",
    "host_sync": (
        "the step synchronised with the host, which a CUDA graph cannot contain: remove "
        ".item(), .tolist(), .cpu(), float(tensor), print(tensor), torch.nonzero, "
        "boolean-mask indexing and other data-dependent shapes from the step, or move them out "
        "of the decorated function"),
    "other": "the step raised while it was being captured; it must run unchanged on every call",
}

_WHAT = {
    "compile": "torch.compile would compile inside the capture",
    "legacy_stream": "work on the legacy default stream during the capture",
    "pageable_copy": "a copy from pageable host memory during the capture",
    "outside_pool": "memory or a stream outside the graph's pool",
    "capturable_optimizer": "an optimizer step that cannot be captured",
    "graphstash": "",
    "host_sync": "a host synchronisation during the capture",
    "other": "",
}


@dataclasses.dataclass(frozen=True)
class CaptureFailure:
    """The cause of a failed capture (one of :data:`CAUSES`), the error that shows it
    (``"Type: first line"``), extra lines (the guards that failed) and what to change."""

    cause: str
    error: str
    detail: str
    hint: str


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first (no cycles).
    A suppressed context is followed too: dynamo raises its compile errors ``from None``."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen and len(chain) < 32:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _type_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    """``(path, function)`` of each frame of ``exc``'s traceback, outermost first."""
    return [(f.filename.replace("\\", "/"), f.name)
            for f in traceback.extract_tb(exc.__traceback__)]


def _compiling(frames: list[tuple[str, str]]) -> bool:
    return any(path.endswith(_COMPILER_FILES) or
               ("/torch/_inductor/" in path and name in _COMPILER_FUNCTIONS)
               for path, name in frames)


def _in_cudagraph_trees(frames: list[tuple[str, str]]) -> bool:
    return any(path.endswith(_CUDAGRAPH_FILES) or
               ("/torch/_inductor/" in path and "cudagraph" in name) for path, name in frames)


def _compile_failure(chain: list[BaseException]) -> CaptureFailure | None:
    for exc in chain:
        if compile_guard.is_refusal(exc):
            details = compile_guard.recompile_details(exc)
            if details.guards:
                shown = details.guards[:4]
                detail = ("guard that failed: " + shown[0]
                          + "".join(f"; earlier compile: {g}" for g in shown[1:]))
                what = f"{details.where} would be recompiled inside the capture"
            else:
                detail = "it was not compiled (for these inputs) by any eager call before"
                what = f"{details.where} would be compiled inside the capture"
            return CaptureFailure("compile", what, detail, _HINTS["compile"])
    frames = [frame for exc in chain for frame in _frames(exc)]
    if _in_cudagraph_trees(frames):
        return CaptureFailure(
            "compile", "a function compiled with torch.compile(mode='reduce-overhead') ran its "
            "own CUDA graphs inside the capture", _first_line(chain[-1]), _HINTS["compile"])
    for exc in chain:
        if _type_names(exc) & set(_COMPILE_TYPES) or _compiling(_frames(exc)):
            return CaptureFailure("compile", "torch.compile compiled inside the capture",
                                  _first_line(chain[-1]), _HINTS["compile"])
    return None


def _matches(chain: list[BaseException], needles: tuple[str, ...]) -> BaseException | None:
    for exc in chain:
        text = f"{type(exc).__name__}: {exc}".lower()
        if any(n in text for n in needles):
            return exc
    return None


def classify(exc: BaseException) -> CaptureFailure:
    """The cause of a capture that failed with ``exc`` (NOTE [capture failure causes]).

    Example::

        try:
            graph_body()
        except Exception as exc:
            failure = classify(exc)       # failure.cause == "host_sync", failure.hint ...
    """
    chain = exception_chain(exc)
    found = _compile_failure(chain)
    if found is not None:
        return found
    for cause, needles in (("legacy_stream", _LEGACY), ("pageable_copy", _PAGEABLE),
                           ("outside_pool", _OUTSIDE_POOL)):
        hit = _matches(chain, needles)
        if hit is not None:
            return CaptureFailure(cause, _first_line(hit), "", _HINTS[cause])
    sync = _matches(chain, _HOST_SYNC)
    if sync is not None:
        frame = _user_frame_summary(exc)
        if frame is not None and _in_stream_block(frame):
            return CaptureFailure("outside_pool", _first_line(sync),
                                  "it ran on a stream of its own: a stream the capture does "
                                  "not include allocates outside the graph's pool (refused)",
                                  _HINTS["outside_pool"])
        if any(type(e).__name__ == "CUDARuntimeError" and "cupy" in type(e).__module__
               for e in chain):
            return CaptureFailure("outside_pool", _first_line(sync),
                                  "CuPy allocated memory or launched work itself, outside "
                                  "torch's capture (CuPy's memory pool and streams)",
                                  _HINTS["outside_pool"])
    hit = _matches(chain, ("capturable",))
    if hit is not None:
        return CaptureFailure("capturable_optimizer", _first_line(hit), "",
                              _HINTS["capturable_optimizer"])
    for e in chain:
        if isinstance(e, GraphstashError):
            return CaptureFailure("graphstash", _first_line(e), "", "")
    if sync is not None:
        return CaptureFailure("host_sync", _first_line(sync), "", _HINTS["host_sync"])
    return CaptureFailure("other", _first_line(exc), "", _HINTS["other"])


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _user_frame_summary(exc: BaseException):
    """The innermost frame of the user's code (outside torch, the code Inductor generates,
    CuPy and graphstash), else the innermost graphstash frame, else None."""
    fallback = None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if (path.startswith(_TORCH_DIR + os.sep) or "torchinductor" in path
                or "cupy" in path or not os.path.isabs(frame.filename)):
            continue
        if path.startswith(_PACKAGE_DIR + os.sep):
            fallback = fallback or frame
            continue
        return frame
    return fallback


def _user_frame(exc: BaseException) -> str:
    """`` at file:line (source)`` of :func:`_user_frame_summary`, or ``""``."""
    frame = _user_frame_summary(exc)
    if frame is None:
        return ""
    return f" at {frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})"
                                                     if frame.line else "")


def _in_stream_block(frame) -> bool:
    """Whether ``frame``'s line is inside a ``with ... stream(...):`` block of its function
    (read from the source; False where the source is not available)."""
    lines = linecache.getlines(frame.filename)
    if not lines or not frame.lineno or frame.lineno > len(lines):
        return False
    text = lines[frame.lineno - 1]
    indent = len(text) - len(text.lstrip())
    for line in reversed(lines[max(0, frame.lineno - 200): frame.lineno - 1]):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(line) - len(stripped)
        if depth < indent:
            if _STREAM_BLOCK.match(line):
                return True
            if stripped.startswith(("def ", "async def ", "class ")):
                return False
            indent = depth
    return False


def describe(exc: BaseException, name: str, *, eager: bool = False) -> tuple[str, str]:
    """``(message, cause)`` for a capture of step ``name`` that failed with ``exc``: where in
    the user's code, the cause (NOTE [capture failure causes]), the error and what to change.
    ``eager``: the step ran eagerly on the CPU, where the same call would be captured on a GPU.

    Example::

        message, cause = describe(exc, "train_step")
        raise CaptureError(message, cause=cause) from exc
    """
    failure = classify(exc)
    if eager:
        head = (f"{name} would fail to capture on a CUDA device (on the CPU it runs eagerly, "
                f"but the same contract applies){_user_frame(exc)}")
    else:
        head = f"capturing {name} failed{_user_frame(exc)}"
    what = _WHAT[failure.cause]
    if failure.cause == "compile":
        body = f"{failure.error}; {failure.detail}"
    elif failure.cause in ("graphstash", "other"):
        body = failure.error
    else:
        body = f"{what}: {failure.error}" + (f" ({failure.detail})" if failure.detail else "")
    message = f"{head}: {body}."
    if failure.hint:
        message += f" {failure.hint[0].upper()}{failure.hint[1:]}"
    return message, failure.cause


def capture_error(exc: BaseException, name: str, *, eager: bool = False) -> CaptureError:
    """A :class:`~graphstash.errors.CaptureError` for ``exc`` (:func:`describe`), its
    ``cause`` set; raise it ``from exc``."""
    message, cause = describe(exc, name, eager=eager)
    return CaptureError(message, cause=cause)
