"""``graphstash demo``: train the reference MoE model (:mod:`graphstash.models.moe_demo`), or, with
``--mode paging``, exercise a bare paged stash buffer.

The paging demo: each simulated layer computes into a static ``[budget, hidden]`` buffer of
which only ``num_tokens`` rows (a device scalar, different every step) are live, as a dropless MoE
expert does under a CUDA graph. The demo stashes every layer's live rows after its
"forward", frees the static buffer, reloads in backward order (and, every other step, in a
shuffled order, as a pipeline schedule would), checks each reloaded row byte for byte, and
prints what it held and what it saved.
"""
from __future__ import annotations

import time

import torch

from . import demo as _moe_demo
from ..paging import PagedStashBuffer

MODES = _moe_demo.MODES + ("paging",)


def run(device: str = "auto", steps: int = 20, hidden: int | None = None, seed: int = 0,
        size: str = "auto", mode: str = "all") -> int:
    """Run the demo ``mode`` (see :data:`MODES`); returns the process exit status."""
    if mode == "paging":
        return run_paging(device=device, steps=steps, hidden=hidden, seed=seed)
    _moe_demo.run(device=device, steps=steps, size=size, mode=mode, seed=seed, hidden=hidden)
    return 0


def run_paging(device: str = "auto", steps: int = 20, hidden: int | None = None, seed: int = 0,
               layers: int = 8) -> int:
    """Stash and reload the live rows of ``layers`` static buffers per step, checking them."""
    dev = _moe_demo._pick_device(device)
    on_gpu = dev.type == "cuda"
    hidden = hidden or (4096 if on_gpu else 256)
    budget = 8192 if on_gpu else 512          # rows of each static buffer (2x the average)
    average = budget // 2
    dtype = torch.bfloat16
    page_size = 64
    # Device tier for 1.1x the average demand of all layers; a small pinned-host tier beside it.
    buf = PagedStashBuffer(int(1.1 * layers * average), hidden, dtype=dtype, device=dev,
                           page_size=page_size, host_tokens=layers * average // 4)
    if not on_gpu:
        print("graphstash demo: no CUDA GPU here, running a small configuration on the CPU "
              "with the reference backend")
    print(f"device {dev}, backend {buf.backend} ({buf.backend_reason})")
    print(f"{layers} layers x static buffer [{budget}, {hidden}] {dtype}; "
          f"pool: {buf.num_device_pages} device + {buf.num_host_pages} host pages of {page_size} rows")

    gen = torch.Generator(device="cpu").manual_seed(seed)
    row_bytes = hidden * 2
    checked = spilled_steps = overflow_steps = 0
    peak_pages = 0
    t0 = time.perf_counter()
    for step in range(steps):
        buf.reset()
        counts = torch.randint(average // 2, int(average * 1.6), (layers,), generator=gen)
        handles, expected = [], []
        for layer in range(layers):
            # Row i of layer l holds values derived from (step, layer, i): misplaced rows show.
            rows = torch.arange(budget, dtype=torch.float32).unsqueeze(1)
            cols = torch.arange(hidden, dtype=torch.float32).unsqueeze(0)
            static = ((rows * 7 + cols * 3 + layer * 11 + step) % 251).to(dtype).to(dev)
            n = counts[layer:layer + 1].to(torch.int32).to(dev)
            handles.append(buf.stash(static, n))
            expected.append(static[: int(counts[layer])].cpu())
            del static                                       # the oversized buffer is freed
        # A step whose pool overflowed is untrusted: its stashes stored nothing (the flag says
        # so), so its reloads are made but not checked.
        trusted = not buf.read_status()["overflow"]
        order = list(reversed(range(layers)))
        if step % 2:
            order = torch.randperm(layers, generator=gen).tolist()
        for layer in order:
            out = buf.reload(handles[layer], zero_tail=True)
            n = int(counts[layer])
            if not trusted:
                continue
            if not torch.equal(out[:n].cpu(), expected[layer]) or out[n:].abs().sum() != 0:
                print(f"step {step} layer {layer}: reloaded rows differ")
                return 1
            checked += n
        status = buf.read_status()
        peak_pages = max(peak_pages, status["peak_pages"] + status["peak_host_pages"])
        spilled_steps += status["host_spill"]
        overflow_steps += status["overflow"]
    elapsed = time.perf_counter() - t0

    static_bytes = layers * budget * row_bytes
    pool_bytes = buf.num_device_pages * buf.page_bytes
    print()
    print(f"{'steps':<28}{steps}")
    print(f"{'rows checked byte for byte':<28}{checked}")
    print(f"{'steps that spilled to host':<28}{spilled_steps}")
    print(f"{'steps that overflowed':<28}{overflow_steps}")
    print(f"{'peak pages in use':<28}{peak_pages}")
    print(f"{'static buffers kept (MiB)':<28}{static_bytes / 2**20:.1f}  (without stashing)")
    print(f"{'device pool (MiB)':<28}{pool_bytes / 2**20:.1f}  (with stashing)")
    print(f"{'time per step (ms)':<28}{elapsed / steps * 1e3:.1f}")
    if overflow_steps:
        print("some steps overflowed: their handles stored nothing (the flag said so) and their "
              "rows were not checked")
    return 0
