"""``graphstash bench hf``: HuggingFace transformers MoE models trained under ``graph_step``.

Qwen3-MoE and Mixtral causal LMs built from configs (6 layers, hidden 512, 8192 tokens per
step, bf16, AdamW), each trained three ways from the same initialisation on the same batches:

- ``HF grouped_mm eager``: transformers' ``grouped_mm`` experts backend, eager (the peer);
- ``HF grouped_mm + graph_step``: the same under :func:`graphstash.graph_step`, to show whether
  it captures at all (a failed capture is reported with its reason, not raised);
- ``graphstash + graph_step``: the ``"graphstash"`` experts backend
  (:mod:`graphstash.integrations.transformers`), the whole step captured.

Printed per model: the largest relative difference between the losses of the ``steps``
training steps of each graphed run and the eager peer's, the mean step time of the steps
after the capture (each ``graph_step`` call: stage the batch, replay, read the status) against
eager steps, the speed-up, and the peak memory (``torch.cuda.max_memory_allocated`` from the
model's creation on, minus the memory before it) with the activation peak (that minus the
parameters, gradients and AdamW state). The runs go one after the other, each model freed
before the next is built. ``--quick``: 2 layers, 2048 tokens, 8 steps.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import torch

WARMUP = 2          # eager graph_step calls before the capture


@dataclasses.dataclass
class HFBenchConfig:
    """One benchmark model: a transformers config family and its sizes."""
    family: str                 # "qwen3_moe" or "mixtral"
    hidden: int = 512
    layers: int = 6
    num_experts: int = 32
    topk: int = 4
    ffn: int = 512              # expert intermediate size
    vocab: int = 8192
    batch: int = 8
    seq_len: int = 1024         # batch x seq_len tokens per step
    steps: int = 20


CONFIGS = {
    "qwen3-moe": HFBenchConfig("qwen3_moe", num_experts=64, topk=8, ffn=256),
    "mixtral": HFBenchConfig("mixtral", num_experts=8, topk=2, ffn=1024),
}
QUICK = {name: dataclasses.replace(c, layers=2, batch=2, steps=8) for name, c in CONFIGS.items()}
RUNS = ("HF grouped_mm eager", "HF grouped_mm + graph_step", "graphstash + graph_step")


def hf_config(c: HFBenchConfig):
    """The transformers config of ``c`` (SDPA attention, 8 heads of 64, no dropout)."""
    import transformers as tf

    common = dict(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=max(4096, c.seq_len), num_experts_per_tok=c.topk,
                  tie_word_embeddings=False)
    if c.family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=2 * c.ffn, moe_intermediate_size=c.ffn,
                                 num_experts=c.num_experts, decoder_sparse_step=1,
                                 mlp_only_layers=[], norm_topk_prob=True)
    if c.family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=c.ffn, num_local_experts=c.num_experts)
    raise ValueError(f"family: expected 'qwen3_moe' or 'mixtral', got {c.family!r}")


def build(c: HFBenchConfig, implementation: str, device, seed: int = 0):
    """The model of ``c`` with ``implementation`` experts, initialised from ``seed`` on the CPU
    (so every run starts from the same weights), in bf16 on ``device``."""
    import transformers as tf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(hf_config(c), attn_implementation="sdpa",
                                                    experts_implementation="grouped_mm")
    model = model.to(device, torch.bfloat16)
    if implementation != "grouped_mm":
        model.set_experts_implementation(implementation)
    model.train()
    return model


def batches(c: HFBenchConfig, device, seed: int = 1) -> list:
    """``steps`` int64 ``[batch, seq_len]`` token-id batches on ``device``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, c.vocab, (c.batch, c.seq_len), generator=gen).to(device)
            for _ in range(c.steps)]


def _state_bytes(model) -> int:
    """Parameters, gradients and the two AdamW moments (fp32 step counters left out)."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def _run(c: HFBenchConfig, run: str, device, data: list) -> dict:
    """Train ``c`` ``steps`` steps the way ``run`` says; losses, step time, memory."""
    import graphstash
    import graphstash.integrations.transformers as gst

    from .timing import eager_training_step

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    graphed = run != "HF grouped_mm eager"
    model = build(c, "graphstash" if run.startswith("graphstash") else "grouped_mm", device)
    if run.startswith("graphstash"):
        gst.configure(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=graphed)

    def forward_backward(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    if graphed:
        step = graphstash.graph_step(forward_backward, optimizer=opt, warmup=WARMUP)
    else:
        step = eager_training_step(forward_backward, opt)

    losses, times, error = [], [], None
    try:
        for i, ids in enumerate(data):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(ids)
            torch.cuda.synchronize()
            if i > WARMUP:           # the steps after the capture (eager: the same steps)
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    except graphstash.CaptureError as exc:
        error = str(exc).splitlines()[0]
    result = {
        "losses": losses, "error": error,
        "step_ms": 1e3 * sum(times) / len(times) if times else float("nan"),
        "peak_bytes": torch.cuda.max_memory_allocated(device) - base,
        "state_bytes": _state_bytes(model),
    }
    result["peak_mib"] = result["peak_bytes"] / 2**20
    if graphed and error is None:
        st = step.stats
        result.update(replays=st.replays, captures=st.captures, reruns=st.eager_reruns,
                      over_budget=st.over_budget)
        step.release()
    del model, opt, step
    return result


def _max_rel_diff(losses: list, reference: list) -> float:
    if len(losses) != len(reference) or not losses:
        return float("nan")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def run(quick: bool = False) -> dict:
    """Run every configuration; print one table per model; return the numbers."""
    from .timing import gpu_name, print_table

    device = torch.device("cuda", torch.cuda.current_device())
    import graphstash.integrations.transformers as gst

    gst.register()
    results = {}
    for name, c in (QUICK if quick else CONFIGS).items():
        data = batches(c, device)
        runs = {r: _run(c, r, device, data) for r in RUNS}
        ref = runs["HF grouped_mm eager"]
        rows = []
        for r, res in runs.items():
            res["max_rel_loss_diff"] = _max_rel_diff(res["losses"], ref["losses"])
            res["speedup"] = ref["step_ms"] / res["step_ms"] if res["error"] is None else 0.0
            rows.append([r, "failed: " + res["error"] if res["error"] else "ok",
                         res["step_ms"], res["speedup"], res["peak_bytes"] / 2**30,
                         (res["peak_bytes"] - res["state_bytes"]) / 2**30,
                         res["max_rel_loss_diff"], res.get("reruns", 0)])
        tokens = c.batch * c.seq_len
        print_table(f"{name}: {c.layers} layers, hidden {c.hidden}, {c.num_experts} experts "
                    f"top-{c.topk}, ffn {c.ffn}, {tokens} tokens/step, bf16, AdamW, "
                    f"{c.steps} steps ({gpu_name()})",
                    ["run", "capture", "step ms", "speed-up", "peak GiB", "act. peak GiB",
                     "max rel loss diff", "reruns"], rows)
        for res in runs.values():
            res["config"] = dataclasses.asdict(c)
        results[name] = runs        # {model: {run: {"step_ms", "peak_mib", ...}}}, as bench moe
    return results
