"""What the one-GPU MoE bench (``moe.py``) and the expert-parallel one (``moe_ep.py``) share:
the configurations, the shape flags' checks, the stash configuration and the count of the bytes
a rank sends through ``all_to_all_single``. Both import it; neither imports the other's
measuring code (``moe.py`` hands ``--ep`` over to ``moe_ep.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ...models import PRESETS, MoEConfig, parse_routing
from .. import options

# NOTE [bench budgets]: the launch-bound and memory-bound configurations size their static
# buffers at twice the average rows a rank receives (capacity_factor=2.0), the worst case at
# EP=2, so graph + budget never reruns there. The presets take capacity_factor=1.0 on one GPU:
# exactly the T*K dropless rows (a top-k dispatch on one GPU always fills them), so there the
# static budget holds no dead rows; expert-parallel runs pass --capacity-factor.
CONFIGS = {
    "launch-bound": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=12,
                              num_tokens=1024, capacity_factor=2.0, pad_multiple=16),
    "memory-bound": MoEConfig(hidden=1024, ffn=2048, num_experts=8, topk=2, layers=32,
                              num_tokens=32768, capacity_factor=2.0, pad_multiple=16),
}
QUICK = {
    "quick": MoEConfig(hidden=256, ffn=512, num_experts=8, topk=2, layers=4, num_tokens=1024,
                       capacity_factor=2.0, pad_multiple=16),
    "qwen3-30b-a3b (1 layer, 2048 tokens)": dataclasses.replace(
        PRESETS["qwen3-30b-a3b"], layers=1, num_tokens=2048),
}
DTYPE = torch.bfloat16


def replace_checked(config: MoEConfig, **over) -> MoEConfig:
    """``dataclasses.replace``, refusing top-k above the experts by its option (MoEConfig
    would name its field)."""
    topk, experts = over.get("topk", config.topk), over.get("num_experts", config.num_experts)
    if topk > experts:
        raise options.FlagError(f"--topk: expected at most the experts ({experts}), got {topk}")
    return dataclasses.replace(config, **over)


def configs_from_args(args, quick: bool, *, notes: bool = True) -> dict:
    """``{name: MoEConfig}`` of the one-GPU bench from the command line: ``--preset``, a custom
    shape (``--hidden --ffn --experts --topk``), the quick ones (``--quick``) or every preset
    and configuration, with ``--layers --tokens --capacity-factor`` over them. Raises
    :class:`~graphstash.tools.options.FlagError` naming the option for a bad value;
    ``notes``: print the one-line notes on values that are allowed but likely mistakes."""
    over = {"hidden": options.hidden_width("--hidden", getattr(args, "hidden", None)),
            "ffn": options.positive_int("--ffn", getattr(args, "ffn", None)),
            "num_experts": options.positive_int("--experts", getattr(args, "experts", None)),
            "topk": options.positive_int("--topk", getattr(args, "topk", None)),
            "layers": options.positive_int("--layers", getattr(args, "layers", None)),
            "num_tokens": options.positive_int("--tokens", getattr(args, "tokens", None)),
            "capacity_factor": options.capacity_factor(
                "--capacity-factor", getattr(args, "capacity_factor", None),
                command="bench" if notes else None)}
    options.positive_int("--steps", getattr(args, "steps", None))
    over = {k: v for k, v in over.items() if v is not None}
    preset = getattr(args, "preset", None)
    custom = any(k in over for k in ("hidden", "ffn", "num_experts", "topk"))
    if preset is not None:
        out = {preset: replace_checked(PRESETS[preset], **over)}
    elif custom:
        missing = [k for k in ("hidden", "ffn", "num_experts", "topk") if k not in over]
        if missing:
            raise options.FlagError(f"--{missing[0].replace('num_experts', 'experts')}: a custom "
                                    "shape needs --hidden, --ffn, --experts and --topk")
        base = MoEConfig(num_tokens=8192, capacity_factor=1.0,
                         gated=not getattr(args, "plain_experts", False), layers=4)
        out = {"custom": replace_checked(base, **over)}
    else:
        out = dict(QUICK) if quick else {**{n: replace_checked(c, **over)
                                            for n, c in PRESETS.items()}, **CONFIGS}
    for name, c in out.items():
        if c.topk > c.num_experts:
            raise options.FlagError(f"--topk: expected at most the experts ({c.num_experts}), "
                                    f"got {c.topk}")
    routing = routing_from_args(args)
    return {n: dataclasses.replace(c, routing=routing) for n, c in out.items()}


def routing_from_args(args) -> str:
    """``--routing`` as a canonical spec (NOTE [training-like routing] in
    ``graphstash/models/routing.py``); FlagError naming it for a bad spec."""
    value = getattr(args, "routing", None) or "balanced"
    try:
        return str(parse_routing(value))
    except (TypeError, ValueError) as exc:
        raise options.FlagError(f"--routing: {str(exc).split(': ', 1)[-1]}") from None


@contextlib.contextmanager
def count_exchange(group):
    """Count the bytes this rank sends to other ranks through ``all_to_all_single`` (ours and
    the autograd version both call ``torch.distributed.all_to_all_single``),
    ``all_gather_into_tensor`` (its input to each other rank) and ``reduce_scatter_tensor``
    (each other rank's block of its input); yields a one-item list holding the running
    total."""
    total = [0]
    if group is None:
        yield total
        return
    import torch.distributed as dist

    original = dist.all_to_all_single
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        if input_split_sizes:
            sent = sum(n for r, n in enumerate(input_split_sizes) if r != rank)
        else:
            sent = input.shape[0] // world * (world - 1)
        total[0] += sent * row
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def gathering(output, input, *a, **k):
        total[0] += input.numel() * input.element_size() * (world - 1)
        return gather(output, input, *a, **k)

    def scattering(output, input, *a, **k):
        total[0] += input.numel() * input.element_size() // world * (world - 1)
        return scatter(output, input, *a, **k)

    dist.all_to_all_single = counting
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gathering, scattering
    try:
        yield total
    finally:
        dist.all_to_all_single = original
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gather, scatter


DEFAULT_PREFETCH = "after_release"     # the stash rows' StashConfig.prefetch (see below)


def stash_config(device: torch.device, prefetch: str = DEFAULT_PREFETCH):
    """The :class:`~graphstash.StashConfig` of the ``graph + budget + stash`` mode on the CUDA
    ``device`` (``graphstash memory --mode stash`` uses it too; on the CPU, where the tests
    run the mode, one copy block).

    NOTE [bench pool factor]: the pool is 1.05x the demand of the warmup steps: a layer's
    live rows vary by well under 1 % between random routings here. A step that outgrows it is
    flagged and rerun (the flags column), never silently wrong. Copies get half the
    multiprocessors (NOTE [copy blocks] in stash/scheduler.py). ``prefetch``: as
    ``StashConfig.prefetch``; by default a group's reload is issued once
    autograd released the group before it (``prefetch="after_release"``, NOTE [prefetch]):
    in the memory-bound configuration that step was faster than issuing it at the last unpack,
    with the same peak, in every paired run (the figures and their command:
    docs/moe-performance.md, change 7).
    """
    import graphstash

    on_gpu = torch.device(device).type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 2
    return graphstash.StashConfig(host_tier=False, copy_blocks=max(1, sms // 2),
                                  device_factor=1.05, prefetch=prefetch)


def recaptures(stats, device: torch.device) -> int:
    """The calls of a ``graph_step`` row that captured its graph again (``stats``: its
    :class:`~graphstash.GraphStepStats`, None for an eager row): on a GPU every capture after
    the first; on the CPU, where nothing is captured, the calls that dropped the graphs for new
    sizes (a dispatch budget changed, the stash grew after an overflow or ahead of one)."""
    if stats is None:
        return 0
    if torch.device(device).type == "cuda":
        return max(0, stats.captures - 1)
    return stats.budget_changes + stats.stash_growths + stats.stash_grown_ahead
