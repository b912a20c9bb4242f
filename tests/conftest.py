"""Shared test set-up: GPU tests skip, with the reason, where CUDA or CuPy is missing."""
from __future__ import annotations

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch sees none"
    from graphstash import _kernels

    ok, why = _kernels.availability()
    return None if ok else f"needs the CuPy kernels: {why}"


def pytest_configure(config):
    """With ``GS_SPREAD_GPUS=N`` (scripts/gpu_suite.sh), each pytest-xdist worker sees one of
    N GPUs (``_spread.spread_gpu``), set before anything in it starts CUDA; the multi-GPU
    tests then skip, and run in a pass of their own with every GPU visible."""
    import os

    text = os.environ.get("GS_SPREAD_GPUS", "").strip()
    if not text:
        return
    from _spread import spread_gpu

    try:
        gpus = int(text)
    except ValueError:
        raise pytest.UsageError(f"GS_SPREAD_GPUS: expected an int, got {text!r}") from None
    try:
        mine = spread_gpu(os.environ.get("PYTEST_XDIST_WORKER", ""), gpus,
                          os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if mine is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = mine


def pytest_collection_modifyitems(config, items):
    """GPU tests skip where there is no GPU; with ``GS_SHARD=k/n`` (scripts/gpu_suite.sh) only
    the k-th of n disjoint parts of the collected tests runs (``_spread.in_shard``), so a
    suite longer than one run's time limit runs in n."""
    import os

    text = os.environ.get("GS_SHARD", "").strip()
    if text:
        from _spread import in_shard, parse_shard

        try:
            k, n = parse_shard(text)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        gone = [item for item in items if not in_shard(item.nodeid, k, n)]
        if gone:
            config.hook.pytest_deselected(items=gone)
            items[:] = [item for item in items if in_shard(item.nodeid, k, n)]
    reason = _gpu_skip_reason()
    multi = torch.cuda.device_count() >= 2
    for item in items:
        if reason is not None and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=reason))
        elif "multigpu" in item.keywords and not multi:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture(autouse=True)
def _fresh_compile_counters():
    """Each test starts as in a process where torch.compile has not traced a frame yet
    (dynamo's frame counters cleared): graph_step runs a new call signature eagerly before
    capturing it only once compiled code is in use (NOTE [compile and capture], point 2), so a
    compile by an earlier test in the same worker would otherwise change what a test counts."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        utils.counters["frames"].clear()
    yield


@pytest.fixture
def gen():
    """A fresh, seeded-per-test torch.Generator (CPU), so failures can be replayed."""
    import os
    import zlib

    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def pytest_runtest_logreport(report):
    """With ``GS_FAILURE_LOG=path``, append each failure's id and traceback to ``path`` as it
    happens, so a run that is stopped by a time limit (or a worker that dies) still leaves
    them; pytest itself prints them only at the end."""
    import os

    path = os.environ.get("GS_FAILURE_LOG")
    if path and report.failed and getattr(report, "node", None) is None:  # not xdist's copy
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
