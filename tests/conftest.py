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


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    multi = torch.cuda.device_count() >= 2
    for item in items:
        if reason is not None and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=reason))
        elif "multigpu" in item.keywords and not multi:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


@pytest.fixture
def gen():
    """A fresh, seeded-per-test torch.Generator (CPU), so failures can be replayed."""
    import os
    import zlib

    seed = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode())
    g = torch.Generator()
    g.manual_seed(seed)
    return g
