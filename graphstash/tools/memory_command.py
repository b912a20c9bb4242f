"""``graphstash memory``: where the memory of one training step of the reference MoE model is.

Builds :class:`graphstash.models.MoEModel` (a preset of :data:`graphstash.models.PRESETS` or
the default sizes, with any width overridden) and AdamW, and the step as ``graphstash bench
moe`` does: a plain eager loop in ``--mode dropless``, :func:`graphstash.graph_step` in the
budget and stash modes (with ``stash=`` in the latter, whose plan is printed). After the
warmup steps it records with :func:`graphstash.memory.profile` and prints the peak, the owner
totals and the blocks alive at the peak; ``--plot FILE`` writes the timeline. On a GPU the
graphed modes record the call that captures the step into a CUDA graph and the next call (a
replay). On the CPU the model is reduced (:data:`CPU_LIMITS`) and runs eagerly in float32
with the reference backend, and the command says so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from ..memory import profile
from ..models import PRESETS, MoEConfig, MoEModel, preset

MODES = ("dropless", "budget", "stash")
# On the CPU every size is capped (a reduced run of the same structure). On a GPU the
# presets' depth is cut to GPU_LAYERS unless --layers says otherwise: 48 Qwen3-30B-A3B or 32
# Mixtral layers with bf16 AdamW state do not fit one GPU.
CPU_LIMITS = {"hidden": 64, "ffn": 128, "num_experts": 8, "topk": 2, "layers": 2,
              "num_tokens": 256}
GPU_LAYERS = 4
# flag -> MoEConfig field
_FLAGS = {"hidden": "hidden", "ffn": "ffn", "experts": "num_experts", "topk": "topk",
          "layers": "layers", "tokens": "num_tokens", "capacity_factor": "capacity_factor"}
WARMUP = 2            # eager steps before the recorded one (graph_step's warmup)


def add_arguments(p) -> None:
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="layer widths of a real model (default: graphstash.models.MoEConfig())")
    p.add_argument("--mode", default="stash", choices=MODES,
                   help="dropless (eager, host-sized buffers), budget (static budget, a CUDA "
                   "graph on a GPU) or stash (budget + stashed activations; default)")
    for flag, kind in (("hidden", int), ("ffn", int), ("experts", int), ("topk", int),
                       ("layers", int), ("tokens", int), ("capacity-factor", float)):
        p.add_argument(f"--{flag}", type=kind, default=None, help=f"override the {flag}")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="write the memory timeline to FILE (PNG, PDF or SVG; matplotlib)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (the GPU if torch sees one; default), cpu or cuda")
    p.add_argument("--top", type=int, default=12, help="rows listed per owner (default 12)")


def _config(args, on_gpu: bool) -> tuple[MoEConfig, list]:
    """The model's sizes and the lines that say how they were chosen."""
    notes = []
    config = preset(args.preset) if args.preset else MoEConfig()
    overrides = {field: getattr(args, flag) for flag, field in _FLAGS.items()
                 if getattr(args, flag) is not None}
    for flag, field in _FLAGS.items():
        value = overrides.get(field)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: expected a positive number, "
                             f"got {value}")
    if not on_gpu:
        capped = {k: min(getattr(config, k), v) for k, v in CPU_LIMITS.items()}
        if any(capped[k] != getattr(config, k) for k in capped):
            notes.append("on the CPU the model is reduced to " + ", ".join(
                f"{k}={v}" for k, v in capped.items()) + " (flags given override these)")
        config = dataclasses.replace(config, **capped)
    elif args.preset and "layers" not in overrides:
        notes.append(f"{GPU_LAYERS} of the preset's {config.layers} layers (--layers to change)")
        config = dataclasses.replace(config, layers=GPU_LAYERS)
    config = dataclasses.replace(config, **overrides)
    if config.topk > config.num_experts:
        raise ValueError(f"--topk: expected at most --experts={config.num_experts}, "
                         f"got {config.topk}")
    return config, notes


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: expected a device torch can use, got cuda but torch sees "
                         "no CUDA GPU")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _stash_config(mode: str, dev: torch.device):
    """The stash configuration ``graphstash bench moe`` runs (None without stashing)."""
    if mode != "stash":
        return None
    from ..stash import StashConfig

    if dev.type == "cuda":
        from .bench.moe import stash_config

        return stash_config(dev)
    # The reduced model's saved tensors are small: let all of them be candidates.
    return StashConfig(host_tier=False, min_tensor_bytes=0)


def _build(mode: str, config: MoEConfig, dev: torch.device, dtype: torch.dtype):
    """Model, optimizer, the step (``step(x)``) and its stash manager, as bench moe builds
    them: ``graph_step`` for the budget and stash modes, a plain eager loop for dropless."""
    from ..graph import graph_step

    on_gpu = dev.type == "cuda"
    model = MoEModel(config, mode=mode, seed=0, device=dev, dtype=dtype)
    graphed = mode != "dropless"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu or None,
                            capturable=on_gpu and graphed)

    def loss_of(x):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss.detach()

    if not graphed:
        def step(x):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x)
            opt.step()
            return loss
        return model, opt, step, None
    step = graph_step(loss_of, optimizer=opt, stash=_stash_config(mode, dev), warmup=WARMUP,
                      device=dev)
    model.status = step.status       # over-budget flags reach the step
    return model, opt, step, step.stash_manager


def _print_plan(manager) -> None:
    """The stash manager's decision per layer group (NOTE [stash plan] in stash/manager.py)."""
    if manager.plan():
        print("\nstash plan (from the warmup measurement):")
        print(manager.plan_table())


@contextlib.contextmanager
def _cpu_graph_step_quiet(on_gpu: bool):
    """Without CUDA, silence graph_step's notes that it runs eagerly and that the (eager,
    hence not capturable) optimizer would be refused on a GPU: the output says it runs
    eagerly on the CPU."""
    with warnings.catch_warnings():
        if not on_gpu:
            warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(",
                                    category=RuntimeWarning)
        yield


def run(args) -> int:
    """Build, warm up and record one step; print the report (and write the plot)."""
    from ..moe import experts as _experts

    if args.top < 1:
        raise ValueError(f"--top: expected a positive int, got {args.top}")
    dev = _device(args.device)
    on_gpu = dev.type == "cuda"
    config, notes = _config(args, on_gpu)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    graphed = on_gpu and args.mode != "dropless"
    if on_gpu:
        # Decide before any capture whether the grouped GEMM may be captured
        # (NOTE [grouped_mm under capture] in graphstash/moe/experts.py).
        _experts._probe(dev, dtype)
    with _cpu_graph_step_quiet(on_gpu):
        model, opt, step, manager = _build(args.mode, config, dev, dtype)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(config.num_tokens, config.hidden, generator=gen).to(dev, dtype)
    print(f"graphstash memory: {args.preset or 'default sizes'}, mode {args.mode}, "
          f"{config.layers} layers, hidden {config.hidden}, ffn {config.ffn}, "
          f"{config.num_experts} experts top-{config.topk}, {config.num_tokens} tokens, "
          f"capacity factor {config.capacity_factor}, {str(dtype).replace('torch.', '')} "
          f"on {dev}")
    for line in notes:
        print(line)
    if graphed:
        print(f"recorded: the CUDA graph capture of the step by graph_step and the next "
              f"call's replay, after {WARMUP} eager warmup steps")
    else:
        where = "eagerly" if on_gpu else "eagerly on the CPU (no CUDA graph), reference backend"
        print(f"recorded: one step {where}, after {WARMUP} warmup steps")
    with _cpu_graph_step_quiet(on_gpu):
        report = profile(step, x, model=model, optimizer=opt, stash_manager=manager,
                         warmup=WARMUP, steps=2 if graphed else 1, device=dev)
    if manager is not None:
        _print_plan(manager)
    print()
    print(report.table(top=args.top))
    if args.plot:
        print(f"wrote {report.plot(args.plot)}")
    if graphed:
        step.release()
    return 0
