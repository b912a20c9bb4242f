"""The "graphstash" experts backend under a real CUDA graph capture (small sizes).

Qwen3-MoE and Mixtral (bf16, AdamW) trained by :func:`graphstash.graph_step` against eager
training with transformers' own ``grouped_mm`` backend from the same weights and batches: the
whole step is captured once and replayed; forced over budget, every replay is flagged and
rerun dropless; with a stash manager, the experts' activations are stashed; Mixtral with
router jitter, the auxiliary loss and an attention mask captures too. ``ep_capture_case`` is
the captured expert-parallel case the NCCL test of ``test_hf_transformers.py`` runs.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (the hf / dev extra)")

import graphstash                                          # noqa: E402
import graphstash.integrations.transformers as gst         # noqa: E402

from _hf_models import batch, seed_of, tiny_model, twin    # noqa: E402

pytestmark = pytest.mark.gpu
STEPS, WARMUP = 6, 2
BF16_RTOL = 1e-2


def _batches(gen, n=STEPS, batch_size=4, seq_len=64):
    return [batch(gen, batch_size=batch_size, seq_len=seq_len, device="cuda") for _ in range(n)]


def _eager_hf(model, data, lr, call_kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for ids in data:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False, **call_kwargs(ids)).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _graphed(model, data, lr, call_kwargs, **step_kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)

    @graphstash.graph_step(optimizer=opt, warmup=WARMUP, **step_kwargs)
    def train_step(ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False, **call_kwargs(ids)).loss
        loss.backward()
        return loss.detach()

    return train_step, [float(train_step(ids)) for ids in data]


def _no_kwargs(ids):
    return {}


def _check_losses(got, want):
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= BF16_RTOL * abs(b), f"step {step}: {a} vs HF grouped_mm {b}"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("case", ["budget", "over_budget", "stash"])
def test_captured_training_matches_hf_grouped_mm(gen, name, case):
    ref = tiny_model(name, seed_of(gen), dtype=torch.bfloat16, device="cuda")
    ours = twin(ref, gst.IMPLEMENTATION)
    gst.configure(ours, capacity_factor=0.5 if case == "over_budget" else 1.25)
    # stash: 1024 tokens, so the experts' budget-sized tensors (2048 rows) pass the stash's
    # 64 KiB minimum
    data = _batches(gen, batch_size=8, seq_len=128) if case == "stash" else _batches(gen)
    # policy "always": one device's budget has no dead rows, so "auto" would not stash
    extra = {"stash": graphstash.StashConfig(page_size=16, policy="always")} \
        if case == "stash" else {}
    train_step, losses = _graphed(ours, data, 1e-3, _no_kwargs, **extra)
    want = _eager_hf(ref, data, 1e-3, _no_kwargs)
    _check_losses(losses, want)
    stats = train_step.stats
    assert stats.captures == 1 and stats.replays == STEPS - WARMUP, stats
    flagged = case == "over_budget"
    assert stats.over_budget == (STEPS if flagged else 0), stats
    assert stats.eager_reruns == (STEPS if flagged else 0), stats
    if case == "stash":
        names = {entry[2] for entry in train_step.stash_manager.schedule}
        assert names == {f"model.layers.{i}.mlp.experts" for i in range(2)}, names
        assert not train_step.stash_manager.read_status()["overflow"]


def test_router_jitter_aux_loss_and_mask_capture(gen):
    """Mixtral in training mode with router jitter and the load-balancing loss; the all-ones
    attention mask keeps transformers 5.17's auxiliary loss off torch.bincount (NOTE [capture
    hazards in HF MoE models])."""
    ref = tiny_model("mixtral", seed_of(gen), dtype=torch.bfloat16, device="cuda",
                     router_jitter_noise=0.01, output_router_logits=True,
                     router_aux_loss_coef=0.1)
    ours = twin(ref, gst.IMPLEMENTATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # the bincount warning: handled
        gst.configure(ours)
    data = _batches(gen)

    def with_mask(ids):
        return {"attention_mask": torch.ones_like(ids)}

    torch.manual_seed(seed_of(gen))
    train_step, losses = _graphed(ours, data, 1e-3, with_mask)
    want = _eager_hf(ref, data, 1e-3, with_mask)
    _check_losses(losses, want)
    assert train_step.stats.captures == 1 and train_step.stats.over_budget == 0


def ep_capture_case(rank: int, device, seed: int, world: int):
    """Expert parallel under graph_step (fp32, SGD): rank ``r`` trains on its own batches with
    the sharded model (replicated gradients averaged with all_reduce inside the step, expert
    gradients divided by the world size: the gradient of the mean loss over ranks); the control
    is the full model on one device taking, every step, the mean loss of all ranks' batches.
    Losses per step and every parameter after the steps must agree."""
    import torch.distributed as dist

    ref = tiny_model("qwen3_moe", seed, device=device)
    ref.set_experts_implementation("eager")
    ours = twin(ref, gst.IMPLEMENTATION)
    names = gst.configure(ours, capacity_factor=float(world), group=dist.group.WORLD)
    expert_params = {f"{n}.{p}" for n in names for p in ("gate_up_proj", "down_proj")}
    gens = [torch.Generator().manual_seed(seed + 10 + r) for r in range(world)]
    data = [[batch(g, device=device) for _ in range(STEPS)] for g in gens]

    opt = torch.optim.SGD(ours.parameters(), lr=0.5)

    @graphstash.graph_step(optimizer=opt, warmup=WARMUP)
    def train_step(ids):
        loss = ours(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        for pname, p in ours.named_parameters():
            if pname in expert_params:
                p.grad.div_(world)                     # the sum over ranks' tokens, averaged
            else:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        return loss.detach()

    losses = [float(train_step(ids)) for ids in data[rank]]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for step in range(STEPS):
        ref_opt.zero_grad(set_to_none=True)
        for r in range(world):
            ids = data[r][step]
            loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
            (loss / world).backward()
            if r == rank:
                want.append(float(loss))
        ref_opt.step()
    assert train_step.stats.captures == 1 and train_step.stats.replays == STEPS - WARMUP
    for step, (a, b) in enumerate(zip(losses, want)):
        assert abs(a - b) <= 1e-4 * abs(b), f"rank {rank} step {step}: {a} vs {b}"
    local = ref.config.num_experts // world
    sl = slice(rank * local, (rank + 1) * local)
    for (pname, a), b in zip(ours.named_parameters(), ref.parameters()):
        want_p = b[sl] if pname in expert_params else b
        torch.testing.assert_close(a, want_p, rtol=1e-4, atol=1e-5, msg=pname)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4", "gemma4", "nemotron_h", "aria",
                                    "muse_spark", "inkling2", "qwen3_moe"])
def test_matrix_families_on_the_gpu_match_the_default_implementation(family):
    """The compatibility matrix's check on CUDA (float32, the CuPy expert kernels: every
    activation kind, interleaved rows, biases, transposed weights, a post-expert norm) against
    transformers' default experts implementation: 5e-5 relative (the CPU's matrix holds 1e-5;
    on an H100, gemma4's GELU-tanh expert gradients differed by 1.2e-5, tanhf in the kernel
    against torch's), the experts' share large."""
    from graphstash.tools import hf_families, hf_matrix

    if family not in hf_families.families():
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {family}")
    row = hf_matrix.check(family, device="cuda", rtol=5e-5)
    assert row.status == "matches", row
    assert row.share > hf_matrix.MIN_SHARE, row
