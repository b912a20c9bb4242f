"""Train a HuggingFace transformers MoE model (Qwen3-MoE, built from a config) with the whole
training step captured in one CUDA graph by graphstash.graph_step.

    python examples/hf_moe_train.py            # GPU: bf16, 4 layers, 8192 tokens per step
    python examples/hf_moe_train.py --tiny     # CPU-sized (what CI runs): eager, same code

The data is a synthetic "count up" language (token t+1 = token t + 1 mod vocab, from a random
start), so the loss falls within a few steps. Without CUDA graph_step runs every step eagerly
and says so once.
"""
from __future__ import annotations

import argparse
import warnings

import torch
import transformers

import graphstash
import graphstash.integrations.transformers as gst


def batches(vocab: int, batch_size: int, seq_len: int, device, seed: int = 0):
    """Endless ``[batch_size, seq_len]`` int64 token ids on ``device``: rows count up from
    random starts."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
        yield ((start + torch.arange(seq_len)) % vocab).to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized model and batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if args.tiny:
        size = dict(hidden_size=64, num_hidden_layers=2, moe_intermediate_size=64, num_experts=8)
        batch_size, seq_len = 2, 32
    else:
        size = dict(hidden_size=512, num_hidden_layers=4, moe_intermediate_size=384,
                    num_experts=32)
        batch_size, seq_len = 8, 1024                          # 8192 tokens per step
    # On the CPU graph_step runs eagerly and the optimizer is not capturable: both are said once.
    warnings.filterwarnings("ignore", message=".*without a CUDA graph.*")
    warnings.filterwarnings("ignore", message=".*capturable=False.*")

    # ---- the ~20 lines of the README --------------------------------------------------
    gst.register()                                   # "graphstash" joins the ExpertsInterface
    config = transformers.Qwen3MoeConfig(vocab_size=512, intermediate_size=256,
                                         num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=64, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[], **size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="graphstash").to(device, dtype)
    gst.configure(model, stash=True)                 # the defaults; group= for expert parallel
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=on_gpu, fused=on_gpu)

    @graphstash.graph_step(optimizer=opt, warmup=2, stash=graphstash.StashConfig())
    def train_step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    data = batches(config.vocab_size, batch_size, seq_len, device)
    for step in range(args.steps):
        loss = train_step(next(data))
        print(f"step {step} loss {loss.item():.4f}")
    # -------------------------------------------------------------------------------------
    stats = train_step.stats
    print(f"{stats.replays} graph replays, {stats.eager_steps} eager steps, "
          f"{stats.eager_reruns} dropless reruns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
