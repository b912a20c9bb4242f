"""Why a capture failed (graphstash/graph/capture_errors.py, NOTE [capture failure causes]):
the classifier on real exceptions (a refused recompile, a compile that failed inside the
backend, chained errors) and on the CUDA error texts torch raises inside a capture, and the
message ``graph_step`` builds from it. The GPU twin (test_capture_errors_gpu.py) triggers each
cause for real inside ``graph_step``.
"""
from __future__ import annotations

import pytest
import torch

from graphstash.errors import CaptureError
from graphstash.graph import capture_errors, compile_guard
from graphstash.graph.capture_errors import CAUSES, classify, describe, exception_chain

# What torch raises inside a capture: CUDA errors as torch 2.11 (CUDA 13) formats them on an
# H100 (torch.AcceleratorError: "CUDA error: <cudaGetErrorString>", the error's name, torch's
# advice), torch's own checks as their sources write them.
_ADVICE = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so "
           "the stacktrace below might be incorrect.\nFor debugging consider passing "
           "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
           "assertions.\n")


def _cuda_error(message: str, name: str) -> str:
    return (f"CUDA error: {message}\nSearch for `{name}' in https://docs.nvidia.com/cuda/"
            f"cuda-runtime-api/group__CUDART__TYPES.html for more information." + _ADVICE)


CUDA_TEXTS = {
    "legacy_stream": _cuda_error("operation would make the legacy stream depend on a capturing "
                                 "blocking stream", "cudaErrorStreamCaptureImplicit"),
    "host_sync": _cuda_error("operation not permitted when stream is capturing",
                             "cudaErrorStreamCaptureUnsupported"),
    "pageable_copy": "Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                     "unless the CPU tensor is pinned.",
    "outside_pool": _cuda_error("dependency created on uncaptured work in another stream",
                                "cudaErrorStreamCaptureIsolation"),
    "capturable_optimizer": "Attempting CUDA graph capture of step() for an instance of AdamW "
                            "but param_groups' capturable is False.",
}
UNJOINED = _cuda_error("capturing stream has unjoined work", "cudaErrorStreamCaptureUnjoined")
ERROR_TYPE = getattr(torch, "AcceleratorError", RuntimeError)     # torch 2.11's CUDA errors


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _raised(text: str, cls=RuntimeError) -> BaseException:
    """``cls(text)`` raised from a line of this file (so it has a traceback)."""
    try:
        raise cls(text)
    except BaseException as exc:        # noqa: BLE001 - the object is what the test needs
        return exc


@pytest.mark.parametrize("cause", sorted(CUDA_TEXTS))
def test_each_cuda_error_text_is_its_own_cause(cause):
    cls = ERROR_TYPE if CUDA_TEXTS[cause].startswith("CUDA error") else RuntimeError
    failure = classify(_raised(CUDA_TEXTS[cause], cls))
    assert failure.cause == cause, failure
    assert failure.error.startswith(f"{cls.__name__}: ") and "\n" not in failure.error
    assert failure.hint, failure


def test_a_fork_never_joined_is_work_outside_the_graph():
    failure = classify(_raised(UNJOINED, ERROR_TYPE))
    assert failure.cause == "outside_pool" and "join" in failure.hint


def _raised_in(path: str, function: str, text: str) -> BaseException:
    """``RuntimeError(text)`` raised by a function ``function`` compiled as if it were in
    ``path`` (the classifier reads file and function names of the traceback)."""
    code = compile(f"def {function}():\n    raise RuntimeError({text!r})\n", path, "exec")
    namespace: dict = {}
    exec(code, namespace)
    try:
        namespace[function]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


def test_cudagraph_trees_inside_the_capture_are_reduce_overhead():
    """torch.compile(mode="reduce-overhead") replays and records graphs of its own: inside
    graph_step's capture they fail with a host-sync error raised in Inductor's cudagraph
    trees (measured: "operation not permitted when stream is capturing")."""
    exc = _raised_in("/x/site-packages/torch/_inductor/cudagraph_trees.py", "run",
                     CUDA_TEXTS["host_sync"])
    failure = classify(exc)
    assert failure.cause == "compile" and "reduce-overhead" in failure.error


def test_inductor_runtime_frames_are_not_a_compile():
    """compile_fx.py also holds the runtime wrappers of compiled code: a host sync raised
    under them is a host sync, a compile function there is a compile."""
    runtime = _raised_in("/x/site-packages/torch/_inductor/compile_fx.py", "run",
                         CUDA_TEXTS["host_sync"])
    assert classify(runtime).cause == "host_sync"
    compiling = _raised_in("/x/site-packages/torch/_inductor/compile_fx.py", "compile_fx_inner",
                           CUDA_TEXTS["host_sync"])
    assert classify(compiling).cause == "compile"


def test_every_cause_has_a_distinct_hint():
    hints = [capture_errors._HINTS[c] for c in CAUSES if c not in ("graphstash",)]
    assert len(set(hints)) == len(hints)


def test_host_sync_is_not_the_answer_to_everything():
    """Before this classifier every capture failure was called a host sync: the texts of the
    other causes contain "capturing" and "capture" too."""
    causes = {cause: classify(_raised(text, ERROR_TYPE)).cause
              for cause, text in CUDA_TEXTS.items()}
    assert causes == {c: c for c in CUDA_TEXTS}


def test_a_refused_recompile_names_the_function_and_the_guard(gen):
    settings = {"scale": 2.0}

    def scaled_step(x):
        return x * settings["scale"]

    compiled = torch.compile(scaled_step, backend="eager")
    x = torch.randn(4, generator=gen)
    compiled(x)
    settings["scale"] = 3.0            # Python state the compiled code read changes
    with compile_guard.refusing_compiles():
        with pytest.raises(RuntimeError) as info:
            compiled(x)
    assert compile_guard.is_refusal(info.value)
    failure = classify(info.value)
    assert failure.cause == "compile"
    assert "scaled_step" in failure.error and "recompiled inside the capture" in failure.error
    assert "guard that failed" in failure.detail and "scale" in failure.detail, failure
    details = compile_guard.recompile_details(info.value)
    assert details.function == "scaled_step" and details.file == __file__ and details.line > 0


def test_a_refused_first_compile_says_no_eager_call_compiled_it(gen):
    compiled = torch.compile(lambda x: x.sin() * 2, backend="eager")
    with compile_guard.refusing_compiles():
        with pytest.raises(RuntimeError) as info:
            compiled(torch.randn(3, generator=gen))
    failure = classify(info.value)
    assert failure.cause == "compile"
    assert "would be compiled inside the capture" in failure.error
    assert "not compiled" in failure.detail and "guard" not in failure.detail


def test_recompile_details_lists_each_cache_entry_once(gen):
    compiled = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    compiled(torch.randn(4, generator=gen))
    compiled(torch.randn(5, generator=gen))
    with compile_guard.refusing_compiles():
        with pytest.raises(RuntimeError) as info:
            compiled(torch.randn(7, generator=gen))
    guards = compile_guard.recompile_details(info.value).guards
    assert guards and all("size mismatch" in g for g in guards), guards
    assert any("actual 7" in g for g in guards) and len(set(guards)) == len(guards)


def test_refusing_compiles_leaves_compiled_code_that_needs_none_alone(gen):
    compiled = torch.compile(lambda x: x * 3, backend="eager")
    x = torch.randn(4, generator=gen)
    want = compiled(x)
    with compile_guard.refusing_compiles():
        torch.testing.assert_close(compiled(x), want, atol=0, rtol=0)
    with compile_guard.refusing_compiles(enabled=False):
        compiled(torch.randn(2, 2, generator=gen))      # a recompile, allowed


def test_a_compile_that_failed_in_the_backend_is_a_compile_not_its_inner_error(gen):
    """Inductor compiling inside a capture fails with the capture's own errors (here the
    pageable-copy text it raised in the issue); dynamo wraps them in BackendCompilerFailed,
    and the cause is the compile."""
    def backend(graph_module, example_inputs):
        raise RuntimeError(CUDA_TEXTS["pageable_copy"])

    compiled = torch.compile(lambda x: x.cos() + 1, backend=backend)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, generator=gen))
    chain = exception_chain(info.value)
    assert any(type(e).__name__ == "BackendCompilerFailed" for e in chain)
    failure = classify(info.value)
    assert failure.cause == "compile", failure
    assert "compiled inside the capture" in failure.error
    assert "Cannot copy between CPU and CUDA" in failure.detail


def test_the_cause_is_found_anywhere_in_the_chain():
    try:
        try:
            raise RuntimeError(CUDA_TEXTS["legacy_stream"])
        except RuntimeError as inner:
            raise ValueError("while running the step") from inner
    except ValueError as outer:
        assert classify(outer).cause == "legacy_stream"
    try:
        try:
            raise RuntimeError(CUDA_TEXTS["pageable_copy"])
        except RuntimeError:
            raise KeyError("cleanup failed")       # raised during handling: __context__
    except KeyError as outer:
        assert classify(outer).cause == "pageable_copy"
    chain = [1, 2]
    exc = _raised("a")
    exc.__context__ = exc                           # a cycle ends the walk
    assert exception_chain(exc) == [exc] and chain


def _work_on_a_side_stream(side):
    """Stands for ``y = x * 2`` on a stream the capture does not include: the allocation of
    ``y`` calls cudaMalloc outside the capture, refused with the host-sync error text
    (measured on torch 2.11 inside graph_step)."""
    with torch.cuda.stream(side):
        raise ERROR_TYPE(CUDA_TEXTS["host_sync"])


def test_an_error_inside_a_stream_block_is_work_outside_the_capture():
    try:
        _work_on_a_side_stream(None)
    except ERROR_TYPE as raised:
        exc = raised
    failure = classify(exc)
    assert failure.cause == "outside_pool", failure
    assert "stream of its own" in failure.detail
    message, _ = describe(exc, "train_step")
    assert "with torch.cuda.stream(side)" not in message            # the line that raised
    assert "raise ERROR_TYPE" in message and "wait_stream" in message


def test_cupy_refused_by_the_capture_is_outside_the_pool():
    """CuPy allocating by itself inside the capture (measured: cupy's CUDARuntimeError
    "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")."""
    CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,),
                            {"__module__": "cupy_backends.cuda.api.runtime"})
    failure = classify(_raised("cudaErrorStreamCaptureUnsupported: operation not permitted "
                               "when stream is capturing", CUDARuntimeError))
    assert failure.cause == "outside_pool" and "CuPy" in failure.detail


def test_graphstash_refusals_keep_their_own_message():
    exc = _raised("stash_activations: no stash buffer holds bfloat16[512] rows yet and a CUDA "
                  "graph is capturing; run an eager warmup step", CaptureError)
    failure = classify(exc)
    assert failure.cause == "graphstash" and failure.hint == ""
    message, cause = describe(exc, "train_step")
    assert cause == "graphstash" and "no stash buffer holds" in message
    assert ".item()" not in message                 # not called a host sync


def test_anything_else_is_other():
    failure = classify(_raised("boom", ValueError))
    assert failure.cause == "other" and failure.error == "ValueError: boom"


def test_message_names_the_line_the_cause_and_what_to_do():
    def train_step():
        raise RuntimeError(CUDA_TEXTS["legacy_stream"])

    try:
        train_step()
    except RuntimeError as raised:
        exc = raised
    message, cause = describe(exc, "train_step")
    error = capture_errors.capture_error(exc, "train_step")
    assert cause == "legacy_stream" and error.cause == "legacy_stream"
    assert isinstance(error, CaptureError) and str(error) == message
    assert message.startswith("capturing train_step failed at ")
    assert "test_capture_errors.py" in message and "raise RuntimeError" in message
    assert "legacy default stream" in message and "torch.cuda.current_stream()" in message
    assert "\n" not in message.split(". ", 1)[0]
    eager_message, _ = describe(exc, "train_step", eager=True)
    assert eager_message.startswith("train_step would fail to capture on a CUDA device")


def test_capture_error_cause_defaults_to_none():
    assert CaptureError("x").cause is None and CaptureError("x", cause="compile").cause == \
        "compile"
