"""``graphstash bench hf``: HuggingFace transformers MoE models trained as their users train
them, and with graphstash's experts backend.

Causal LMs built from transformers configs with random initialisation (bf16, fused AdamW),
every run from the same initialisation on the same batches, one after the other (each freed,
its memory returned, dynamo's caches reset, before the next is built):

- ``HF grouped_mm eager``: transformers' ``grouped_mm`` experts backend, an eager loop (the
  reference of the loss differences and of the speed-up);
- ``HF grouped_mm eager (again)``: the same run once more, the floor of the loss
  differences (NOTE [loss difference floor], below);
- ``HF grouped_mm + graph_step``: the same under :func:`graphstash.graph_step`;
- ``HF grouped_mm + compile``: ``torch.compile(model)`` (default mode, Inductor), eager loop;
- ``HF grouped_mm + compile (reduce-overhead)``: ``torch.compile(model,
  mode="reduce-overhead")``: Inductor's own CUDA graphs of forward and backward;
- ``graphstash + graph_step``: the ``"graphstash"`` experts backend
  (:mod:`graphstash.integrations.transformers`), the whole step captured;
- ``graphstash + compile``: that backend and ``torch.compile(model)``, eager loop;
- ``graphstash + compile + graph_step``: the same compiled model under ``graph_step``
  (compiled in its warmup, NOTE [compile and capture] in ``graphstash/graph/compile_guard.py``).

Presets (``--preset``; default every one): ``olmoe-1b-7b``, OLMoE-1B-7B's widths (hidden 2048,
64 experts top-8, expert ffn 1024, 16 heads, vocab 50304; OLMoE's transformers config) cut to
8 layers, 4 x 2048 tokens per step, 14 steps; ``gpt-oss-20b``, GPT-OSS-20B's widths (hidden
2880, 32 experts top-4, expert ffn 2880, 64 heads of 64, 8 key/value heads, vocab 201088,
sliding window 128 on every other layer, eager attention: GPT-OSS has no sdpa) cut to 4
layers, 4 x 2048 tokens, 14 steps; ``qwen3-moe`` and ``mixtral``, small models
(6 layers, hidden 512, 8 x 1024 tokens, 20 steps). ``--layers``, ``--batch``, ``--seq`` and
``--steps`` change the preset's; ``--runs`` picks runs; ``--quick``: 2 layers, batch 2, 8 steps.

Printed per model, per run: the step time (median of the steps after the warmup and the
capture, each step synchronised and timed by the host clock: what a loop that reads its loss
every step waits), tokens per second, the speed-up over HF eager, the time over the best HF
run (the fastest of the four ``HF`` runs that worked), the peak memory over the steps above
the memory before the model was built and its ratio to the best HF run's, the activation peak
(the peak less parameters, gradients and AdamW state), the largest relative difference between
the run's losses and HF eager's over the steps, and graph_step's dropless reruns. A run that
fails (a capture refused, a compile error, out of memory) is reported with its reason below
the table, and the next run goes on.

NOTE [loss difference floor]: HF eager's second run's loss difference to its first is the
reference's own spread from run to run: atomic accumulations (``index_add_``, the embedding's
and attention's backward) sum in another order each run, and training amplifies the
difference step by step. At lr 1e-3 the OLMoE preset's loss rose from 11.23 to 11.44 in eight
steps, and the reference against itself reached 8.8e-4 by step 8, HF's compiled runs 4.5e-3
(measured on an H200, docs/moe-performance.md): the column measured that instability, not
the runs' arithmetic. So every run trains at :data:`LR` = 1e-4, and every run's loss column is
read next to the reference's own.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from ...tables import Column
from .. import options, progress
from ..output import Output
from ..training import quiet_cpu_graph_step
from . import failures
from .meter import DeviceMeter
from .spread import range_text, spread

SUMMARY = ("HuggingFace MoE models trained as their users train them, and with graphstash's "
           "experts backend")
DESCRIPTION = ("Trains transformers MoE causal LMs (OLMoE-1B-7B widths, small Qwen3-MoE and "
               "Mixtral) from one initialisation on one set of batches: HF's grouped_mm "
               "backend eager, under graph_step and compiled, and graphstash's backend under "
               "graph_step and compiled; prints per run the step time and its range, tokens/s, "
               "the speed-up over HF eager, the time and peak over the best HF run, the "
               "activation peak and the largest loss difference to HF eager.")
WARMUP = 2          # eager graph_step calls before the capture; steps 0..WARMUP are not timed
LR = 1e-4           # AdamW's learning rate in every run (NOTE [loss difference floor])


@dataclasses.dataclass
class HFBenchConfig:
    """One benchmark model: a transformers config family and its sizes."""
    family: str                 # "qwen3_moe", "mixtral", "olmoe" or "gpt_oss"
    hidden: int = 512
    layers: int = 6
    num_experts: int = 32
    topk: int = 4
    ffn: int = 512              # expert intermediate size
    vocab: int = 8192
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = 64   # None: hidden // heads (OLMoE's config derives it)
    batch: int = 8
    seq_len: int = 1024         # batch x seq_len tokens per step
    steps: int = 20
    attention: str = "sdpa"     # transformers' attention implementation (GPT-OSS: no sdpa)


CONFIGS = {
    "olmoe-1b-7b": HFBenchConfig("olmoe", hidden=2048, layers=8, num_experts=64, topk=8,
                                 ffn=1024, vocab=50304, heads=16, kv_heads=16, head_dim=None,
                                 batch=4, seq_len=2048, steps=14),
    "qwen3-moe": HFBenchConfig("qwen3_moe", num_experts=64, topk=8, ffn=256),
    "mixtral": HFBenchConfig("mixtral", num_experts=8, topk=2, ffn=1024),
    # GPT-OSS-20B's widths (its config's vocabulary, heads, sliding window) cut to 4 layers
    "gpt-oss-20b": HFBenchConfig("gpt_oss", hidden=2880, layers=4, num_experts=32, topk=4,
                                 ffn=2880, vocab=201088, heads=64, kv_heads=8, head_dim=64,
                                 batch=4, seq_len=2048, steps=14, attention="eager"),
}


def quick(c: HFBenchConfig) -> HFBenchConfig:
    """The ``--quick`` sizes of ``c``: 2 layers, batch 2, 8 steps."""
    return dataclasses.replace(c, layers=2, batch=2, steps=8)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """How a run trains: the experts backend, ``torch.compile``'s mode (None: uncompiled,
    ``"default"``, ``"reduce-overhead"``) and whether the step is under ``graph_step``."""
    experts: str
    compile: str | None
    graphed: bool


RUNS = {
    "HF grouped_mm eager": RunSpec("grouped_mm", None, False),
    "HF grouped_mm eager (again)": RunSpec("grouped_mm", None, False),
    "HF grouped_mm + graph_step": RunSpec("grouped_mm", None, True),
    "HF grouped_mm + compile": RunSpec("grouped_mm", "default", False),
    "HF grouped_mm + compile (reduce-overhead)": RunSpec("grouped_mm", "reduce-overhead", False),
    "graphstash + graph_step": RunSpec("graphstash", None, True),
    "graphstash + compile": RunSpec("graphstash", "default", False),
    "graphstash + compile + graph_step": RunSpec("graphstash", "default", True),
}
REFERENCE = "HF grouped_mm eager"
HF_PEERS = tuple(name for name in RUNS if name.startswith("HF "))


SHARED_FLAGS = ("--preset", "--layers", "--steps")     # the moe suite has them too


def add_arguments(parser, *, skip: tuple = ()) -> None:
    """The hf suite's options on ``graphstash bench hf`` (``skip``: flags another suite's
    options already hold: ``bench all`` gives the moe suite's to both, :mod:`.forward`)."""
    g = parser.add_argument_group("hf suite")
    if "--preset" not in skip:
        g.add_argument("--preset", dest="hf_preset", choices=sorted(CONFIGS), default=None,
                       help="one model only (default: every preset)")
    for name, help_ in (("layers", "decoder layers (default: the preset's; olmoe-1b-7b 8)"),
                        ("batch", "sequences per step (default: the preset's; olmoe-1b-7b 4)"),
                        ("seq", "tokens per sequence (default: the preset's; olmoe-1b-7b "
                                "2048)"),
                        ("steps", f"training steps per run, the first {WARMUP + 1} untimed "
                                  "(default: the preset's; olmoe-1b-7b 14)")):
        if f"--{name}" in skip:
            continue
        g.add_argument(f"--{name}", dest=f"hf_{name}", type=int, default=None, metavar="N",
                       help=help_)
    g.add_argument("--runs", dest="hf_runs", default=None, metavar="LIST",
                   help=f"comma-separated subset of: {', '.join(RUNS)} (default: all; "
                   f"'{REFERENCE}' always runs first, the reference of the loss differences)")


def configs_from_args(args, quick_sizes: bool) -> dict:
    """``{name: HFBenchConfig}`` the suite runs, from the command line (see
    :func:`add_arguments`); raises :class:`~graphstash.tools.options.FlagError` naming the
    option for a bad value."""
    over = {"layers": options.positive_int("--layers", getattr(args, "hf_layers", None)),
            "batch": options.positive_int("--batch", getattr(args, "hf_batch", None)),
            "seq_len": options.positive_int("--seq", getattr(args, "hf_seq", None),
                                            minimum=2),
            "steps": options.positive_int("--steps", getattr(args, "hf_steps", None),
                                          minimum=WARMUP + 2)}
    over = {k: v for k, v in over.items() if v is not None}
    preset = getattr(args, "hf_preset", None)
    names = [preset] if preset is not None else list(CONFIGS)
    return {name: dataclasses.replace(quick(CONFIGS[name]) if quick_sizes else CONFIGS[name],
                                      **over) for name in names}


def runs_from_args(args) -> tuple:
    """The runs ``--runs`` names, in :data:`RUNS` order, HF eager first (the reference)."""
    text = getattr(args, "hf_runs", None)
    if not text:
        return tuple(RUNS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        raise options.FlagError(f"--runs: expected names from {', '.join(RUNS)}, got "
                                f"{', '.join(map(repr, bad)) or repr(text)}")
    return tuple(n for n in RUNS if n in names or n == REFERENCE)


def hf_config(c: HFBenchConfig):
    """The transformers config of ``c`` (no dropout; qwen3_moe and mixtral with 8 heads of 64
    and 4 key/value heads, olmoe with ``c.heads`` heads of ``hidden / heads``)."""
    import transformers as tf

    common = dict(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                  num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                  max_position_embeddings=max(4096, c.seq_len), num_experts_per_tok=c.topk,
                  tie_word_embeddings=False)
    if c.family == "olmoe":
        # OLMoE's token ids, where the vocabulary holds them (pad 1, eos 50279)
        return tf.OlmoeConfig(**common, intermediate_size=c.ffn, num_experts=c.num_experts,
                              pad_token_id=1, eos_token_id=min(50279, c.vocab - 1))
    if c.head_dim is not None:
        common["head_dim"] = c.head_dim
    if c.family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=2 * c.ffn, moe_intermediate_size=c.ffn,
                                 num_experts=c.num_experts, decoder_sparse_step=1,
                                 mlp_only_layers=[], norm_topk_prob=True)
    if c.family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=c.ffn, num_local_experts=c.num_experts)
    if c.family == "gpt_oss":
        layer_types = ["sliding_attention", "full_attention"] * (c.layers // 2 + 1)
        return tf.GptOssConfig(**common, intermediate_size=c.ffn, num_local_experts=c.num_experts,
                               sliding_window=128, layer_types=layer_types[:c.layers])
    raise ValueError(f"family: expected 'qwen3_moe', 'mixtral', 'olmoe' or 'gpt_oss', got "
                     f"{c.family!r}")


def build(c: HFBenchConfig, implementation: str, device, seed: int = 0):
    """The model of ``c`` with ``implementation`` experts (``"grouped_mm"`` or
    ``"graphstash"``, registered), in bf16 on ``device``, in training mode.

    Initialised on ``device`` (float32, then cast) from ``seed``, the device's generator
    forked: every run on one device starts from the same weights, and the caller's random
    state is untouched.
    """
    import transformers as tf

    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = tf.AutoModelForCausalLM.from_config(hf_config(c), attn_implementation=c.attention,
                                                        experts_implementation="grouped_mm")
    model = model.to(torch.bfloat16)
    if implementation != "grouped_mm":
        model.set_experts_implementation(implementation)
    model.train()
    return model


def batches(c: HFBenchConfig, device, seed: int = 1) -> list:
    """``steps`` int64 ``[batch, seq_len]`` token-id batches on ``device``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, c.vocab, (c.batch, c.seq_len), generator=gen).to(device)
            for _ in range(c.steps)]


def compile_arguments(mode: str | None, compile_kwargs: dict | None):
    """``torch.compile``'s keyword arguments for a run compiled in ``mode`` (None: not
    compiled). ``compile_kwargs`` (the tests: ``{"backend": "aot_eager"}``) replaces the
    default backend; ``mode`` is an Inductor option, so it is dropped with another backend."""
    if mode is None:
        return None
    if compile_kwargs:
        kwargs = dict(compile_kwargs)
        if kwargs.get("backend", "inductor") == "inductor" and mode != "default":
            kwargs["mode"] = mode
        return kwargs
    return {} if mode == "default" else {"mode": mode}


def run_one(c: HFBenchConfig, name: str, device, data: list, *,
            compile_kwargs: dict | None = None, on_call=None) -> dict:
    """Train ``c`` on the batches ``data`` (``steps`` int64 ``[batch, seq_len]`` token ids on
    ``device``) the way run ``name`` of :data:`RUNS` says; returns its losses, step time,
    tokens/s, memory and graph_step's counters, or ``error`` (one line) if it failed.

    ``device``: a CUDA device; on the CPU (the tests) graph_step runs every step eagerly,
    times are the host clock's and memory figures None. ``compile_kwargs``: see
    :func:`compile_arguments`. ``on_call``: called without arguments after each step (a
    progress bar). The median step time ``step_ms`` has its ``step_ms_spread`` beside it.
    """
    import graphstash
    import graphstash.integrations.transformers as gst

    from ...memory import static_footprint
    from .timing import eager_training_step

    if name not in RUNS:
        raise ValueError(f"name: expected one of {', '.join(RUNS)}, got {name!r}")
    spec = RUNS[name]
    meter = DeviceMeter(device)
    torch._dynamo.reset()       # no compiled code, guard or recompile count of another run
    meter.settle()
    base = meter.allocated()
    result = {"losses": [], "error": None}
    model = opt = step = runs = forward_backward = None
    times = []
    try:
        if spec.experts == gst.IMPLEMENTATION:
            gst.register()
        model = build(c, spec.experts, device)
        if spec.experts == gst.IMPLEMENTATION:
            gst.configure(model)
        on_gpu = meter.on_gpu
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=on_gpu or None,
                                capturable=on_gpu and spec.graphed)
        kwargs = compile_arguments(spec.compile, compile_kwargs)
        runs = model if kwargs is None else torch.compile(model, **kwargs)
        forward_backward = lm_forward_backward(runs, spec.compile == "reduce-overhead")
        if spec.graphed:
            step = graphstash.graph_step(forward_backward, optimizer=opt, warmup=WARMUP,
                                         device=meter.device)
        else:
            step = eager_training_step(forward_backward, opt)
        meter.sync()
        meter.reset_peak()      # the peak of the steps, not of the initialisation
        with quiet_cpu_graph_step(on_gpu):
            for i, ids in enumerate(data):
                ms, loss = meter.timed_call(step, ids)
                if i > WARMUP:  # after the warmup and the capture (eager runs: the same steps)
                    times.append(ms)
                result["losses"].append(float(loss))
                if on_call is not None:
                    on_call()
    except Exception as exc:            # reported in the table; the next run goes on
        result["error"] = failures.describe(exc)
    if result["error"] is None:
        tokens = c.batch * c.seq_len
        peak = meter.peak_above(base)
        static = static_footprint(model, opt, device=meter.device) if meter.on_gpu else None
        result["step_ms"] = statistics.median(times)
        result["step_ms_spread"] = spread(times)
        result["tokens_per_s"] = tokens / (result["step_ms"] / 1e3)
        result["peak_mib"] = None if peak is None else peak / 2**20
        result["activation_peak_mib"] = None if peak is None else (peak - static) / 2**20
        if spec.graphed:
            st = step.stats
            result.update(replays=st.replays, captures=st.captures, reruns=st.reruns,
                          over_budget=st.over_budget)
    if spec.graphed and step is not None:
        try:
            step.release()
        except Exception as exc:
            result["error"] = result["error"] or "release: " + failures.describe(exc)
    del model, opt, step, runs, forward_backward   # freed before the next run is built
    meter.settle()
    return result


def lm_forward_backward(model, mark_step: bool):
    """A step body for a causal LM: ``model``'s loss on ``ids`` (int64 ``[batch, seq]`` on the
    model's device) as its own labels, backward, and the detached loss; ``mark_step`` marks
    each call as one iteration of torch's own CUDA graphs (``mode="reduce-overhead"``)."""
    def forward_backward(ids):
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    return forward_backward


def max_rel_diff(losses: list, reference: list):
    """The largest ``|loss - reference| / |reference|`` over the steps (None when the runs
    did not both finish every step)."""
    if len(losses) != len(reference) or not losses:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def best_hf(runs: dict):
    """The fastest run of :data:`HF_PEERS` in ``runs`` that worked, or None."""
    ok = [n for n in HF_PEERS if n in runs and runs[n].get("step_ms") is not None]
    return min(ok, key=lambda n: runs[n]["step_ms"]) if ok else None


def add_comparisons(runs: dict) -> None:
    """Set each run's ``max_rel_loss_diff`` and ``speedup`` (against HF eager) and
    ``ratio_to_best_hf`` / ``peak_ratio_to_best_hf`` (against :func:`best_hf`), None where a
    figure is missing."""
    ref = runs.get(REFERENCE, {})
    best = best_hf(runs)
    b = runs[best] if best else {}
    for res in runs.values():
        ok = res.get("error") is None and "step_ms" in res
        res["best_hf"] = best
        res["max_rel_loss_diff"] = (max_rel_diff(res["losses"], ref["losses"])
                                    if ok and ref.get("error") is None else None)
        res["speedup"] = (ref["step_ms"] / res["step_ms"]
                          if ok and ref.get("step_ms") else None)
        res["ratio_to_best_hf"] = res["step_ms"] / b["step_ms"] if ok and best else None
        res["peak_ratio_to_best_hf"] = (res["peak_mib"] / b["peak_mib"]
                                        if ok and best and res["peak_mib"] is not None
                                        and b.get("peak_mib") else None)


def _gib(mib):
    return None if mib is None else mib / 1024


COLUMNS = (Column("run", width=41), Column("step ms", ".1f", width=7),
           Column("min-max ms", width=11, align="right"), Column("tokens/s", width=8,
                                                                   align="right"),
           Column("speed-up", ".3f", width=8), Column("/best HF", ".3f", width=8),
           Column("peak GiB", ".3f", width=8), Column("peak/best HF", ".3f", width=12),
           Column("act. peak GiB", ".3f", width=13),
           Column("max rel loss diff", width=17, align="right"),
           Column("reruns", width=6, align="right"))


def _title(name: str, c: HFBenchConfig, where: str) -> str:
    return (f"{name}: {c.layers} layers, hidden {c.hidden}, {c.num_experts} experts "
            f"top-{c.topk}, ffn {c.ffn}, {c.heads} heads, vocab {c.vocab}, {c.batch} x "
            f"{c.seq_len} = {c.batch * c.seq_len} tokens/step, AdamW, {c.steps} steps ({where})")


def table_row(run: str, res: dict) -> list:
    """The values of ``run``'s line (``res``: its figures, comparisons where known)."""
    diff = res.get("max_rel_loss_diff")
    return [run, res["step_ms"], range_text(res.get("step_ms_spread"), ".1f"),
            f"{res['tokens_per_s'] / 1e3:.1f}k", res.get("speedup"), res.get("ratio_to_best_hf"),
            _gib(res["peak_mib"]), res.get("peak_ratio_to_best_hf"),
            _gib(res["activation_peak_mib"]), None if diff is None else f"{diff:.1e}",
            res.get("reruns", "-")]


def legend(runs: dict) -> str:
    """The line under a model's table."""
    best = best_hf(runs)
    return (f"speed-up: the step time of {REFERENCE} over the run's; /best HF, peak/best HF: "
            f"the run's over those of {best} (the fastest HF run); min-max: the timed steps' "
            f"range; max rel loss diff: to {REFERENCE}, the largest over the steps "
            f"('{REFERENCE} (again)': the reference's own spread, NOTE [loss difference floor])"
            if best else "no HF run worked: nothing to compare with")


def print_runs(name: str, c: HFBenchConfig, runs: dict, where: str,
               out: Output | None = None) -> None:
    """The table of one model's runs at once, failed runs' reasons in their rows."""
    out = Output() if out is None else out
    out.title(_title(name, c, where))
    table = out.table(COLUMNS)
    for run, res in runs.items():
        if res.get("error") is not None:
            table.span(run, f"failed: {res['error']}")
        else:
            table.row(table_row(run, res))
    out.note(legend(runs))


def run(quick: bool = False, args=None, *, device=None, compile_kwargs: dict | None = None,
        configs: dict | None = None, out: Output | None = None) -> dict:
    """Run the models and runs the command line selects; print one table per model, each run's
    row as soon as it finished (its ratios to the best HF run once every HF run has run: rows
    before get theirs in a line under the table), a progress bar per model and run on stderr;
    return ``{model: {run: figures}}`` (each run's figures hold its ``config``).

    ``device``: default the current CUDA device; on the CPU every run is eager (the tests).
    ``compile_kwargs``: see :func:`compile_arguments`. ``configs``: ``{name: HFBenchConfig}``
    to run instead of the presets (the tests' tiny models). ``out``: where the tables go
    (default: plain text on stdout).
    """
    from .timing import gpu_name

    out = Output() if out is None else out
    if configs is None:
        configs = configs_from_args(args, quick)
    names = runs_from_args(args)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    where = ("bf16, " + gpu_name() if device.type == "cuda" else
             "bf16 on the CPU: graph_step runs eagerly, no memory figures")
    results = {}
    hf_runs = [n for n in names if n in HF_PEERS]
    with progress.bar(len(configs) * len(names), "bench hf", unit="run") as overall:
        for model_name, c in configs.items():
            data = batches(c, device)
            out.title(_title(model_name, c, where))
            table = out.table(COLUMNS)
            runs, pending = {}, []
            for run_name in names:
                with progress.bar(c.steps, f"{model_name}: {run_name}") as bar:
                    runs[run_name] = run_one(c, run_name, device, data,
                                             compile_kwargs=compile_kwargs, on_call=bar.update)
                overall.update()
                res = runs[run_name]
                add_comparisons(runs)          # against the runs finished so far
                if res.get("error") is not None:
                    table.span(run_name, f"failed: {res['error']}")
                    continue
                if not all(n in runs for n in hf_runs):
                    pending.append(run_name)
                    res = dict(res, ratio_to_best_hf=None, peak_ratio_to_best_hf=None)
                table.row(table_row(run_name, res))
            add_comparisons(runs)
            if pending and best_hf(runs):
                out.note("/best HF (peak/best HF) of the runs finished before the last HF run: "
                         + "; ".join(f"{n} {_pair(runs[n])}" for n in pending))
            out.note(legend(runs))
            for res in runs.values():
                res["config"] = dataclasses.asdict(c)
            results[model_name] = runs
    out.end()
    return results


def _pair(res: dict) -> str:
    ratio, peak = res.get("ratio_to_best_hf"), res.get("peak_ratio_to_best_hf")
    return ("-" if ratio is None else f"{ratio:.3f}") + ("" if peak is None else f" ({peak:.3f})")
