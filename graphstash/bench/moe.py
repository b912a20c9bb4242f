"""``graphstash bench moe``: the reference MoE model, step time and peak memory per mode.

Modes, each a full training step (forward, backward, AdamW) of :class:`graphstash.models.MoEModel`:

- ``eager dropless``: eager, buffers sized from the real counts (host reads every layer);
- ``graph + budget``: static-budget dispatch, the whole step captured in one CUDA graph;
- ``graph + budget + stash``: the same with ``stash_activations`` (device tier only);
- ``+ host tier``: a smaller device tier plus a pinned-host tier.

Run on one GPU, or expert-parallel under ``torchrun --nproc-per-node 2 -m graphstash.cli
bench moe`` (WORLD_SIZE is detected; rank 0 prints). Peak memory is
``torch.cuda.max_memory_allocated`` over the capture and the timed steps (the eager steps
before them, warmup and stash-pool sizing, are left out: NOTE [steady-state peak]), above the
memory allocated before the model was built, so weights, optimizer state, the graph's pool and
the stash pool all count. Step times are the mean of ``steps`` steps run one mode after the
other; the two graphed budget modes are also timed in alternating rounds (both graphs alive),
and that ratio is the one to quote: drift between the runs then favours neither.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from .. import _layout as L
from ..models import MoEConfig, MoEModel
from ..moe import experts as _experts
from ._timing import capture_with_output, time_calls_interleaved

# NOTE [bench budgets]: every configuration sizes its static buffers at twice the average rows
# a rank receives (capacity_factor=2.0). At EP=2 (chunk_factor=2.0) that is the worst case:
# no routing can go over budget, so graph + budget never reruns and is the fair baseline.
# On one GPU a dropless top-k dispatch always fills T x K rows (plus padding), so there the
# same factor stands for the headroom an expert-parallel run needs, not for a need of its own.
# Launch-bound: small layers, so host launch overhead dominates eager steps. Memory-bound:
# activations dominate memory (32768 tokens, 32 layers: the budget-sized activations autograd
# keeps, x and the pre-activation of the experts, are about three times the weights,
# gradients and AdamW state).
CONFIGS = {
    "launch-bound": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=12,
                              num_tokens=1024, capacity_factor=2.0, pad_multiple=16),
    "memory-bound": MoEConfig(hidden=1024, ffn=2048, num_experts=8, topk=2, layers=32,
                              num_tokens=32768, capacity_factor=2.0, pad_multiple=16),
}
QUICK = {"quick": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=4,
                            num_tokens=1024, capacity_factor=2.0, pad_multiple=16)}
MODES = ("eager dropless", "graph + budget", "graph + budget + stash", "+ host tier")
INTERLEAVED = ("graph + budget", "graph + budget + stash")   # also timed in alternating rounds


def _stash_manager(mode: str, device, status):
    from ..stash import StashConfig, StashManager

    if mode == "graph + budget + stash":
        # Half the multiprocessors for the copies (NOTE [copy blocks] in stash/manager.py):
        # measured faster than all of them beside this model's expert GEMMs.
        # NOTE [bench pool factor]: the pool is 1.05x the demand of the warmup steps, not the
        # default 1.10x: a layer's live rows are T x K plus at most E x (pad_multiple - 1)
        # padding rows on one GPU (0.4 % here), and the sum over 31 stashed layers of an
        # expert-parallel rank's received rows varies by well under 1 % between random
        # routings. A step that outgrows the pool is flagged (the overflow column), never
        # silently wrong.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        config = StashConfig(host_tier=False, copy_blocks=max(1, sms // 2), device_factor=1.05)
    else:
        config = StashConfig(device_factor=0.6, host_factor=0.6, host_tier=True)
    return StashManager(config, device=device, status=status)


def train_step(model, opt, manager, static_x: torch.Tensor):
    """The step every mode times: zero grads, forward over ``static_x`` (``[num_tokens,
    hidden]`` on the model's device and dtype), backward of a mean-square loss, optimizer
    step; with a stash ``manager`` its begin_step()/end_step() go around forward + backward.
    Returns the step function (it returns the detached loss)."""
    def step():
        opt.zero_grad(set_to_none=True)
        if manager is None:
            loss = model(static_x).float().pow(2).mean()
            loss.backward()
        else:
            # begin_step() and end_step() are captured too; end_step() joins the manager's
            # pack/unpack streams back before the capture ends (NOTE [capture] in
            # graphstash/stash/manager.py).
            with manager:
                manager.begin_step()
                loss = model(static_x).float().pow(2).mean()
                loss.backward()
                manager.end_step()
        opt.step()
        return loss.detach()
    return step


def _run_mode(mode: str, config: MoEConfig, group, device, batches, steps: int,
              keep: bool = False) -> dict:
    """Build, warm up (and capture) ``mode``, time ``steps`` steps one after the other and
    measure the peak. ``keep``: the result's ``"step"`` is a callable running one more step
    on a given batch (it keeps the model, optimizer and graph alive) for
    :func:`_time_interleaved`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    status = torch.zeros(L.STATUS_SIZE, dtype=torch.int32, device=device)
    model_mode = {"eager dropless": "dropless", "graph + budget": "budget"}.get(mode, "stash")
    manager = _stash_manager(mode, device, status) if model_mode == "stash" else None
    model = MoEModel(config, mode=model_mode, group=group, stash_manager=manager,
                     status=status, seed=0).to(device=device, dtype=torch.bfloat16)
    graphed = mode != "eager dropless"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphed)
    static_x = batches[0].clone()
    # Decide before any capture whether the experts' grouped GEMM may be captured
    # (NOTE [grouped_mm under capture] in graphstash/moe/experts.py).
    _experts._probe(device, static_x.dtype)

    step = train_step(model, opt, manager, static_x)

    def steady_state():
        # NOTE [steady-state peak]: warmup steps are left out of the peak: the first one runs
        # before the stash pool is sized (it keeps every activation, as without stashing).
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    if graphed:
        graph, _ = capture_with_output(step, warmup=3, before_capture=steady_state)
        run = graph.replay
    else:
        for _ in range(2):
            step()
        steady_state()
        run = step
    torch.cuda.synchronize(device)
    if group is not None:
        torch.distributed.barrier(group)
    t0 = time.perf_counter()
    for i in range(steps):
        static_x.copy_(batches[i % len(batches)])
        run()
    torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - t0) / steps
    # Expert parallel: every figure is the largest over the ranks (flags: any rank's).
    figures = torch.tensor([elapsed * 1e3, (torch.cuda.max_memory_allocated(device) - base) / 2**20,
                            float(status[L.SS_OVER_BUDGET]), float(status[L.SS_OVERFLOW])],
                           dtype=torch.float64, device=device)
    if group is not None:
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX, group=group)
    step_ms, peak_mib, over_budget, overflow = figures.tolist()
    result = {"step_ms": step_ms, "peak_mib": peak_mib, "over_budget": int(over_budget),
              "overflow": int(overflow)}
    if keep:
        keep_alive = (model, opt, manager)

        def one_step(batch, keep_alive=keep_alive):
            static_x.copy_(batch)
            run()
        result["step"] = one_step
    del model, opt, manager
    return result


def _time_interleaved(results: dict, modes: tuple, batches, group, device,
                      repeats: int = 7) -> dict:
    """NOTE [interleaved timing] (graph.py): median ms per step of each of ``modes`` (kept
    alive by ``_run_mode(keep=True)``), sampled in alternating rounds of two steps each, so
    clock or thermal drift favours none of them. Expert parallel: every rank runs the same
    sequence (the graphs hold collectives); the figure is the largest over the ranks."""
    calls = {}
    for mode in modes:
        step = results[mode]["step"]
        counter = iter(range(1 << 30))
        calls[mode] = (lambda step=step, counter=counter:
                       step(batches[next(counter) % len(batches)]))
    if group is not None:
        torch.distributed.barrier(group)
    times = time_calls_interleaved(calls, repeats=repeats, inner=2, warmup=1)
    figures = torch.tensor([times[m] for m in modes], dtype=torch.float64, device=device)
    if group is not None:
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX, group=group)
    return dict(zip(modes, figures.tolist()))


def _print_table(name: str, config: MoEConfig, world: int, results: dict) -> None:
    eager, graph = results["eager dropless"], results["graph + budget"]
    print(f"\nMoE {name}: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}, "
          f"{config.num_experts} experts top-{config.topk}, {config.num_tokens} tokens/rank, "
          f"EP={world}, bf16")
    eager_ok, capture_ok = _experts._probe(torch.device("cuda", torch.cuda.current_device()),
                                           torch.bfloat16)
    print("experts: " + ("torch._grouped_mm, captured" if capture_ok else
                         "torch._grouped_mm eagerly, a masked dense product (num_experts x the "
                         "work) inside graphs" if eager_ok else "a per-expert loop eagerly, a "
                         "masked dense product inside graphs"))
    if world > 1:
        print("figures: the largest over the ranks; flags: set on any rank")
    print(f"{'mode':<24}{'step ms':>9}{'peak MiB':>10}{'mem/eager':>11}{'mem/graph':>11}"
          f"{'time/graph':>11}{'speedup':>9}  flags")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<24}  failed: {r['error']}")
            continue
        print(f"{mode:<24}{r['step_ms']:>9.2f}{r['peak_mib']:>10.1f}"
              f"{r['peak_mib'] / eager['peak_mib']:>11.2f}{r['peak_mib'] / graph['peak_mib']:>11.2f}"
              f"{r['step_ms'] / graph['step_ms']:>11.2f}{eager['step_ms'] / r['step_ms']:>9.2f}"
              f"  over_budget={r['over_budget']} overflow={r['overflow']}")
    if all("step_ms_interleaved" in results[m] for m in INTERLEAVED):
        base, stash = (results[m]["step_ms_interleaved"] for m in INTERLEAVED)
        print(f"alternating rounds (median ms per step): {INTERLEAVED[0]} {base:.2f}, "
              f"{INTERLEAVED[1]} {stash:.2f}: time/graph {stash / base:.3f}")


def run(quick: bool = False) -> dict:
    """Benchmark every mode on every configuration; returns ``{config: {mode: numbers}}``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        group = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device())
    rank = torch.distributed.get_rank() if group is not None else 0
    steps = 5 if quick else 20
    out = {}
    for name, config in (QUICK if quick else CONFIGS).items():
        config = dataclasses.replace(config)
        if world > 1:
            config.chunk_factor = 2.0
        gen = torch.Generator().manual_seed(1234 + rank)
        batches = [torch.randn(config.num_tokens, config.hidden, generator=gen)
                   .to(device=device, dtype=torch.bfloat16) for _ in range(4)]
        results = {}
        for mode in MODES:
            try:
                results[mode] = _run_mode(mode, config, group, device, batches, steps,
                                          keep=mode in INTERLEAVED)
            except ImportError as exc:          # stash module missing
                results[mode] = {"error": str(exc)}
            if mode == INTERLEAVED[-1]:
                if all("step" in results[m] for m in INTERLEAVED):
                    interleaved = _time_interleaved(results, INTERLEAVED, batches, group, device,
                                                    repeats=3 if quick else 7)
                    for m in INTERLEAVED:
                        results[m]["step_ms_interleaved"] = interleaved[m]
                for m in INTERLEAVED:
                    results[m].pop("step", None)      # frees the two graphs before the next mode
        if rank == 0:
            _print_table(name, config, world, results)
        out[name] = results
    return out
