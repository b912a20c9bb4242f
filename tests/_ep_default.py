"""The documented expert-parallel path, called as README shows it: ``MoEModel(config,
group=g)`` with no ``exchange=``, built on the CPU and moved (device and dtype) afterwards,
against NCCL's chunks (``exchange=None``) and the one-device reference. One function per case,
run by each rank (gloo ranks on the CPU in test_moe_ep_default.py, one rank per GPU in
test_moe_ep_default_gpu.py)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from graphstash.models import MoEConfig, MoEModel

H, F, E, K, T = 16, 24, 8, 2, 48
# outputs (absolute, of values ~1 after the final norm) and gradients (relative to the
# reference's largest): summation orders differ between one device and the exchange. float64
# is the tight check; float32 allows 1e-4, as the eager peer's test does: a CPU whose kernels
# block the one-device reference's 2T-row GEMMs otherwise than the T-row ones was measured
# 3.1e-5 off (the final RMSNorm scales rounding up), while a wrong expert, weight or sign is
# off by O(1)
TOLERANCE = {torch.float64: dict(rtol=0, atol=1e-12), torch.float32: dict(rtol=1e-4, atol=1e-4),
             torch.bfloat16: dict(rtol=0, atol=6e-2)}
GRAD_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def config_for(world: int, **over) -> MoEConfig:
    """Two gated blocks with attention; a budget every routing fits (no rerun to compare)."""
    fields = dict(hidden=H, ffn=F, num_experts=E, topk=K, layers=2, num_tokens=T,
                  capacity_factor=float(world), gated=True, attention=True, heads=2, seq_len=8)
    fields.update(over)
    return MoEConfig(**fields)


def rank_inputs(rank: int, world: int, device, dtype):
    """Every rank's tokens and loss projection (row ``i`` of rank ``r`` from seed ``r``)."""
    xs, projs = [], []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 + r)
        xs.append(torch.randn(T, H, generator=g).to(device, dtype))
        projs.append(torch.randn(T, H, generator=g).to(device, torch.float32))
    return xs, projs


def forward_backward(model, x, proj):
    """Output and loss of a projection loss that reaches every parameter (not the constant
    mean square after the final RMSNorm)."""
    out = model(x)
    (out.float() * proj).sum().backward()
    return out.detach()


def gathered_grads(model: MoEModel, rank: int, world: int) -> dict:
    """Each parameter's gradient as the one-device model holds it: the expert slices
    gathered from every rank, the replicated gradients summed over the ranks."""
    experts = {id(p) for p in model.expert_parameters()}
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if id(p) in experts:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            grads[name] = torch.cat(parts)
        else:
            dist.all_reduce(g)
            grads[name] = g
    return grads


def check_grads(ref, grads: dict, rank: int, dtype) -> None:
    """Every parameter gradient of each model in ``grads`` (``{what: gathered_grads(...)}``)
    within :data:`GRAD_TOLERANCE` of the reference model ``ref``'s, whose gradients must be
    far from zero."""
    for name, q in ref.named_parameters():
        want = q.grad
        assert want.abs().max() > 1e-3, f"reference gradient of {name} is ~0"
        scale = want.abs().max().item()
        for what, got in grads.items():
            err = (got[name] - want).abs().max().item()
            limit = GRAD_TOLERANCE[dtype] * scale
            assert err <= limit, (f"rank {rank} {name} ({what}, {dtype}): max error {err:.3g} "
                                  f"against reference magnitude {scale:.3g}")


def saved_row_counts(model, x) -> list[int]:
    """The row counts of the ``[rows, hidden]`` tensors (parameters left out) autograd saves in
    one forward of ``model`` on tokens ``x`` (``[T, hidden]``), sorted (repeats kept)."""
    rows = []
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t):
        if t.dim() == 2 and t.shape[1] == H and t.data_ptr() not in params:
            rows.append(t.shape[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sorted(rows)


def default_path_case(rank: int, world: int, device: torch.device, dtypes) -> dict:
    """For each dtype in ``dtypes`` (the model is moved to each in turn, so the exchange is
    built and then rebuilt): outputs and every gradient of ``MoEModel(config, group=g)``, and
    of the same with ``resend_rows=True`` (NOTE [resent rows]), equal NCCL's chunks and the
    one-device reference; so do both with the backward pushes in the order the default does
    not take here (NOTE [exchange beside the experts]; on a GPU the default runs them beside
    the expert GEMMs, so the other order is ``overlap_sms=0``; on the CPU the default runs
    them in line, so the other order is ``overlap_sms=1``, the early push home in line), with
    the rows each moved equal to the default's: the early push replaced the dispatch's, it was
    not pushed again. The resent model keeps no received rows, the default one a ``[budget,
    hidden]`` tensor per layer."""
    config = config_for(world)
    group = dist.group.WORLD
    other = 0 if device.type == "cuda" else 1
    configs = {"default": config, "resent": dataclasses.replace(config, resend_rows=True),
               "other order": dataclasses.replace(config, overlap_sms=other),
               "other order, resent": dataclasses.replace(config, overlap_sms=other,
                                                          resend_rows=True)}
    models = {what: MoEModel(c, group=group, seed=3) for what, c in configs.items()}  # README
    kinds, resent_kinds = [], []
    for dtype in dtypes:
        models = {what: m.to(device, dtype) for what, m in models.items()}  # build, then move
        chunks = MoEModel(config, group=group, exchange=None, seed=3).to(device, dtype)
        ref = MoEModel(config, mode="dropless", seed=3).to(device, dtype)
        xs, projs = rank_inputs(rank, world, device, dtype)
        for m in (*models.values(), chunks, ref):
            m.zero_grad(set_to_none=True)
        outs, moved = {}, {}
        for what, m in models.items():
            if m.exchange is not None:
                m.exchange.reset_counters()
            outs[what] = forward_backward(m, xs[rank], projs[rank])
            counters = m.exchange.counters()
            moved[what] = (counters["row_bytes_remote"], counters["row_bytes_local"])
        kinds.append(models["default"].exchange_kind)
        resent_kinds.append(models["resent"].exchange_kind)
        assert moved["other order"] == moved["default"], moved
        assert moved["other order, resent"] == moved["resent"], moved
        out_chunks = forward_backward(chunks, xs[rank], projs[rank])
        out_ref = forward_backward(ref, torch.cat(xs), torch.cat(projs)).chunk(world)[rank]
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out_chunks, out_ref, **tol,
                                   msg=lambda m: f"chunks output vs reference: {m}")
        for what, out in outs.items():
            torch.testing.assert_close(out, out_ref, **tol,
                                       msg=lambda m: f"{what} output vs reference: {m}")
        grads = {what: gathered_grads(m, rank, world) for what, m in models.items()}
        grads["chunks"] = gathered_grads(chunks, rank, world)
        check_grads(ref, grads, rank, dtype)
    # what each keeps: the default model one [budget, hidden] received buffer per layer
    # beside the tokens' [T, hidden] tensors, the resent one only the latter
    kept = saved_row_counts(models["default"], xs[rank])
    received = sorted(set(kept) - {T})
    assert len(received) == 1 and kept.count(received[0]) == config.layers, kept
    assert saved_row_counts(models["other order"], xs[rank]) == kept
    for what in ("resent", "other order, resent"):
        kept_resent = saved_row_counts(models[what], xs[rank])
        assert set(kept_resent) == {T}, (what, kept_resent)
    return {"kinds": kinds, "resent_kinds": resent_kinds, "chunks_kind": chunks.exchange_kind}
