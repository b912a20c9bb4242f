"""``python -m graphstash.tools.hf_matrix``: the compatibility matrix of the ``"graphstash"``
experts backend over every transformers MoE family whose experts use the experts interface.

Each family is built tiny from its own default config (:mod:`graphstash.tools.hf_families`),
float32 on the CPU, once with transformers' default experts implementation and once with
``experts_implementation="graphstash"`` on the same weights; both run forward and backward on
the same tokens, with a loss that reaches every parameter (a fixed random projection of the
output), then one SGD step (no parameter moves by more than 5e-4) and a second forward. A family *matches* when the outputs, the
expert gradients and the outputs after the step agree within 3e-5 relative to their scale and
the experts' share of the output is large (the output without the experts differs from it by
more than :data:`MIN_SHARE` of its scale). ``--write`` writes the table to
``docs/hf-compatibility.md``; ``--family`` checks some families only.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from . import hf_families

__all__ = ["MIN_SHARE", "RTOL", "Row", "check", "main", "markdown"]

RTOL = 3e-5            # float32 rounding in other orders (docs/hf-compatibility.md)
MIN_SHARE = 0.05
_STEP = 5e-4            # the SGD step moves no parameter by more than this
_DOC = Path(__file__).resolve().parents[2] / "docs" / "hf-compatibility.md"


@dataclasses.dataclass
class Row:
    """One family's result: ``status`` is ``"matches"``, ``"differs"``, ``"refused"`` (the
    backend's reason in ``detail``) or ``"error"`` (the tiny model does not build or run)."""
    family: str
    status: str
    uses: str = ""
    output_error: float = float("nan")
    grad_error: float = float("nan")
    step_error: float = float("nan")
    share: float = float("nan")
    detail: str = ""


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.detach().abs().max().clamp(min=1e-30))
    return float((got.detach() - want.detach()).abs().max()) / scale


def _output(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _experts(model) -> list:
    import graphstash.integrations.transformers as gst

    return [m for _, m in gst.experts_modules(model)]


def _uses(model) -> str:
    from graphstash.integrations.hf_gates import read_layout

    module = _experts(model)[0]
    layout = read_layout(module)
    act = layout.activation
    parts = [act.kind + ("" if module.has_gate else " (plain)")]
    if act.kind == "glu_alpha":
        parts[0] += f" α={act.alpha:g}"
    if act.kind == "softcap_silu":
        parts[0] += f" cap={act.gate_cap:g}"
    if act.gate_limit != float("inf") or act.up_limit != float("inf"):
        parts.append(f"clamp {act.gate_limit:g}/{act.up_limit:g}")
    if act.up_cap:
        parts.append(f"up cap {act.up_cap:g}")
    if act.up_offset:
        parts.append(f"up+{act.up_offset:g}")
    for flag, text in ((layout.interleaved, "interleaved"), (layout.transposed, "transposed"),
                       (layout.has_bias, "biases"), (layout.post_norm is not None,
                                                     "post-expert norm")):
        if flag:
            parts.append(text)
    return ", ".join(parts)


def _share(model, ids: torch.Tensor, out: torch.Tensor) -> float:
    """How much of ``out`` the experts make: the output with every experts module's output
    zeroed, against ``out``, relative to ``out``'s scale."""
    handles = [m.register_forward_hook(lambda mod, args, result: torch.zeros_like(result))
               for m in _experts(model)]
    try:
        with torch.no_grad():
            without = _output(model, ids)
    finally:
        for h in handles:
            h.remove()
    return _rel(without, out)


def check(family: str, seed: int = 0, device="cpu", rtol: float = RTOL) -> Row:
    """Build ``family`` tiny with the default experts implementation and with graphstash's,
    and compare them (module docstring), on ``device`` (float32); ``rtol``: the largest
    relative error that still matches."""
    import graphstash.integrations.transformers as gst

    gst.register()
    try:
        ref = hf_families.tiny_model(family, None, seed).to(device)
    except Exception as exc:                   # noqa: BLE001 - reported in the matrix
        return Row(family, "error", detail=f"default build: {type(exc).__name__}: {exc}")
    try:
        ours = hf_families.tiny_model(family, gst.IMPLEMENTATION, seed).to(device)
    except ValueError as exc:
        return Row(family, "refused", detail=str(exc))
    ours.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, hf_families.VOCAB - 8, (2, 16), generator=gen).to(device)
    row = Row(family, "matches", uses=_uses(ours))
    outputs, grads = [], []
    for model in (ref, ours):
        out = _output(model, ids)
        projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2))
        projection = projection.to(out.device)
        (out * projection).sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    row.output_error = _rel(outputs[1], outputs[0])
    expert_params = {n for n, p in ours.named_parameters()
                     if any(p is q for m in _experts(ours) for q in m.parameters())}
    errors = []
    for name in expert_params:
        want, got = grads[0].get(name), grads[1].get(name)
        if want is None or float(want.abs().max()) == 0:      # experts no token reaches
            if got is not None and float(got.abs().max()) != 0:
                return Row(family, "differs", row.uses, detail=f"a gradient reaches {name}")
            continue
        errors.append(_rel(got, want))
    if not errors:
        return Row(family, "differs", row.uses, detail="no gradient reaches the experts")
    row.grad_error = max(errors)
    row.share = _share(ref, ids, outputs[0])
    # one SGD step, its rate set by the reference's largest gradient (the same for both)
    lr = _STEP / max(float(g.abs().max()) for g in grads[0].values())
    for model in (ref, ours):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
    with torch.no_grad():
        row.step_error = _rel(_output(ours, ids), _output(ref, ids))
    worst = max(row.output_error, row.grad_error, row.step_error)
    if not worst <= rtol or not row.share > MIN_SHARE:
        row.status = "differs"
    return row


def markdown(rows: list[Row]) -> str:
    """The matrix as a markdown table, with a summary line."""
    import transformers

    counts = {s: sum(r.status == s for r in rows) for s in ("matches", "differs", "refused",
                                                            "error")}
    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, "
             f"float32: {len(rows)} families; " + ", ".join(f"{n} {s}" for s, n in
                                                            counts.items()) + ".", "",
             "| family | status | what its experts use | output | expert grads | after a step "
             "| experts' share |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r.status if not r.detail else f"{r.status}: {r.detail}"
        lines.append(f"| {r.family} | {status} | {r.uses} | {r.output_error:.1e} | "
                     f"{r.grad_error:.1e} | {r.step_error:.1e} | {r.share:.2f} |")
    return "\n".join(lines) + "\n"


_HEADER = """# transformers MoE families under `experts_implementation="graphstash"`

Every transformers model family whose experts use the experts interface
(`@use_experts_implementation`), built tiny from its own default config (float32, CPU, expert
weights scaled up so that the experts make a large share of the output), run with transformers'
default experts implementation and with graphstash's on the same weights: the largest
relative error of the output, of the expert gradients (a loss that is a fixed random
projection of the output) and of the output after one SGD step, and the experts' share of the
output (how far the output moves when the experts' output is zeroed). A family matches when
the three errors are at most 3e-5 and the share is above 0.05. (Both implementations round in
float32, in other orders: Gemma-4's expert gradients differ by 6.5e-6 on one CPU and 1.12e-5
on another, transformers 5.24 and 5.17; so 1e-5 failed where nothing was wrong. The experts'
output rounded to bfloat16, a defect this must catch, is off by 2e-3 (Qwen3-MoE) to 2e-2.)

Regenerate with `python -m graphstash.tools.hf_matrix --write`; the test is
`tests/test_hf_matrix.py`.

"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphstash.tools.hf_matrix",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", help="check this family (repeatable)")
    parser.add_argument("--write", action="store_true", help=f"write {_DOC.name} in docs/")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for family in args.family or hf_families.families():
        row = check(family)
        rows.append(row)
        print(f"{family}: {row.status} {row.uses} out {row.output_error:.1e} grad "
              f"{row.grad_error:.1e} step {row.step_error:.1e} share {row.share:.2f} "
              f"{row.detail}", file=sys.stderr, flush=True)
    table = markdown(rows)
    print(table)
    if args.write:
        _DOC.write_text(_HEADER + table, encoding="utf-8")
    return 0 if all(r.status == "matches" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
