"""``graphstash demo``: train the reference MoE model for a few steps and report what it cost;
with ``--mode paging``, exercise a bare paged stash buffer.

On a GPU the step is a :func:`graphstash.graph_step` (eager warmup, one capture, replays)
over a static-budget dispatch with the experts' activations stashed (bf16, CuPy kernels).
Without a GPU the same code runs eagerly on the CPU with the reference backend and a small
configuration (float32), and says so. Modes: ``stash``, ``budget`` (graph, no stash),
``dropless`` (a plain eager loop, buffers sized from the real counts), ``all`` (the default:
the three, one after the other, from the same initialisation and batches) and ``paging``.

Each training mode prints its progress, and a closing table gives per mode: the step time
(steady state: after warmup and capture), the peak memory (CUDA only), the stash pages at
their peak (device tier) and spilled (pinned-host tier), and the steps that overflowed, went
over the dispatch budget, or were rerun dropless. The model, optimizer, batches and step are
those of :mod:`graphstash.tools.training`.

The paging demo: each simulated layer computes into a static ``[budget, hidden]`` buffer of
which only ``num_tokens`` rows (a device scalar, different every step) are live, as a dropless
MoE expert does under a CUDA graph. It stashes every layer's live rows after its "forward",
frees the static buffer, reloads in backward order (and, every other step, in a shuffled
order, as a pipeline schedule would), checks each reloaded row byte for byte, and prints what
it held and what it saved.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .. import runtime
from ..models import MoEConfig
from ..paging import PagedStashBuffer
from ..tables import Column, Table
from . import options, progress, training

TRAINING_MODES = ("stash", "budget", "dropless", "all")
MODES = TRAINING_MODES + ("paging",)
SIZE_NAMES = ("auto", "tiny", "small", "medium", "large")

# Per size: the model and the tokens of one step. "auto" is "medium" on a GPU, "tiny" on a CPU.
# Budgets leave room for routing skew (1.5-2x the average rows), so the stash has dead rows to
# free and its plan stashes (NOTE [stash plan] in graphstash/stash/plan.py).
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
LR = 3e-3
DISTINCT_BATCHES = 8            # a few distinct batches, cycled


def add_arguments(p) -> None:
    """The demo's flags on its ``argparse`` parser (checked by :func:`main`)."""
    p.add_argument("--mode", default="all", choices=MODES,
                   help="all (eager dropless, graph + budget, graph + budget + stash; default), "
                   "one of them, or paging (the bare paged stash buffer demo)")
    p.add_argument("--size", default="auto", choices=SIZE_NAMES,
                   help="model size (default: medium on a GPU, tiny on the CPU)")
    p.add_argument("--steps", type=int, default=20,
                   help="training steps per mode, at least 2 (default 20)")
    p.add_argument("--device", default="auto",
                   help=f"{', '.join(options.DEVICES)} (default auto: the GPU if torch sees one)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden width, a multiple of {options.HIDDEN_MULTIPLE} (default: by "
                   "size; for paging, the row width)")
    p.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    """``graphstash demo`` with parsed ``args``; flags are checked before anything runs."""
    if args.mode == "paging":
        result = run_paging(device=args.device, steps=args.steps, hidden=args.hidden,
                            seed=args.seed)
        return 0 if result["ok"] else 1
    run(device=args.device, steps=args.steps, size=args.size, mode=args.mode,
        seed=args.seed, hidden=args.hidden)
    return 0


def _config(size: str, on_gpu: bool, hidden: int | None) -> MoEConfig:
    if size == "auto":
        size = "medium" if on_gpu else "tiny"
    config = dataclasses.replace(SIZES[size])
    if hidden is not None:
        config = dataclasses.replace(config, hidden=hidden, ffn=2 * hidden)
    return config


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
    from ..stash import StashConfig

    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    graphed = mode != "dropless"
    # A small pinned-host tier beside a device tier sized from the warmup's demand.
    stash = StashConfig(device_factor=1.1, host_factor=0.25) if mode == "stash" else None
    run_ = training.build(config, mode, dev, dtype, graphed=graphed, seed=seed, lr=LR,
                          stash=stash)
    train_step = run_.graph
    every = max(1, steps // 5)
    timed_from = min(training.WARMUP + 1, steps - 1) if graphed else min(1, steps - 1)
    losses, timed_s = [], 0.0
    bar = progress.bar(steps, f"  {mode}")
    for i in range(steps):
        shown = i % every == 0 or i == steps - 1
        before = train_step.stats if graphed and shown else None
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = run_.step(x, y)
        _sync(dev)
        if i >= timed_from:                  # steady state: after warmup and capture
            timed_s += time.perf_counter() - t0
        losses.append(loss)
        if shown:
            after = train_step.stats if graphed else None
            progress.write(f"  step {i + 1}/{steps}  loss {float(loss):.4f}  "
                           f"{_what_ran(before, after, on_gpu)}")
        bar.update()
    bar.close()
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
                      reruns=st.reruns, replays=st.replays, spill_steps=st.host_spills,
                      pages=_stash_pages(run_.stash_manager))
    run_.release()
    return result


def _label(mode: str, on_gpu: bool) -> str:
    """The mode's name in the output: on the CPU graph_step runs eagerly, so no "graph"."""
    return _LABELS[mode] if on_gpu else _LABELS[mode].replace("graph", "eager")


def _what_ran(before, after, on_gpu: bool) -> str:
    if after is None:
        return "eager"
    if after.eager_reruns > before.eager_reruns:
        return "over budget or overflow: rerun eagerly, dropless"
    if after.capture_reruns > before.capture_reruns:     # NOTE [rerun by capture]
        return ("stash overflow: captured again with a grown stash, replayed" if on_gpu
                else "stash overflow: run again with a grown stash")
    if after.captures > before.captures:
        return "captured and replayed"
    if after.replays > before.replays:
        return "replayed"
    return "eager (warmup)" if on_gpu else "eager"


_COLUMNS = (Column("mode"), Column("step ms", ".2f"), Column("peak MiB", ".1f", align="right"),
            Column("pages peak/pool", align="right"), Column("spilled", align="right"),
            Column("overflows"), Column("over budget"), Column("reruns"))


def _print_table(results: dict, on_gpu: bool) -> None:
    rows = []
    for mode, r in results.items():
        used, spilled, pool = r["pages"]
        rows.append([_label(mode, on_gpu), r["step_ms"], r["peak_mib"],
                     f"{used}/{pool}" if mode == "stash" else None,
                     spilled if mode == "stash" else None, r["overflows"], r["over_budget"],
                     r["reruns"]])
    print()
    print(Table(_COLUMNS).render(rows))
    if not on_gpu:
        print("peak memory is measured on CUDA devices only")


def _checked(device: str, steps: int, hidden, size: str = "auto", mode: str = "all"):
    """The demo's flags checked (FlagError naming the flag) before anything runs."""
    if mode not in MODES:
        raise options.FlagError(f"--mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if size not in SIZE_NAMES:
        raise options.FlagError(f"--size: expected one of {', '.join(SIZE_NAMES)}, "
                                f"got {size!r}")
    dev = options.device("--device", device)
    options.positive_int("--steps", steps, minimum=2)
    options.hidden_width("--hidden", hidden)
    return dev


def run(device: str = "auto", steps: int = 20, size: str = "auto", mode: str = "all",
        seed: int = 0, hidden: int | None = None) -> dict:
    """Train the reference MoE model ``steps`` steps per mode; returns ``{mode: numbers}``.

    Args:
        device: ``"auto"`` (the GPU if torch sees one), ``"cuda"`` or ``"cpu"``.
        steps: training steps per mode, at least 2 (on a GPU, the first ``2`` are eager
            warmup and the third is captured).
        size: ``"auto"``, ``"tiny"``, ``"small"``, ``"medium"`` or ``"large"`` (:data:`SIZES`).
        mode: ``"all"`` (dropless, budget, stash), ``"stash"``, ``"budget"`` or ``"dropless"``.
        seed: initialisation and data seed (every mode starts from the same model).
        hidden: overrides the size's hidden width (ffn = 2 x hidden), a multiple of 8.

    A bad value raises :class:`graphstash.tools.options.FlagError` naming the flag, before
    anything runs. Example::

        results = run(device="cpu", steps=4)
        results["stash"]["losses"]        # close to results["dropless"]["losses"]
    """
    if mode == "paging":
        raise options.FlagError("--mode: expected a training mode here, got 'paging' "
                                "(run_paging runs it)")
    dev = _checked(device, steps, hidden, size, mode)
    on_gpu = dev.type == "cuda"
    config = _config(size, on_gpu, hidden)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    backend, why = runtime.backend_for(dev)
    if not on_gpu:
        options.note("demo", "no CUDA GPU in use, so the step runs eagerly on the CPU (no CUDA "
                     "graph) with the reference backend and a small configuration")
    print(f"device {dev}, {str(dtype).replace('torch.', '')}, backend {backend} ({why})")
    print(f"MoE: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}, "
          f"{config.num_experts} experts top-{config.topk}, {config.num_tokens} tokens/step, "
          f"capacity factor {config.capacity_factor}")
    batches = training.batches(config, min(steps, DISTINCT_BATCHES), seed=seed, device=dev,
                               dtype=dtype)
    modes = ["dropless", "budget", "stash"] if mode == "all" else [mode]
    results = {}
    with training.quiet_cpu_graph_step(on_gpu):
        for m in modes:
            print(f"\n{_label(m, on_gpu)}:")
            results[m] = _train(m, config, dev, dtype, batches, steps, seed)
    _print_table(results, on_gpu)
    if mode != "all":
        print("(--mode all compares with eager dropless and with the graph without stashing)")
    return results


def run_paging(device: str = "auto", steps: int = 20, hidden: int | None = None, seed: int = 0,
               layers: int = 8) -> dict:
    """Stash and reload the live rows of ``layers`` static buffers per step, checking them.

    Returns ``{"ok", "rows_checked", "spilled_steps", "overflow_steps", "peak_pages"}``;
    ``ok`` is False if a reloaded row differed. Flags are checked as :func:`run` does.
    """
    dev = _checked(device, steps, hidden, mode="paging")
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
        options.note("demo", "no CUDA GPU in use, running a small configuration on the CPU "
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
                return {"ok": False, "rows_checked": checked, "spilled_steps": spilled_steps,
                        "overflow_steps": overflow_steps, "peak_pages": peak_pages}
            checked += n
        status = buf.read_status()
        peak_pages = max(peak_pages, status["peak_pages"] + status["peak_host_pages"])
        spilled_steps += status["host_spill"]
        overflow_steps += status["overflow"]
    elapsed = time.perf_counter() - t0

    static_bytes = layers * budget * row_bytes
    pool_bytes = buf.num_device_pages * buf.page_bytes
    print()
    print(Table([Column("paging demo"), Column("")]).render([
        ["steps", steps], ["rows checked byte for byte", checked],
        ["steps that spilled to host", spilled_steps], ["steps that overflowed", overflow_steps],
        ["peak pages in use", peak_pages],
        ["static buffers kept (MiB)", f"{static_bytes / 2**20:.1f}  (without stashing)"],
        ["device pool (MiB)", f"{pool_bytes / 2**20:.1f}  (with stashing)"],
        ["time per step (ms)", f"{elapsed / steps * 1e3:.1f}"]]))
    if overflow_steps:
        print("some steps overflowed: their handles stored nothing (the flag said so) and their "
              "rows were not checked")
    return {"ok": True, "rows_checked": checked, "spilled_steps": spilled_steps,
            "overflow_steps": overflow_steps, "peak_pages": peak_pages}
