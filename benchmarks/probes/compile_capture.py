"""Which compile-then-capture configurations graph_step captures, what fails and why, and
what each capture hazard raises on the GPU (probe, not shipped).

    python benchmarks/probes/compile_capture.py moe [SCENARIO ...]
    python benchmarks/probes/compile_capture.py hf [--layers N] [--tokens T] [--stash auto|always]
    python benchmarks/probes/compile_capture.py hazards [--only NAME]

``moe`` trains the reference model (bf16, 2 layers, hidden 512, 4096 tokens) compiled at
another moment each scenario: ``inside`` graph_step's warmup, ``eval`` (a no_grad pass before),
``eval_grad`` (a forward with grad enabled, no backward), ``train``, ``shape`` (another token
count), ``earlier`` (a graph_step before, released), ``recapture`` (a second shape under
``on_new_shape="recapture"``), ``flagged`` (a warmup step over budget: dropless rerun),
``stash`` / ``stash1`` (stash mode, warmup 2 / 1), ``ro`` and ``ro_eval``
(``mode="reduce-overhead"``, compiled inside / before). ``hf`` trains an OLMoE-shaped
transformers model (hidden 2048, 64 experts top-8, expert ffn 1024, 16 heads, vocab 50304)
on the "graphstash" experts backend, ``torch.compile(model)``, with or without a stash.
``hazards`` runs one step hazard after another (or ``--only NAME``) inside a graph_step
capture and prints the exception chain each raised and, with this tree's graphstash, the cause
it was given.
Prints one ``=== name: OK|FAILED`` line per case, then the chain of a failure.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

import graphstash
from graphstash.models import MoEConfig, MoEModel

DEV = "cuda"


def chain(exc: BaseException) -> None:
    e, seen = exc, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).strip().splitlines()
        print(f"   >> {type(e).__module__}.{type(e).__name__}: "
              f"{' | '.join(line.strip() for line in text[:6])[:900]}")
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    frames = traceback.extract_tb(exc.__traceback__)
    print("   frames: " + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}"
                                      for f in reversed(frames[-12:])))
    try:
        from graphstash.graph import capture_errors
        failure = capture_errors.classify(exc)
        print(f"   cause: {failure.cause}: {failure.error} / {failure.detail}")
    except ImportError:
        pass
    print(f"   cause attribute: {getattr(exc, 'cause', '(none)')}")


def run_case(name: str, fn) -> None:
    torch._dynamo.reset()
    t0 = time.perf_counter()
    print(f"=== {name}: start", flush=True)
    try:
        stats = fn()
        print(f"=== {name}: OK in {time.perf_counter() - t0:.1f} s: {stats}", flush=True)
    except Exception as exc:                    # noqa: BLE001 - the probe reports it
        print(f"=== {name}: FAILED in {time.perf_counter() - t0:.1f} s", flush=True)
        chain(exc)
    torch.cuda.synchronize()


def moe(scenario: str):
    stash_mode = scenario.startswith("stash")
    cfg = MoEConfig(hidden=512, ffn=1024, num_experts=8, topk=2, layers=2, num_tokens=4096,
                    gated=True, capacity_factor=2.0 if stash_mode else
                    (0.6 if scenario == "flagged" else 1.0))
    model = MoEModel(cfg, mode="stash" if stash_mode else "budget", device=DEV,
                     dtype=torch.bfloat16)
    mode = "reduce-overhead" if scenario.startswith("ro") else "default"
    cm = torch.compile(model, mode=mode)
    proj = torch.randn(cfg.num_tokens, cfg.hidden, device=DEV)
    x0 = torch.randn(cfg.num_tokens, cfg.hidden, device=DEV, dtype=torch.bfloat16)
    if scenario in ("eval", "ro_eval"):
        with torch.no_grad():
            cm(x0)
    elif scenario == "eval_grad":
        cm(x0).float().sum()
    elif scenario == "train":
        cm(x0).float().sum().backward()
    elif scenario == "shape":
        cm(x0[: cfg.num_tokens // 2]).float().sum().backward()
    elif scenario == "earlier":
        opt0 = torch.optim.SGD(model.parameters(), lr=0.0)
        earlier = graphstash.graph_step(lambda x: cm(x).float().sum().backward(),
                                        optimizer=opt0, warmup=1)
        for _ in range(3):
            earlier(x0)
        print(f"   earlier: {earlier.stats}")
        earlier.release()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    stash = graphstash.StashConfig(policy="always") if stash_mode else None

    def step(x, p):
        loss = (cm(x).float() * p).sum()
        loss.backward()
        return loss

    train = graphstash.graph_step(step, optimizer=opt, warmup=1 if scenario == "stash1" else 2,
                                  stash=stash,
                                  on_new_shape="recapture" if scenario == "recapture" else "error")
    for _ in range(5):
        train(torch.randn(cfg.num_tokens, cfg.hidden, device=DEV, dtype=torch.bfloat16), proj)
    if scenario == "recapture":
        half = cfg.num_tokens // 2
        for _ in range(3):
            train(torch.randn(half, cfg.hidden, device=DEV, dtype=torch.bfloat16), proj[:half])
    torch.cuda.synchronize()
    return train.stats


def hf(layers: int, tokens: int, stash: str | None, hidden: int, experts: int, ffn: int):
    import transformers as tf

    import graphstash.integrations.transformers as gst

    gst.register()
    cfg = tf.OlmoeConfig(vocab_size=50304, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=ffn,
                         num_experts=experts, num_experts_per_tok=8,
                         max_position_embeddings=4096, eos_token_id=50279, pad_token_id=1)
    with torch.device(DEV):
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                    experts_implementation="graphstash")
    model = model.to(torch.bfloat16)
    gst.configure(model, stash=True)
    cm = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)

    @graphstash.graph_step(optimizer=opt,
                           stash=graphstash.StashConfig(policy=stash) if stash else None)
    def step(ids):
        loss = cm(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    seq = 2048
    losses = []
    for _ in range(5):
        losses.append(step(torch.randint(0, 50304, (tokens // seq, seq), device=DEV)))
    torch.cuda.synchronize()
    print(f"   losses {[round(float(v), 4) for v in losses]}")
    return step.stats


# ---- hazards ----------------------------------------------------------------------------
def hazard_step(hazard, name):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

    @graphstash.graph_step(optimizer=opt, warmup=1)
    def train_step(x):
        h = hazard(x, model(x))
        loss = h.pow(2).mean()
        loss.backward()
        return loss

    x = torch.randn(32, 64, device=DEV)
    train_step(x)
    train_step(x)
    train_step(x)
    return train_step.stats


def hazards(only=None):
    settings = {"scale": 1.0, "calls": 0}
    compiled = torch.compile(lambda h: h * settings["scale"])

    def recompile(x, h):
        settings["calls"] += 1
        if settings["calls"] > 1:
            settings["scale"] = 2.0
        return compiled(h)

    def side_unforked(x, h):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        return h + y

    def side_unjoined(x, h):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        return h + y.sum() * 0

    extra = torch.nn.Parameter(torch.randn(64, device=DEV))
    other = torch.optim.AdamW([extra], lr=1e-3)

    def other_optimizer(x, h):
        other.step()
        return h + extra

    def cupy_null_stream(x, h):
        import cupy
        a = cupy.ones(16)
        return h + float(a.sum()) * 0

    cases = {
        "item": lambda x, h: h * 2 if h.sum().item() > 1e30 else h,
        "synchronize": lambda x, h: (torch.cuda.synchronize(), h)[1],
        "nonzero": lambda x, h: h + torch.nonzero(h > 0).shape[0] * 0,
        "legacy_stream": lambda x, h: h + _on_legacy(x),
        "pageable_copy": lambda x, h: h + torch.ones(64).to(h.device),
        "tensor_device_cuda": lambda x, h: h + torch.tensor(0.5, device=h.device),
        "pinned_alloc": lambda x, h: h + torch.empty(64, pin_memory=True).to(
            h.device, non_blocking=True).mul(0),
        "pin_memory_call": lambda x, h: h + torch.zeros(64).pin_memory().to(
            h.device, non_blocking=True),
        "side_unforked": side_unforked,
        "side_unjoined": side_unjoined,
        "empty_cache": lambda x, h: (torch.cuda.empty_cache(), h)[1],
        "other_optimizer": other_optimizer,
        "recompile": recompile,
        "cpu_tensor_read": lambda x, h: h + h.cpu().sum() * 0,
        "cupy_alloc": cupy_null_stream,
    }
    for name, hazard in cases.items():
        if only is None or name == only:
            run_case(f"hazard {name}", lambda: hazard_step(hazard, name))
            torch.randn(4, device=DEV)      # raises if a failed capture left the RNG capturing


def _on_legacy(x):
    with torch.cuda.stream(torch.cuda.default_stream()):
        return x * 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("moe", "hf", "hazards"))
    parser.add_argument("scenarios", nargs="*")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--stash", default=None, choices=("auto", "always"),
                        help="graph_step(stash=StashConfig(policy=...)); none without")
    parser.add_argument("--only", default=None, help="hazards: run only this one")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, graphstash from {graphstash.__file__}", flush=True)
    if args.what == "moe":
        for scenario in args.scenarios or ["inside", "eval", "eval_grad", "train", "shape",
                                           "earlier", "recapture", "flagged", "stash",
                                           "stash1", "ro", "ro_eval"]:
            run_case(f"moe {scenario}", lambda: moe(scenario))
    elif args.what == "hf":
        run_case(f"hf layers={args.layers} tokens={args.tokens} stash={args.stash}",
                 lambda: hf(args.layers, args.tokens, args.stash, args.hidden, args.experts,
                            args.ffn))
    else:
        hazards(args.only)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
