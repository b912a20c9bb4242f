"""Train a HuggingFace transformers MoE model (Qwen3-MoE, built from a config) with the whole
training step captured in one CUDA graph by graphstash.graph_step.

    python examples/hf_moe_train.py            # a GPU: bf16, 4 layers, 8192 tokens per step;
                                               # no GPU: the --tiny run on the CPU
    python examples/hf_moe_train.py --tiny     # CPU-sized (what CI runs): eager, same code

The data is a synthetic "count up" language (token t+1 = token t + 1 mod vocab, from a random
start), so the loss falls within a few steps: the tiny run takes its loss from about 4.2
(ln 64, a uniform guess) to about 1 in 20 steps, in well under 30 seconds on an idle CPU. The script
says first where it runs and what. Without CUDA graph_step runs every step eagerly, which the
first line says too.
"""
from __future__ import annotations

import argparse
import time
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


# name -> (model sizes, batch size, sequence length, vocabulary, learning rate, default steps)
SIZES = {
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, moe_intermediate_size=64, num_experts=8),
             4, 32, 64, 1e-2, 20),
    "full": (dict(hidden_size=512, num_hidden_layers=4, moe_intermediate_size=384,
                  num_experts=32), 8, 1024, 512, 3e-3, 20),      # 8192 tokens per step
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="CPU-sized model and batch (the default without a GPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: 20 tiny, 20 full)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda if torch sees a GPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device: expected a device torch can use, got cuda but torch sees no GPU")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected a positive int, got {args.steps}")
    on_gpu = device.type == "cuda"
    size = "tiny" if args.tiny or not on_gpu else "full"
    sizes, batch_size, seq_len, vocab, lr, steps = SIZES[size]
    steps = args.steps or steps
    dtype = torch.bfloat16 if on_gpu else torch.float32
    where = ("a CUDA graph per step (graph_step captures after 2 eager warmup steps)" if on_gpu
             else "eagerly on the CPU (graph_step needs CUDA for its graph), reference backend")
    print(f"hf_moe_train: {size} Qwen3-MoE ({sizes['num_hidden_layers']} layers, hidden "
          f"{sizes['hidden_size']}, {sizes['num_experts']} experts top-2), {batch_size}x{seq_len} "
          f"tokens per step, {str(dtype).replace('torch.', '')} on {device}: {where}")
    # The line above says how the steps run: graph_step's own notes on the CPU (no CUDA graph,
    # an optimizer that a GPU capture would refuse) are not repeated.
    warnings.filterwarnings("ignore", message=r"graphstash\.graph_step\(",
                            category=RuntimeWarning)

    # ---- the ~20 lines of the README --------------------------------------------------
    gst.register()                                   # "graphstash" joins the ExpertsInterface
    config = transformers.Qwen3MoeConfig(vocab_size=vocab, intermediate_size=256,
                                         num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=64, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[], **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="graphstash").to(device, dtype)
    gst.configure(model, stash=True)                 # the defaults; group= for expert parallel
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=on_gpu, fused=on_gpu)

    @graphstash.graph_step(optimizer=opt, warmup=2, stash=graphstash.StashConfig())
    def train_step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    data = batches(config.vocab_size, batch_size, seq_len, device)
    start = time.perf_counter()
    for step in range(steps):
        loss = train_step(next(data))
        print(f"step {step} loss {loss.item():.4f}")
    # -------------------------------------------------------------------------------------
    stats = train_step.stats
    print(f"{stats.replays} graph replays, {stats.eager_steps} eager steps, "
          f"{stats.eager_reruns} dropless reruns; {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
