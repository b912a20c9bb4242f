"""``graphstash bench offload``: step time and peak memory of activation offload and tensor
swap, next to no offload and ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.

The model is a stack of float32 transformer blocks (TF32 off) sized so that a block's
forward + backward takes at least as long as moving its saved activations both ways over
PCIe; the table prints both times so the premise can be checked on the machine at hand.

Memory is reported as in the offload acceptance test: the peak of ``memory_allocated`` above
what was allocated just before the timed steps (garbage collected, peak stats reset), the drop
against no offload, and that drop as a share of the bytes moved, where "moved" counts each
device storage once however many of its views autograd saved (NOTE [one record per storage]).
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from ...offload import ActivationOffloader
from ...swap import TensorSwapper
from ...tables import Column
from .. import progress
from ..output import Output

SUMMARY = ("activation offload and tensor swap next to no offload and torch's save_on_cpu: step "
           "time and peak memory")
DESCRIPTION = ("Runs a stack of float32 transformer blocks four ways (no offload, graphstash "
               "offload, graphstash swap, torch.autograd.graph.save_on_cpu) and prints the step "
               "time, its ratio to no offload, the peak memory, its drop and that drop as a "
               "share of the bytes moved; first the premise: a block's compute against moving "
               "its saved tensors over PCIe.")
COLUMNS = (Column("mode", width=20), Column("step ms", ".2f", width=8),
           Column("x none", ".3f", width=6), Column("peak MiB", ".0f", width=8),
           Column("drop MiB", ".0f", width=8), Column("moved MiB", ".0f", width=9),
           Column("drop/moved", width=10, align="right"))


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, w // self.heads)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _forward(blocks, x, mode, tool):
    h = x * 1.0
    if mode == "graphstash offload":
        with tool:
            for i, blk in enumerate(blocks):
                h = tool.group_start(h, f"block{i}")
                h = tool.group_commit(blk(h))
    elif mode == "graphstash swap":
        for blk in blocks:
            with tool.swap("blocks.*"):
                h = blk(h)
    elif mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            for blk in blocks:
                h = blk(h)
    else:
        for blk in blocks:
            h = blk(h)
    return h.pow(2).mean()


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _premise(block: torch.nn.Module, x: torch.Tensor, iters: int):
    """Milliseconds of one forward-backward of ``block`` on ``x`` (a float32 CUDA tensor), of
    copying its saved tensors' bytes to pinned host memory and back, and those bytes; the
    probe's buffers are freed on return."""
    probe = (x * 1).requires_grad_()
    saved = _saved_bytes(block, probe)

    def block_step():
        block(probe).pow(2).mean().backward()

    block_step()
    compute_ms = _time(block_step, iters)
    host = torch.empty(saved // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(saved // 4, dtype=torch.float32, device="cuda")
    d2h_ms = _time(lambda: host.copy_(dev, non_blocking=True), iters)
    h2d_ms = _time(lambda: dev.copy_(host, non_blocking=True), iters)
    return compute_ms, d2h_ms, h2d_ms, saved


def _saved_bytes(block, x) -> int:
    """Bytes of the distinct device storages ``block``'s forward saves (each storage once, whole;
    parameters and their views left out)."""
    storages = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if t.device.type == "cuda" and not (base.is_leaf and base.requires_grad):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(storages.values())


def run(quick: bool = False, args=None, *, out: Output | None = None) -> dict:
    """Run the offload benchmark on the current CUDA device; print each mode's row as soon as it
    is measured (a progress bar on stderr) and return the numbers. Step times are the mean of
    ``iters`` back-to-back steps between two CUDA events (no median, so no spread).

    Returns ``{"config": {...}, "per_block": {...}, "results": {mode: {"step_ms", "peak_mib",
    "moved_mib", "peak_drop_mib", "drop_of_moved", "time_vs_none"}}}``.

    Example::

        numbers = graphstash.tools.bench.offload.run(quick=True)
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graphstash bench offload needs a CUDA GPU; none is visible")
    out = Output() if out is None else out
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    width, heads, seq, batch, layers = (2048, 16, 1024, 2, 4) if quick else (4096, 32, 2048, 2, 8)
    iters = 3 if quick else 10
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers)).cuda()
    x = torch.randn(batch, seq, width, device="cuda")

    # the premise: one block's compute vs moving its saved tensors over PCIe
    compute_ms, d2h_ms, h2d_ms, saved = _premise(blocks[0], x, iters)
    blocks.zero_grad(set_to_none=True)

    tools = {
        "no offload": None,
        "graphstash offload": ActivationOffloader(min_tensor_bytes=1 << 20, keep_last=1),
        "graphstash swap": TensorSwapper(min_tensor_bytes=1 << 20),
        "save_on_cpu": None,
    }
    out.title(f"offload bench: {layers} blocks, width {width}, seq {seq}, batch {batch}, "
              "float32")
    out.note(f"per block: fwd+bwd {compute_ms:.2f} ms; saved {saved / 2**20:.0f} MiB: "
             f"D2H {d2h_ms:.2f} ms, H2D {h2d_ms:.2f} ms "
             f"(compute/transfer = {compute_ms / max(d2h_ms, h2d_ms):.2f})")
    table = out.table(COLUMNS)
    results = {}
    with progress.bar(len(tools), "bench offload", unit="mode") as bar:
        for mode, tool in tools.items():
            def step():
                _forward(blocks, x, mode, tool).backward()

            for _ in range(2):
                step()                                   # warmup: pools, streams, layer counts
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step_ms = _time(step, iters)
            peak = torch.cuda.max_memory_allocated() - base
            moved = None
            if isinstance(tool, ActivationOffloader):
                moved = tool.summary()["total"]
            elif isinstance(tool, TensorSwapper):
                moved = tool.swapped_bytes("blocks.*")
            r = results[mode] = {"step_ms": step_ms, "peak_mib": peak / 2**20,
                                 "moved_mib": None if moved is None else moved / 2**20}
            blocks.zero_grad(set_to_none=True)
            if tool is not None:
                tool.release()
            ref = results["no offload"]                  # the first mode
            r["time_vs_none"] = r["step_ms"] / ref["step_ms"]
            r["peak_drop_mib"] = ref["peak_mib"] - r["peak_mib"]
            r["drop_of_moved"] = (None if not r["moved_mib"]
                                  else r["peak_drop_mib"] / r["moved_mib"])
            table.row([mode, r["step_ms"], r["time_vs_none"], r["peak_mib"],
                       r["peak_drop_mib"], r["moved_mib"],
                       None if r["drop_of_moved"] is None else f"{r['drop_of_moved']:.1%}"])
            bar.update()
    return {
        "config": {"layers": layers, "width": width, "heads": heads, "seq": seq, "batch": batch,
                   "dtype": "float32", "iters": iters},
        "per_block": {"compute_ms": compute_ms, "saved_mib": saved / 2**20, "d2h_ms": d2h_ms,
                      "h2d_ms": h2d_ms},
        "results": results,
    }


if __name__ == "__main__":  # pragma: no cover
    run()
