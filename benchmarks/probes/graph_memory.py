"""Peak memory of one training step, eager against graph_step, and what the graph holds
(probe, not shipped).

    python benchmarks/probes/graph_memory.py moe [--layers 4] [--tokens 8192] [--snapshots DIR]
    python benchmarks/probes/graph_memory.py hf [--layers 2] [--tokens 8192] [--snapshots DIR] [--peer]

``moe``: the reference model at qwen3-30b-a3b layer widths (hidden 2048, expert ffn 768, 128
experts top-8, SwiGLU, capacity 1.0), bf16; ``hf``: an OLMoE-shaped transformers model
(hidden 2048, 64 experts top-8, expert ffn 1024, 16 heads, vocab 50304) on the "graphstash"
experts backend, bf16. Both with fused capturable AdamW. Each is built twice from the same
seed: trained by a plain eager loop (the peak of its third step, after ``reset_peak_memory_stats``),
then by graph_step (warmup 2; the peak of the call that captures, and of a replay). Printed:
the static bytes (parameters, gradients, optimizer state), each peak and the peak above the
static bytes, the bytes allocated after the step, and after the capture the active bytes per
memory pool (the graph's private pool against the ordinary one), and the reserved memory
(peak, and at the end) of each run. ``--peer`` (hf) first measures the same eager step with
transformers' ``grouped_mm`` experts. With ``--snapshots`` the
allocator history of the eager step and of the capture is written there (gzip pickles, as
``torch.cuda.memory._snapshot()`` returns it) for offline analysis.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import os
import pickle

import torch

import graphstash
from graphstash.memory import static_footprint

DEV = "cuda"
GiB = 2**30


def build(what: str, args, implementation: str = "graphstash"):
    torch.manual_seed(0)
    if what == "moe":
        from graphstash.models import MoEConfig, MoEModel

        cfg = MoEConfig(hidden=2048, ffn=768, num_experts=128, topk=8, layers=args.layers,
                        num_tokens=args.tokens, capacity_factor=1.0, gated=True)
        model = MoEModel(cfg, mode="budget", device=DEV, dtype=torch.bfloat16)
        gen = torch.Generator(device=DEV).manual_seed(1)
        xs = [torch.randn(args.tokens, 2048, device=DEV, dtype=torch.bfloat16, generator=gen)
              for _ in range(5)]
        proj = torch.randn(args.tokens, 2048, device=DEV, generator=gen)

        def loss_of(x):
            return (model(x).float() * proj).sum()
        return model, xs, loss_of
    import transformers as tf

    import graphstash.integrations.transformers as gst

    gst.register()
    cfg = tf.OlmoeConfig(vocab_size=50304, hidden_size=2048, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024,
                         num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
                         eos_token_id=50279, pad_token_id=1)
    with torch.device(DEV):
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                    experts_implementation=implementation)
    model = model.to(torch.bfloat16)
    if implementation == "graphstash":
        gst.configure(model, stash=False)
    gen = torch.Generator(device=DEV).manual_seed(1)
    xs = [torch.randint(0, 50304, (args.tokens // 2048, 2048), device=DEV, generator=gen)
          for _ in range(5)]

    def loss_of(ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    return model, xs, loss_of


def pools() -> dict:
    """Active bytes per memory pool id ((0, 0): the ordinary pool)."""
    out: dict = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        active = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        reserved = seg["total_size"]
        a, r = out.get(pool, (0, 0))
        out[pool] = (a + active, r + reserved)
    return out


def record(path):
    if path:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")


def dump(path):
    if path:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(path, "wb") as f:
            pickle.dump(snapshot, f)
        print(f"   wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


def fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def eager(what, args, implementation="graphstash") -> dict:
    fresh()
    model, xs, loss_of = build(what, args, implementation)
    tag = what if implementation == "graphstash" else f"{what}_{implementation}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    out = {}
    for i, x in enumerate(xs[:3]):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out["before"] = torch.cuda.memory_allocated()
            record(args.snapshots and os.path.join(args.snapshots, f"{tag}_eager.pkl.gz"))
        opt.zero_grad(set_to_none=True)
        loss_of(x).backward()
        opt.step()
        if i == 2:
            torch.cuda.synchronize()
            out["peak"] = torch.cuda.max_memory_allocated()
            out["after"] = torch.cuda.memory_allocated()
            dump(args.snapshots and os.path.join(args.snapshots, f"{tag}_eager.pkl.gz"))
    out["static"] = static_footprint(model, opt, device=DEV)
    out["reserved_peak"] = torch.cuda.max_memory_reserved()
    out["reserved"] = torch.cuda.memory_reserved()
    return out                      # the model and its step are freed here


def graphed(what, args) -> dict:
    fresh()
    model, xs, loss_of = build(what, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)

    @graphstash.graph_step(optimizer=opt, warmup=2)
    def step(x):
        loss = loss_of(x)
        loss.backward()
        return loss

    out = {}
    for i, x in enumerate(xs[:4]):
        if i in (2, 3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out[f"before{i}"] = torch.cuda.memory_allocated()
        if i == 2:
            record(args.snapshots and os.path.join(args.snapshots, f"{what}_graph.pkl.gz"))
        step(x)
        if i in (2, 3):
            torch.cuda.synchronize()
            out[f"peak{i}"] = torch.cuda.max_memory_allocated()
            out[f"after{i}"] = torch.cuda.memory_allocated()
        if i == 2:
            dump(args.snapshots and os.path.join(args.snapshots, f"{what}_graph.pkl.gz"))
            out["pools"] = pools()
    out["static"] = static_footprint(model, opt, device=DEV)
    out["reserved_peak"] = torch.cuda.max_memory_reserved()
    out["reserved"] = torch.cuda.memory_reserved()
    out["stats"] = step.stats
    step.release()
    return out                      # the model and its step are freed here


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("moe", "hf"))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--snapshots", default=None)
    parser.add_argument("--peer", action="store_true",
                        help="hf: also the eager step with transformers' grouped_mm experts")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 4 if args.what == "moe" else 2
    print(f"{args.what}: {args.layers} layers, {args.tokens} tokens, bf16, AdamW fused, "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}",
          flush=True)
    if args.peer and args.what == "hf":
        p = eager(args.what, args, "grouped_mm")
        print(f"   HF grouped_mm eager step 3: peak {p['peak'] / GiB:.3f} GiB, above static "
              f"{(p['peak'] - p['static']) / GiB:.3f}, reserved peak "
              f"{p['reserved_peak'] / GiB:.3f}", flush=True)
    e = eager(args.what, args)
    g = graphed(args.what, args)
    s = e["static"]
    print(f"   static (params + grads + AdamW state): {s / GiB:.3f} GiB (graph run: "
          f"{g['static'] / GiB:.3f})")
    print(f"   eager step 3:   peak {e['peak'] / GiB:.3f} GiB, above static "
          f"{(e['peak'] - s) / GiB:.3f}, allocated before {e['before'] / GiB:.3f} after "
          f"{e['after'] / GiB:.3f}")
    for i, label in ((2, "capture call"), (3, "replay call ")):
        print(f"   graph {label}: peak {g[f'peak{i}'] / GiB:.3f} GiB, above static "
              f"{(g[f'peak{i}'] - s) / GiB:.3f}, allocated before {g[f'before{i}'] / GiB:.3f} "
              f"after {g[f'after{i}'] / GiB:.3f}")
    print(f"   ratio graph/eager peak: capture {g['peak2'] / e['peak']:.4f}, replay "
          f"{g['peak3'] / e['peak']:.4f}")
    print(f"   reserved (whole run): eager peak {e['reserved_peak'] / GiB:.3f} GiB, at the end "
          f"{e['reserved'] / GiB:.3f}; graph peak {g['reserved_peak'] / GiB:.3f}, at the end "
          f"{g['reserved'] / GiB:.3f}")
    for pool, (active, reserved) in sorted(g["pools"].items()):
        print(f"   pool {pool}: active {active / GiB:.3f} GiB, reserved {reserved / GiB:.3f}")
    print(f"   graph stats: {g['stats']}", flush=True)


if __name__ == "__main__":
    main()
