"""A transformers MoE training step with experts that do no work, beside HF's and graphstash's.

Registers an experts implementation, ``"keeps nothing"``, that does no expert work and keeps
nothing for backward: its forward returns zeros ``[T, hidden]`` (the output every backend
allocates), its backward returns zero gradients for the tokens, the router weights and every
expert parameter (the gradients every backend that trains the experts allocates), made by an
opaque operator where the layer's backward runs. Trains it the way ``graphstash bench hf``
trains its runs, beside the runs named, in one process, and prints step time and peak against
HF + ``torch.compile(mode="reduce-overhead")``.

It is not a floor under a backend's peak or time: Inductor compiles the rest of the model
around the stand-in differently (at GPT-OSS-20B widths on one H200 its attention forward was
two kernels where graphstash's was one, and the step's peak came out 1.7 GiB above
graphstash's; docs/moe-performance.md, "One H200: what is left to an experts backend").
``benchmarks/probes/hf_profile.py`` accepts its runs too.

    python benchmarks/probes/hf_no_experts.py --preset gpt-oss-20b --steps 8
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import graphstash  # noqa: E402
from graphstash.tools.bench import hf  # noqa: E402

STAND_IN = "keeps nothing"
STAND_IN_RUNS = {
    "experts keeping nothing + compile + graph_step": hf.RunSpec(STAND_IN, "default", True),
    "experts keeping nothing + compile (reduce-overhead)": hf.RunSpec(STAND_IN, "reduce-overhead",
                                                                      False),
}
PEER = "HF grouped_mm + compile (reduce-overhead)"


@torch.library.custom_op("graphstash_probe::zero_gradients", mutates_args=())
def zero_gradients(grad: torch.Tensor, weights_shape: list[int], weights_dtype: torch.dtype,
                   params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero gradients for the tokens (like ``grad``, ``[T, hidden]``), the router weights
    (``weights_shape``, ``weights_dtype``) and each of ``params``, on ``grad``'s device.

    An opaque op that reads ``grad``: a compiled backward makes them where the layer's backward
    runs, as a real backend's GEMMs would, not all at the backward's start (Inductor places
    constant zeros wherever it likes, and there they would all be alive at once)."""
    return [torch.zeros_like(grad), grad.new_zeros(weights_shape, dtype=weights_dtype),
            *(torch.zeros_like(p) for p in params)]


@zero_gradients.register_fake
def _(grad, weights_shape, weights_dtype, params):
    return [torch.empty_like(grad), grad.new_empty(weights_shape, dtype=weights_dtype),
            *(torch.empty_like(p) for p in params)]


class _NoExperts(torch.autograd.Function):
    """Zeros out, zero gradients back, nothing saved but the parameters (alive anyway)."""

    @staticmethod
    def forward(hidden, weights, *params):
        return hidden.new_zeros(hidden.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, weights, *params = inputs
        ctx.weights_shape = list(weights.shape)
        ctx.weights_dtype = weights.dtype
        ctx.save_for_backward(*params)

    @staticmethod
    def backward(ctx, grad):
        return tuple(zero_gradients(grad, ctx.weights_shape, ctx.weights_dtype,
                                    list(ctx.saved_tensors)))


def no_experts(self, hidden_states, top_k_index, top_k_weights):
    """The ``"keeps nothing"`` experts function (transformers' ExpertsInterface signature):
    ``hidden_states`` ``[T, hidden]``, ``top_k_index`` int ``[T, K]``, ``top_k_weights``
    ``[T, K]``, on one device; returns zeros ``[T, hidden]`` in ``hidden_states``' dtype."""
    params = [p for p in self.parameters() if p.requires_grad]
    return _NoExperts.apply(hidden_states, top_k_weights, *params)


def register() -> None:
    """Add the ``"keeps nothing"`` experts and this script's runs beside the bench's."""
    from transformers.integrations import moe
    moe.ExpertsInterface.register(STAND_IN, no_experts)
    hf.RUNS.update(STAND_IN_RUNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-oss-20b", choices=sorted(hf.CONFIGS))
    parser.add_argument("--steps", type=int, default=8, help="steps per run (3 untimed)")
    parser.add_argument("--runs", default=",".join([PEER, "graphstash + compile + graph_step",
                                                    *STAND_IN_RUNS]))
    args = parser.parse_args()
    register()
    if args.steps < hf.WARMUP + 2:
        parser.error(f"--steps: expected an int >= {hf.WARMUP + 2} (the first {hf.WARMUP + 1} "
                     f"are not timed), got {args.steps}")
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    for n in names:
        if n not in hf.RUNS:
            parser.error(f"--runs: unknown run {n!r}; expected some of {list(hf.RUNS)}")
    device = torch.device("cuda")
    graphstash.warmup(device)
    c = dataclasses.replace(hf.CONFIGS[args.preset], steps=args.steps)
    data = hf.batches(c, device)
    results = {}
    for name in names:
        results[name] = hf.run_one(c, name, device, data)
        r = results[name]
        print(f"{name}: {r.get('error') or ''} step {r.get('step_ms', float('nan')):.1f} ms, "
              f"peak {(r.get('peak_mib') or 0) / 1024:.3f} GiB", flush=True)
    peer = results.get(PEER, {})
    print(f"\n{args.preset}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{c.batch} x {c.seq_len} tokens, {c.layers} layers, {args.steps} steps\n")
    print("| run | step ms | / peer | peak GiB | peak / peer | activation peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if r.get("error"):
            print(f"| {name} | failed: {r['error']} | | | | |")
            continue
        t = r["step_ms"] / peer["step_ms"] if peer.get("step_ms") else float("nan")
        m = r["peak_mib"] / peer["peak_mib"] if peer.get("peak_mib") else float("nan")
        print(f"| {name} | {r['step_ms']:.1f} | {t:.3f} | {r['peak_mib'] / 1024:.3f} | "
              f"{m:.4f} | {r['activation_peak_mib'] / 1024:.3f} |")


if __name__ == "__main__":
    main()
