"""Stash sizes no GPU could hold, and a backend that cannot run, are refused when the config
or the buffer is made (NOTE [config bounds] in ``graphstash/stash/config.py``), with the
argument, the range expected and the value; not by the allocator at the first sized step."""
from __future__ import annotations

import pytest
import torch

from graphstash import BackendUnavailableError, PagedStashBuffer
from graphstash import _kernels
from graphstash.paging import MAX_PAGE_SIZE, MAX_PAGES
from graphstash.stash import StashConfig, StashManager, stash_activations

CUPY_OK, CUPY_WHY = _kernels.availability()


@pytest.mark.parametrize("page_size", [10**12, MAX_PAGE_SIZE + 1])
def test_page_size_past_what_the_kernels_address(page_size):
    with pytest.raises(ValueError, match=rf"page_size: expected an int in \[1, {MAX_PAGE_SIZE}\]"
                                         rf".*got {page_size}"):
        StashConfig(page_size=page_size)
    assert StashConfig(page_size=MAX_PAGE_SIZE).page_size == MAX_PAGE_SIZE


@pytest.mark.parametrize("field", ["device_factor", "host_factor"])
@pytest.mark.parametrize("value", [1e300, float("inf"), float("nan"), -0.5, MAX_PAGES * 2.0])
def test_tier_factor_past_any_pool(field, value):
    with pytest.raises(ValueError, match=rf"{field}: expected a finite float in \[0, {MAX_PAGES}\]"):
        StashConfig(**{field: value})


def test_largest_factor_is_accepted_and_checked_again_when_sized(gen):
    """A factor inside the bound that, times the measured demand, needs more pages than
    32-bit ids address is refused when the pool is sized, naming the factor."""
    config = StashConfig(device_factor=float(MAX_PAGES), min_tensor_bytes=0, page_size=4,
                         policy="always")
    manager = StashManager(config, device="cpu")
    x = torch.randn(64, 8, generator=gen, requires_grad=True)
    n = torch.tensor([40], dtype=torch.int32)          # 10 pages of 4 rows: a measured demand
    manager.begin_step()
    with manager, stash_activations(n, name="layer0"):
        y = (x * 2).exp()
    with manager, stash_activations(n, name="layer1"):
        z = (y * 3).exp()
    z.sum().backward()
    manager.end_step()
    assert manager.read_status()["demand"]              # the warmup step measured pages
    with pytest.raises(ValueError, match=r"device_factor: .* pages; expected at most"):
        manager.begin_step()


def test_initial_tokens_past_the_page_ids():
    with pytest.raises(ValueError, match=r"initial_tokens: expected at most"):
        StashConfig(page_size=1, initial_tokens=MAX_PAGES + 1)


@pytest.mark.skipif(CUPY_OK, reason=f"the CuPy kernels can run here ({CUPY_WHY}): the refusal "
                    "needs a machine without them")
def test_cupy_backend_refused_at_construction_where_it_cannot_run():
    with pytest.raises(BackendUnavailableError, match=r"backend: 'cupy' cannot run here"):
        StashConfig(backend="cupy")
    with pytest.raises(ValueError, match=r"backend: expected one of"):
        StashConfig(backend="triton")


@pytest.mark.gpu
def test_cupy_backend_accepted_where_it_runs_and_refused_for_a_cpu_manager():
    config = StashConfig(backend="cupy")
    assert StashManager(config, device="cuda").config.backend == "cupy"
    with pytest.raises(ValueError, match=r"config: backend='cupy' needs a CUDA device"):
        StashManager(config, device="cpu")


def test_paged_buffer_refuses_the_same_bounds_before_allocating():
    with pytest.raises(ValueError, match=rf"page_size: expected an int in \[1, {MAX_PAGE_SIZE}\]"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", page_size=10**12)
    with pytest.raises(ValueError, match=r"max_tokens: .* pages of 64 rows; expected at most 2147483647"):
        PagedStashBuffer(10**13, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"max_tokens: .* pages of 64 rows; expected at most 2147483647"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", host_tokens=10**13)
    with pytest.raises(ValueError, match=r"record_entries: expected an int in \[1, 2147483647\]"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", record_entries=2**31)


@pytest.mark.gpu
def test_paged_buffer_larger_than_the_device_is_refused():
    total = torch.cuda.get_device_properties(0).total_memory
    rows = total // 4096 + 64
    with pytest.raises(ValueError, match=r"max_tokens: .* GiB in pages; expected at most"):
        PagedStashBuffer(rows, 2048, dtype=torch.bfloat16, device="cuda")
