"""torch.compile under :func:`~graphstash.graph_step`: every compile in an eager call, none in
a capture (NOTE [compile and capture]).

NOTE [compile and capture]: a function compiled with ``torch.compile`` checks its guards at
every call and recompiles when one fails. A recompile inside a CUDA graph capture cannot work:
Inductor reads and writes the device while it compiles (constants, benchmarks, first kernel
loads), which a capture refuses or records into the graph ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture", "operation would make the legacy stream depend on a
capturing blocking stream"). graph_step keeps compiles out of captures in four ways:

1. nothing graphstash shows to traced code changes between a warmup call and the capture:
   the mode and the running step's status are read as values that are the same in both (NOTE
   [state read by traced code] in ``graphstash/_mode.py``), and the stash machinery, whose
   state does change there (the warmup measures, the capture runs the sized pool), is not
   traced at all (NOTE [untraced machinery] in ``graphstash/_untraced.py``), so the stash
   needs no extra warmup call after it is sized;
2. a signature (argument shapes, dtypes, devices and constants) is captured only after an
   eager call with it, once torch.compile is in use in the process (:class:`EagerSignatures`):
   the warmup calls count, and a new shape under ``on_new_shape="recapture"`` runs one eager
   call (a full step, its update applied) before its capture. A model compiled before the
   step (an eval pass, an earlier graph_step, another shape) recompiles there if it must;
3. the capture runs under ``torch.compiler.set_stance("fail_on_recompile")``
   (:func:`refusing_compiles`): whatever would still compile there (a guard on the user's own
   Python state that changed since the warmup, a compiled function the warmup never called)
   raises before Inductor starts, and the capture fails with a
   :class:`~graphstash.errors.CaptureError` that names the function and the guard that
   failed (:func:`recompile_details`; the message is built in ``capture_errors.py``).

4. the dropless rerun of a flagged step runs uncompiled (:func:`running_uncompiled`). It is
   eager by design and reads counts back to the host, so traced it breaks the graph inside
   dispatch, and dynamo, failing to resume there, skips the model's compiled frame for good:
   the next calls then compile the model's inner functions one by one, a recapture among them
   (measured on the CPU: refused in the first call after a flagged warmup step). Uncompiled,
   the rerun leaves the compiled code as the warmup left it.

The lazy parts of a compiled function run in its first eager call: AOTAutograd compiles the
backward at the first backward, Inductor loads and tunes its kernels at their first launch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys

import torch

REFUSAL = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
_WHERE = re.compile(r"filename: '(?P<file>[^']*)', function name: '(?P<function>[^']*)', "
                    r"line number: (?P<line>\d+)")
_GUARD = re.compile(r"^\s*-\s+\d+/\d+:\s*(?P<guard>\S.*?)\s*$")     # "- 0/1: <guard>  # <line>"


def compiler_loaded() -> bool:
    """Whether ``torch._dynamo`` is imported: ``torch.compile`` imports it, so without it no
    compiled function exists in the process. The stances are set only then: setting one
    imports dynamo, which must not happen inside a capture (its import touches the device)."""
    return "torch._dynamo" in sys.modules


def compile_in_use() -> bool:
    """True once torch.compile has traced a frame in this process (so a compiled function may
    run inside a step). Unknown internals count as True: the cost of a wrong True is one eager
    call per new signature."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False
    try:
        return utils.counters["frames"]["total"] > 0
    except (AttributeError, KeyError, TypeError):
        return True


class EagerSignatures:
    """The call signatures a :class:`~graphstash.graph.GraphStep` ran eagerly, in the
    configuration a capture runs (NOTE [compile and capture], point 2).

    Example::

        seen = EagerSignatures()
        seen.ran(sig)                   # after a warmup call with signature ``sig``
        seen.needs_eager_call(sig)      # False: it may be captured
    """

    def __init__(self):
        self._seen: set = set()

    def ran(self, signature: tuple) -> None:
        """Record that ``signature`` ran eagerly (not dropless)."""
        self._seen.add(signature)

    def needs_eager_call(self, signature: tuple) -> bool:
        """Whether a call with ``signature`` must run eagerly before it is captured: compiled
        code is in use and no eager call had this signature."""
        return signature not in self._seen and compile_in_use()


@contextlib.contextmanager
def running_uncompiled(enabled: bool = True):
    """Inside the block ``torch.compile``'d functions run their original Python, eagerly:
    nothing is compiled, guarded or marked (``set_stance("force_eager")``). graph_step's
    dropless rerun runs so (NOTE [compile and capture], point 4). ``enabled=False`` does
    nothing."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if not enabled or set_stance is None or not compiler_loaded():
        yield
        return
    with set_stance("force_eager"):
        yield


@contextlib.contextmanager
def refusing_compiles(enabled: bool = True):
    """Inside the block a ``torch.compile``'d function that would compile or recompile raises
    ``RuntimeError`` (:data:`REFUSAL`, with the guards that failed) instead; code that is not
    compiled is not affected. ``enabled=False`` does nothing.

    The stance is process-wide: other threads calling compiled functions meanwhile are refused
    too. Example::

        with refusing_compiles():
            compiled_model(x)        # raises instead of recompiling
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if not enabled or set_stance is None or not compiler_loaded():
        yield
        return
    with set_stance("fail_on_recompile"):
        yield


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is the error of a compile refused by :func:`refusing_compiles`."""
    return isinstance(exc, RuntimeError) and REFUSAL in str(exc)


@dataclasses.dataclass(frozen=True)
class RecompileDetails:
    """What a refused compile names: the compiled function, where it is, the guards that
    failed (empty when it was never compiled before)."""

    function: str
    file: str
    line: int
    guards: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.function} ({self.file}:{self.line})" if self.file else self.function


def recompile_details(exc: BaseException) -> RecompileDetails:
    """Parse a refusal (see :func:`is_refusal`) into :class:`RecompileDetails`.

    torch prints one line per failed guard after "triggered by the following guard
    failure(s):", as ``- 0/1: <guard>  # <source line>``; older versions print no location
    and no guards. Example::

        details = recompile_details(exc)
        details.guards[0]      # "tensor 'x' size mismatch at index 0. expected 4, actual 7"
    """
    text = str(exc)
    where = _WHERE.search(text)
    guards: list[str] = []
    for line in text.splitlines():
        match = _GUARD.match(line)
        if match is not None:
            guard = " ".join(match.group("guard").split())
            if guard not in guards:
                guards.append(guard)
    if where is None:
        return RecompileDetails(function="a torch.compile'd function", file="", line=0,
                                guards=tuple(guards))
    return RecompileDetails(function=where.group("function"), file=where.group("file"),
                            line=int(where.group("line")), guards=tuple(guards))
