"""Kernel-time profile of a transformers MoE training step, per run of ``graphstash bench hf``.

For each run named (as ``bench hf --runs`` names them), builds the preset's model the way the
bench does, trains ``--warmup`` steps (graph_step's warmup and capture, or torch's own CUDA
graphs, included), then profiles ``--steps`` steps with torch.profiler and prints the CUDA
time per step by category (attention, expert kernels, other GEMMs, loss, optimizer, the
rest) and the top kernels by time.

    python benchmarks/probes/hf_profile.py --preset gpt-oss-20b
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import graphstash  # noqa: E402
import graphstash.integrations.transformers as gst  # noqa: E402
from graphstash.tools.bench import hf  # noqa: E402
from graphstash.tools.bench.timing import eager_training_step  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import hf_no_experts  # noqa: E402

CATEGORIES = (   # first match wins, on the lower-cased kernel name
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp")),
    ("attention", ("softmax", "flash", "fmha", "attention", "sdpa")),
    ("experts", ("gs_", "grouped", "moe", "expert", "gemm_grouped", "ptr_array")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "matmul", "wgmma")),
    ("triton", ("triton",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_run(c, name: str, device, steps: int, warmup: int, top: int) -> None:
    spec = hf.RUNS[name]
    torch._dynamo.reset()
    if spec.experts == gst.IMPLEMENTATION:
        gst.register()
    model = hf.build(c, spec.experts, device)
    if spec.experts == gst.IMPLEMENTATION:
        gst.configure(model)
    opt = torch.optim.AdamW(model.parameters(), lr=hf.LR, fused=True, capturable=spec.graphed)
    kwargs = hf.compile_arguments(spec.compile, None)
    runs = model if kwargs is None else torch.compile(model, **kwargs)
    fb = hf.lm_forward_backward(runs, spec.compile == "reduce-overhead")
    if spec.graphed:
        step = graphstash.graph_step(fb, optimizer=opt, warmup=hf.WARMUP, device=device)
    else:
        step = eager_training_step(fb, opt)
    data = hf.batches(c, device)
    for i in range(warmup):
        step(data[i % len(data)])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(data[(warmup + i) % len(data)])
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / steps / 1e3          # ms per step
    by_cat = collections.Counter()
    for k, ms in per_kernel.items():
        by_cat[category(k)] += ms
    total = sum(per_kernel.values())
    print(f"\n== {name}: {total:.2f} ms of kernels per step, peak "
          f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    for cat, ms in by_cat.most_common():
        print(f"  {cat:<10} {ms:8.2f} ms  {100 * ms / total:5.1f} %")
    print(f"  top {top} kernels (ms per step):")
    for k, ms in per_kernel.most_common(top):
        print(f"    {ms:7.2f}  {category(k):<9} {k[:110]}")
    if spec.graphed:
        step.release()
    del model, opt, step, runs, fb
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-oss-20b", choices=sorted(hf.CONFIGS))
    parser.add_argument("--runs", default="HF grouped_mm + compile (reduce-overhead),"
                        "graphstash + compile + graph_step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device("cuda")
    graphstash.warmup(device)
    c = hf.CONFIGS[args.preset]
    hf_no_experts.register()         # its runs may be named too
    print(f"{args.preset}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for name in args.runs.split(","):
        profile_run(c, name.strip(), device, args.steps, args.warmup, args.top)


if __name__ == "__main__":
    main()
