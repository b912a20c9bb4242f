"""``graphstash bench kernels``: stash + reload bandwidth next to torch copying the same bytes.

Device tier: one stash and one reload of ``[rows, hidden]`` with ``live`` of the rows live,
against ``pool[:n].copy_(x[:n]); out[:n].copy_(pool[:n])`` with ``n`` known on the host.
Host tier: the same with every page on the pinned-host tier, against pinned
``copy_(non_blocking=True)`` both ways. Both sides are captured in CUDA graphs (so host launch
overhead is out of the device numbers) and timed with CUDA events in the same run. Bandwidth
counts the bytes read plus written: 4 x live bytes per stash + reload pair.
"""
from __future__ import annotations

import itertools
import time

import torch

from ...paging import PagedStashBuffer
from ...tables import Column
from .. import progress
from ..output import Output
from .spread import spread
from .timing import capture, event_ms, gpu_name, replay_samples

SUMMARY = "stash + reload bandwidth next to torch copying the same bytes"
DESCRIPTION = ("Times one stash and one reload of [rows, hidden] tensors with part of their rows "
               "live, device tier and pinned-host tier, against torch copying the same live "
               "bytes, both captured in CUDA graphs and timed with CUDA events in the same run; "
               "prints the times, the bandwidth and their ratio per shape.")
ITERS = 5   # stash + reload pairs per graph replay
COLUMNS = (Column("tier", width=6), Column("dtype", width=8), Column("hidden", width=6),
           Column("rows", width=6), Column("live", ".1f", width=4),
           Column("live MiB", ".1f", width=8), Column("torch ms", ".3f", width=8),
           Column("graphstash ms", ".3f", width=13), Column("torch GB/s", ".0f", width=10),
           Column("graphstash GB/s", ".0f", width=15), Column("ratio", ".3f", width=5))


def _measure(tier: str, dtype: torch.dtype, hidden: int, rows: int, live: float) -> dict:
    n = max(1, int(rows * live))
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    counts = torch.tensor([n], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    if tier == "device":
        buf = PagedStashBuffer(rows, hidden, dtype=dtype, device="cuda", page_size=64)
        staging = torch.empty(rows * hidden, dtype=dtype, device="cuda")
    else:
        buf = PagedStashBuffer(0, hidden, dtype=dtype, device="cuda", page_size=64,
                               host_tokens=rows)
        staging = torch.empty(rows * hidden, dtype=dtype, pin_memory=True)
    flat_x, flat_out, live_elems = x.view(-1), out.view(-1), n * hidden
    iters = ITERS if tier == "device" else 2

    def ours():
        for _ in range(iters):
            buf.reload(buf.stash(x, counts), out=out)

    def baseline():
        for _ in range(iters):
            staging[:live_elems].copy_(flat_x[:live_elems], non_blocking=True)
            flat_out[:live_elems].copy_(staging[:live_elems], non_blocking=True)

    g_base, g_ours = capture(baseline), capture(ours)
    s_base = spread(t / iters for t in replay_samples(g_base))
    s_ours = spread(t / iters for t in replay_samples(g_ours))
    t_base, t_ours = s_base["median"], s_ours["median"]
    directions = _per_direction(buf, x, counts, out, staging, live_elems) if tier == "host" else {}
    ok = torch.equal(out[:n].view(torch.uint8), x[:n].view(torch.uint8))
    if not ok:
        raise AssertionError(f"reloaded rows differ ({tier}, {dtype}, {hidden}, {rows}, {live})")
    moved = 4 * live_elems * x.element_size()
    del g_base, g_ours
    return {"tier": tier, "dtype": str(dtype).replace("torch.", ""), "hidden": hidden,
            "rows": rows, "live": live, "live_mib": live_elems * x.element_size() / 2**20,
            "torch_ms": t_base, "torch_ms_spread": s_base, "graphstash_ms": t_ours,
            "graphstash_ms_spread": s_ours,
            "torch_gbs": moved / t_base / 1e6, "graphstash_gbs": moved / t_ours / 1e6,
            "ratio": t_base / t_ours, **directions}


def _per_direction(buf, x, counts, out, staging, live_elems) -> dict:
    """Device time of one stash and of one reload, and of torch's pinned copy each way."""
    flat_x, flat_out = x.view(-1), out.view(-1)
    t_stash, t_reload = [], []
    for _ in range(5):   # alternate: the host tier holds one such tensor
        handles = []
        t_stash.append(event_ms(lambda: handles.append(buf.stash(x, counts)), repeats=1))
        t_reload.append(event_ms(lambda: buf.reload(handles.pop(), out=out), repeats=1))
    t_stash, t_reload = sorted(t_stash)[2], sorted(t_reload)[2]
    t_d2h = event_ms(lambda: staging[:live_elems].copy_(flat_x[:live_elems], non_blocking=True))
    t_h2d = event_ms(lambda: flat_out[:live_elems].copy_(staging[:live_elems], non_blocking=True))
    return {"stash_ratio": t_d2h / t_stash, "reload_ratio": t_h2d / t_reload}


def _host_time_per_call(calls: int = 300) -> dict:
    """Host microseconds per eager stash and reload call (small tensor: the GPU keeps up)."""
    buf = PagedStashBuffer(4096, 1024, dtype=torch.bfloat16, device="cuda", page_size=64)
    x = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([1000], dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    for _ in range(10):
        buf.reload(buf.stash(x, counts), out=out)
    torch.cuda.synchronize()
    t_stash = t_reload = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        h = buf.stash(x, counts)
        t1 = time.perf_counter()
        buf.reload(h, out=out)
        t2 = time.perf_counter()
        t_stash += t1 - t0
        t_reload += t2 - t1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        out[:1000].copy_(x[:1000])
    t_copy = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"stash_us": t_stash / calls * 1e6, "reload_us": t_reload / calls * 1e6,
            "torch_copy_us": t_copy / calls * 1e6}


def run(quick: bool = False, args=None, *, out: Output | None = None) -> dict:
    """Measure every shape (the headline cases with ``quick``), each row printed as soon as it
    is measured, a progress bar on stderr; returns ``{"gpu", "results", "host_time"}``."""
    from ... import warmup

    out = Output() if out is None else out
    warmup()
    headline = [("device", torch.bfloat16, 4096, 16384, 0.7), ("host", torch.bfloat16, 4096, 16384, 0.7),
                ("device", torch.bfloat16, 4096, 16384, 0.0)]    # one live row: fixed cost
    configs = list(headline)
    if not quick:
        for dtype, hidden, rows, live in itertools.product(
                (torch.bfloat16, torch.float32), (2048, 4096, 7168), (16384, 65536),
                (0.1, 0.5, 0.7, 1.0)):
            configs.append(("device", dtype, hidden, rows, live))
            if rows == 16384:
                configs.append(("host", dtype, hidden, rows, live))
    from ... import runtime

    dev = torch.device("cuda", torch.cuda.current_device())
    t = runtime.kernel_tunables()
    out.line(f"kernel tunables: threads {t['threads']}, unroll {t['unroll']}, streaming "
             f"{t['streaming']}, min blocks {t['min_blocks']}; persistent grid "
             f"{runtime.resident_blocks(dev, 'paged_stash', 'gs_stash_v16')} blocks (stash), "
             f"{runtime.resident_blocks(dev, 'paged_stash', 'gs_reload_v16')} (reload)")
    out.title(f"stash + reload vs torch copy of the same live bytes on {gpu_name()} "
              f"(ratio = torch time / graphstash time)")
    table = out.table(COLUMNS)
    results = []
    with progress.bar(len(configs), "bench kernels", unit="shape") as bar:
        for cfg in configs:
            r = _measure(*cfg)
            results.append(r)
            torch.cuda.empty_cache()
            table.row([r["tier"], r["dtype"], r["hidden"], r["rows"], r["live"], r["live_mib"],
                       r["torch_ms"], r["graphstash_ms"], r["torch_gbs"], r["graphstash_gbs"],
                       r["ratio"]])
            bar.update()
    host = _host_time_per_call()
    for r in results:
        if "stash_ratio" in r:
            out.note(f"host tier {r['dtype']} {r['hidden']}x{r['rows']} live {r['live']}: "
                     f"stash/D2H ratio {r['stash_ratio']:.3f}, reload/H2D ratio "
                     f"{r['reload_ratio']:.3f}")
    out.note(f"host time per eager call: stash {host['stash_us']:.1f} us, reload "
             f"{host['reload_us']:.1f} us (torch slice copy_: {host['torch_copy_us']:.1f} us)")
    return {"gpu": gpu_name(), "results": results, "host_time": host}
