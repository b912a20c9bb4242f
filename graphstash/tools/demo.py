"""``graphstash demo``: train the reference MoE model for a few steps and report what it cost.

On a GPU the step is a :func:`graphstash.graph_step` (eager warmup, one capture, replays)
over a static-budget dispatch with the experts' activations stashed (bf16, CuPy kernels).
Without a GPU the same code runs eagerly on the CPU with the reference backend and a small
configuration (float32), and says so. Modes: ``stash``, ``budget`` (graph, no stash),
``dropless`` (a plain eager loop, buffers sized from the real counts) and ``all`` (the
default: the three, one after the other, from the same initialisation and batches).

Each mode prints its progress, and a closing table gives per mode: the step time (steady
state: after warmup and capture), the peak memory (CUDA only), the stash pages at their
peak (device tier) and spilled (pinned-host tier), and the steps that overflowed, went over
the dispatch budget, or were rerun dropless.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings

import torch
from tqdm import tqdm

from .. import _backend
from ..moe import experts as _experts
from ..models import MoEConfig, MoEModel

MODES = ("stash", "budget", "dropless", "all")

# Per size: the model and the tokens of one step. "auto" is "medium" on a GPU, "tiny" on a CPU.
# Budgets leave room for routing skew (1.5-2x the average rows), so the stash has dead rows to
# free and its plan stashes (NOTE [stash plan] in graphstash/stash/manager.py).
SIZES = {
    "tiny": MoEConfig(hidden=64, ffn=128, num_experts=8, topk=2, layers=4, num_tokens=256,
                      capacity_factor=2.0, pad_multiple=8),
    "small": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=4, num_tokens=2048,
                       capacity_factor=2.0, pad_multiple=8),
    "medium": MoEConfig(hidden=1024, ffn=2048, num_experts=8, topk=2, layers=8,
                        num_tokens=8192, capacity_factor=1.5, pad_multiple=16),
    "large": MoEConfig(hidden=2048, ffn=4096, num_experts=16, topk=2, layers=8,
                       num_tokens=16384, capacity_factor=1.5, pad_multiple=16),
}
_LABELS = {"stash": "graph + budget + stash", "budget": "graph + budget",
           "dropless": "eager dropless"}
_WARMUP = 2


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("graphstash demo: --device cuda requested but torch sees no CUDA GPU")
    if dev.type not in ("cuda", "cpu"):
        raise SystemExit(f"graphstash demo: --device must be auto, cuda or cpu, got {device}")
    return dev


def _config(size: str, on_gpu: bool, hidden: int | None) -> MoEConfig:
    if size == "auto":
        size = "medium" if on_gpu else "tiny"
    if size not in SIZES:
        raise SystemExit(f"graphstash demo: --size must be auto or one of {tuple(SIZES)}, "
                         f"got {size}")
    config = dataclasses.replace(SIZES[size])
    if hidden is not None:
        if hidden <= 0 or hidden % 8:
            raise SystemExit(f"graphstash demo: --hidden must be a positive multiple of 8, "
                             f"got {hidden}")
        config.hidden, config.ffn = hidden, 2 * hidden
    return config


def _data(config: MoEConfig, steps: int, seed: int, dev, dtype):
    """``steps`` batches of tokens and their targets: a fixed random map of the tokens,
    RMS-normalised like the model's output (so the loss starts near 2 and falls)."""
    gen = torch.Generator().manual_seed(seed + 1)
    proj = torch.randn(config.hidden, config.hidden, generator=gen) / math.sqrt(config.hidden)
    batches = []
    for _ in range(min(steps, 8)):        # a few distinct batches, cycled
        x = torch.randn(config.num_tokens, config.hidden, generator=gen)
        y = torch.tanh(x @ proj)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        batches.append((x.to(dev, dtype), y.to(dev, torch.float32)))
    return batches


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stash_pages(manager) -> tuple[int, int, int]:
    """(device pages at peak, host pages at peak, device pages in the pool) of every buffer."""
    if manager is None:
        return 0, 0, 0
    buffers = manager.read_status()["buffers"].values()
    return (sum(b["peak_pages"] for b in buffers), sum(b["peak_host_pages"] for b in buffers),
            sum(b["num_device_pages"] for b in buffers))


def _train(mode: str, config: MoEConfig, dev, dtype, batches, steps: int, seed: int) -> dict:
    """Train ``steps`` steps in ``mode``; returns the losses and the numbers of the table."""
    from ..graph import graph_step
    from ..stash import StashConfig

    on_gpu = dev.type == "cuda"
    if on_gpu:
        # Decide, before anything is captured, whether the experts' grouped GEMM can be
        # (NOTE [grouped_mm under capture] in graphstash/moe/experts.py).
        _experts._probe(dev, dtype)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    model = MoEModel(config, mode=mode, seed=seed).to(dev, dtype)
    graphed = mode != "dropless"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=on_gpu or None,
                            capturable=on_gpu and graphed)

    def loss_of(x, y):
        return (model(x).float() - y).pow(2).mean()

    if graphed:
        # A small pinned-host tier beside a device tier sized from the warmup's demand.
        stash = StashConfig(device_factor=1.1, host_factor=0.25) if mode == "stash" else None

        @graph_step(optimizer=opt, stash=stash, warmup=_WARMUP, device=dev)
        def train_step(x, y):
            loss = loss_of(x, y)
            loss.backward()
            return loss

        model.status = train_step.status     # over-budget flags reach the step (and reruns)
        run_step = train_step
    else:
        train_step = None

        def run_step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            opt.step()
            return loss.detach()

    every = max(1, steps // 5)
    timed_from = min(_WARMUP + 1, steps - 1) if graphed else min(1, steps - 1)
    losses, timed_s = [], 0.0
    # A live progress bar on a terminal (tqdm turns itself off when output is not a TTY);
    # the periodic loss lines are printed either way.
    progress = tqdm(range(steps), desc=f"  {mode}", unit="step", leave=False, disable=None)
    for i in progress:
        shown = i % every == 0 or i == steps - 1
        before = train_step.stats if graphed and shown else None
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = run_step(x, y)
        _sync(dev)
        if i >= timed_from:                  # steady state: after warmup and capture
            timed_s += time.perf_counter() - t0
        losses.append(loss)
        if shown:
            after = train_step.stats if graphed else None
            progress.write(f"  step {i + 1:>4}/{steps}  loss {float(loss):.4f}  "
                           f"{_what_ran(before, after, on_gpu)}")
        progress.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
    step_ms = timed_s / (steps - timed_from) * 1e3
    losses = [float(v) for v in losses]
    result = {"losses": losses, "step_ms": step_ms, "peak_mib": None,
              "pages": (0, 0, 0), "overflows": 0, "over_budget": 0, "reruns": 0,
              "replays": 0, "spill_steps": 0}
    if on_gpu:
        result["peak_mib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    if graphed:
        st = train_step.stats
        result.update(overflows=st.overflows, over_budget=st.over_budget,
                      reruns=st.eager_reruns, replays=st.replays, spill_steps=st.host_spills,
                      pages=_stash_pages(train_step.stash_manager))
        train_step.release()
    return result


def _label(mode: str, on_gpu: bool) -> str:
    """The mode's name in the output: on the CPU graph_step runs eagerly, so no "graph"."""
    return _LABELS[mode] if on_gpu else _LABELS[mode].replace("graph", "eager")


def _what_ran(before, after, on_gpu: bool) -> str:
    if after is None:
        return "eager"
    if after.eager_reruns > before.eager_reruns:
        return "over budget or overflow: rerun eagerly, dropless"
    if after.captures > before.captures:
        return "captured and replayed"
    if after.replays > before.replays:
        return "replayed"
    return "eager (warmup)" if on_gpu else "eager"


def _print_table(results: dict, on_gpu: bool) -> None:
    print()
    head = (f"{'mode':<24}{'step ms':>9}{'peak MiB':>10}{'pages peak/pool':>17}"
            f"{'spilled':>9}{'overflows':>11}{'over budget':>13}{'reruns':>8}")
    print(head)
    print("-" * len(head))
    for mode, r in results.items():
        label = _label(mode, on_gpu)
        peak = f"{r['peak_mib']:.1f}" if r["peak_mib"] is not None else "-"
        used, spilled, pool = r["pages"]
        pages = f"{used}/{pool}" if mode == "stash" else "-"
        spill = str(spilled) if mode == "stash" else "-"
        print(f"{label:<24}{r['step_ms']:>9.2f}{peak:>10}{pages:>17}{spill:>9}"
              f"{r['overflows']:>11}{r['over_budget']:>13}{r['reruns']:>8}")
    if not on_gpu:
        print("peak memory is measured on CUDA devices only")


def run(device: str = "auto", steps: int = 20, size: str = "auto", mode: str = "all",
        seed: int = 0, hidden: int | None = None) -> dict:
    """Train the reference MoE model ``steps`` steps per mode; returns ``{mode: numbers}``.

    Args:
        device: ``"auto"`` (the GPU if torch sees one), ``"cuda"`` or ``"cpu"``.
        steps: training steps per mode (on a GPU, the first ``2`` are eager warmup and the
            third is captured).
        size: ``"auto"``, ``"tiny"``, ``"small"``, ``"medium"`` or ``"large"`` (:data:`SIZES`).
        mode: ``"all"`` (dropless, budget, stash), ``"stash"``, ``"budget"`` or ``"dropless"``.
        seed: initialisation and data seed (every mode starts from the same model).
        hidden: overrides the size's hidden width (ffn = 2 x hidden).

    Example::

        results = run(device="cpu", steps=4)
        results["stash"]["losses"]        # close to results["dropless"]["losses"]
    """
    if mode not in MODES:
        raise SystemExit(f"graphstash demo: --mode must be one of {MODES + ('paging',)}, "
                         f"got {mode}")
    if steps < 2:
        raise SystemExit(f"graphstash demo: --steps must be at least 2, got {steps}")
    dev = _pick_device(device)
    on_gpu = dev.type == "cuda"
    config = _config(size, on_gpu, hidden)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    backend, why = _backend.resolve("auto", dev)
    if not on_gpu:
        print("graphstash demo: no CUDA GPU in use, so the step runs eagerly on the CPU (no CUDA "
              "graph) with the reference backend and a small configuration")
    print(f"device {dev}, {str(dtype).replace('torch.', '')}, backend {backend} ({why})")
    print(f"MoE: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}, "
          f"{config.num_experts} experts top-{config.topk}, {config.num_tokens} tokens/step, "
          f"capacity factor {config.capacity_factor}")
    batches = _data(config, steps, seed, dev, dtype)
    modes = ["dropless", "budget", "stash"] if mode == "all" else [mode]
    results = {}
    with warnings.catch_warnings():
        # graph_step warns once per step function that it runs eagerly; said above already.
        warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(.*eagerly",
                                category=RuntimeWarning)
        # the optimizer is capturable on a GPU only (torch's CPU optimizers cannot be)
        warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(.*capturable=False",
                                category=RuntimeWarning)
        for m in modes:
            print(f"\n{_label(m, on_gpu)}:")
            results[m] = _train(m, config, dev, dtype, batches, steps, seed)
    _print_table(results, on_gpu)
    if mode != "all":
        print("(--mode all compares with eager dropless and with the graph without stashing)")
    return results
