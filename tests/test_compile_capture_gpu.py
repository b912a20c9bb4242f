"""graph_step over torch.compile'd models on the GPU: real captures (NOTE [compile and
capture] in graphstash/graph/compile_guard.py).

Each scenario compiles the model at another moment (inside graph_step's warmup, by an eval
pass, by a train pass, at another input shape, by an earlier graph_step) and then trains it
under graph_step: the step is captured once, replayed, and its losses and weights equal those
of the same model trained eagerly without torch.compile (float32: the losses within 1e-4
relative; the loss is a fixed random projection of the output, which reaches every
parameter). Budget and stash modes, the reference model and HuggingFace OLMoE / Qwen3-MoE on
the graphstash experts backend; in bf16 the graphed compiled step is compared with the same
compiled model trained eagerly (Inductor and eager round bf16 differently: NOTE
[compiled-vs-eager tolerances] in tests/_compile_data.py).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import graphstash
from graphstash.errors import CaptureError
from graphstash.models import MoEConfig, MoEModel

pytestmark = pytest.mark.gpu

CONFIG = MoEConfig(hidden=128, ffn=256, num_experts=8, topk=2, layers=2, num_tokens=512,
                   capacity_factor=2.0, gated=True)
# a pool of pages of 16 rows for every budget-sized saved tensor; the plan stashes every group
STASH = dict(page_size=16, min_tensor_bytes=0, policy="always")
STEPS, WARMUP = 6, 2
LR = 1e-3
RTOL = 1e-4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, fused=True, capturable=True)


def _data(gen, n=STEPS, tokens=CONFIG.num_tokens, dtype=torch.float32):
    """Fresh random tokens per step, and a fixed random projection of the output."""
    xs = [torch.randn(tokens, CONFIG.hidden, generator=gen).to("cuda", dtype) for _ in range(n)]
    proj = torch.randn(tokens, CONFIG.hidden, generator=gen).cuda()
    return xs, proj


def _eager(model, xs, proj, stash=None):
    """The control: a plain eager loop (with a stash manager around the steps in stash mode)."""
    opt = _adamw(model.parameters())
    manager = graphstash.StashManager(graphstash.StashConfig(**STASH)) if stash else None
    losses, grads = [], None
    for x in xs:
        opt.zero_grad(set_to_none=True)
        if manager is not None:
            manager.begin_step()
            with manager:
                loss = (model(x).float() * proj).sum()
                loss.backward()
            manager.end_step()
        else:
            loss = (model(x).float() * proj).sum()
            loss.backward()
        if grads is None:
            grads = [p.grad.float().abs().max() for p in model.parameters()]
        opt.step()
        losses.append(loss.detach())
    assert min(float(g) for g in grads) > 1e-4, "the loss does not reach every parameter"
    return torch.stack(losses)


def _compile_before(compiled, how, gen, mode):
    manager = (graphstash.StashManager(graphstash.StashConfig(**STASH)) if mode == "stash"
               else None)

    def run(fn):
        if manager is None:
            return fn()
        manager.begin_step()
        with manager:
            fn()
        manager.end_step()

    tokens = CONFIG.num_tokens // 2 if how == "shape" else CONFIG.num_tokens
    x = torch.randn(tokens, CONFIG.hidden, generator=gen).cuda()
    if how == "eval":
        with torch.no_grad():
            run(lambda: compiled(x))
    elif how in ("train", "shape"):
        run(lambda: compiled(x).sum().backward())
    elif how == "earlier_step":
        opt0 = torch.optim.SGD(compiled.parameters(), lr=0.0)       # changes nothing
        stash = graphstash.StashConfig(**STASH) if mode == "stash" else None
        earlier = graphstash.graph_step(lambda x: compiled(x).sum().backward(), optimizer=opt0,
                                        warmup=1, stash=stash)
        for _ in range(3):
            earlier(x)
        assert earlier.stats.captures == 1
        earlier.release()
    for p in compiled.parameters():
        p.grad = None


def _graphed(compiled, model, xs, proj, mode, **kwargs):
    opt = _adamw(model.parameters())
    stash = graphstash.StashConfig(**STASH) if mode == "stash" else None

    @graphstash.graph_step(optimizer=opt, warmup=WARMUP, stash=stash, **kwargs)
    def train_step(x):
        loss = (compiled(x).float() * proj).sum()
        loss.backward()
        return loss

    losses = torch.stack([train_step(x) for x in xs])
    return train_step, losses


@pytest.mark.parametrize("mode", ["budget", "stash"])
@pytest.mark.parametrize("before", ["inside", "eval", "train", "shape", "earlier_step"])
def test_compiled_model_captures_whenever_it_was_compiled(gen, mode, before):
    seed = int(torch.randint(1 << 20, (1,), generator=gen))
    model = MoEModel(CONFIG, mode=mode, seed=seed, device="cuda")
    control = copy.deepcopy(model)
    compiled = torch.compile(model)
    if before != "inside":
        _compile_before(compiled, before, gen, mode)
    xs, proj = _data(gen)
    train_step, losses = _graphed(compiled, model, xs, proj, mode)
    stats = train_step.stats
    assert stats.captures == 1 and stats.replays == STEPS - WARMUP, stats
    assert stats.eager_steps == WARMUP and stats.steps == STEPS, stats
    if mode == "stash":
        assert train_step.stash_manager.read_status()["buffers"], "nothing was stashed"
    want = _eager(control, xs, proj, stash=mode == "stash")
    torch.testing.assert_close(losses, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


def test_new_shape_is_captured_after_one_eager_call(gen):
    """on_new_shape='recapture': the first call of a new shape runs eagerly (where the model
    recompiles for it), the second captures; both shapes then replay."""
    model = MoEModel(CONFIG, mode="budget", seed=5, device="cuda")
    compiled = torch.compile(model)
    xs, proj = _data(gen, n=4)
    small = [torch.randn(CONFIG.num_tokens // 2, CONFIG.hidden, generator=gen).cuda()
             for _ in range(3)]
    proj_small = proj[: CONFIG.num_tokens // 2]
    opt = _adamw(model.parameters())

    @graphstash.graph_step(optimizer=opt, warmup=WARMUP, on_new_shape="recapture")
    def train_step(x, p):
        loss = (compiled(x).float() * p).sum()
        loss.backward()
        return loss

    for x in xs:
        train_step(x, proj)
    for x in small:
        train_step(x, proj_small)
    train_step(xs[0], proj)
    stats = train_step.stats
    assert stats.captures == 2 and stats.eager_steps == WARMUP + 1, stats
    assert stats.replays == (len(xs) - WARMUP) + (len(small) - 1) + 1, stats


def test_recompile_inside_the_capture_is_refused_naming_the_guard(gen):
    settings = {"scale": 1.0}
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).cuda()

    def forward(x):
        return model(x) * settings["scale"]

    compiled = torch.compile(forward)
    opt = _adamw(model.parameters())

    @graphstash.graph_step(optimizer=opt, warmup=WARMUP)
    def train_step(x):
        loss = compiled(x).pow(2).mean()
        loss.backward()
        return loss

    x = torch.randn(32, 64, generator=gen).cuda()
    for _ in range(WARMUP):
        train_step(x)
    settings["scale"] = 2.0                 # changed after the warmup: a guard fails
    weights = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(CaptureError) as info:
        train_step(x)
    assert info.value.cause == "compile"
    message = str(info.value)
    assert "train_step failed at" in message and "forward" in message
    assert "guard that failed" in message and "scale" in message
    del info
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 2**20
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert train_step.stats.graphs == 0 and train_step.stats.steps == WARMUP
    settings["scale"] = 1.0                 # the warmup's value again: captures
    train_step(x)
    assert train_step.stats.captures == 1


def test_reduce_overhead_inside_graph_step_is_refused_with_its_reason(gen):
    """torch.compile(mode="reduce-overhead") records and replays CUDA graphs of its own, which
    cannot run inside graph_step's capture: refused, naming the mode."""
    model = MoEModel(CONFIG, mode="budget", seed=7, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    xs, proj = _data(gen, n=3)
    with pytest.raises(CaptureError) as info:
        _graphed(compiled, model, xs, proj, "budget")
    assert info.value.cause == "compile", info.value
    assert "reduce-overhead" in str(info.value)


# ---- HuggingFace models on the graphstash experts backend ------------------------------
def _hf_models(name, gen, dtype):
    pytest.importorskip("transformers", reason="needs transformers (the hf / dev extra)")
    import graphstash.integrations.transformers as gst

    from _hf_models import seed_of, tiny_model, twin

    ref = tiny_model(name, seed_of(gen), dtype=dtype, device="cuda")
    models = []
    for _ in range(2):
        model = twin(ref, gst.IMPLEMENTATION)
        gst.configure(model, stash=True)
        models.append(model)
    return models


def _hf_train(model, forward, batches, stash, graphed=True):
    opt = _adamw(model.parameters())

    def train_step(ids):
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    if not graphed:
        losses = []
        manager = graphstash.StashManager(graphstash.StashConfig(**STASH)) if stash else None
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            if manager is not None:
                manager.begin_step()
                with manager:
                    losses.append(train_step(ids).detach())
                manager.end_step()
            else:
                losses.append(train_step(ids).detach())
            opt.step()
        return None, torch.stack(losses)
    step = graphstash.graph_step(train_step, optimizer=opt, warmup=WARMUP,
                                 stash=graphstash.StashConfig(**STASH) if stash else None)
    return step, torch.stack([step(ids) for ids in batches])


@pytest.mark.parametrize("stash", [False, True])
@pytest.mark.parametrize("name", ["olmoe", "qwen3_moe"])
def test_compiled_hf_model_captures(gen, name, stash):
    """``torch.compile(model)`` of a HuggingFace MoE on the graphstash experts backend, inside
    graph_step's warmup, with and without a stash (float32): captured once, replayed, losses
    equal the same model trained eagerly and uncompiled."""
    from _hf_models import batch

    ours, control = _hf_models(name, gen, torch.float32)
    batches = [batch(gen, batch_size=4, seq_len=64, device="cuda") for _ in range(STEPS)]
    step, losses = _hf_train(ours, torch.compile(ours), batches, stash)
    assert step.stats.captures == 1 and step.stats.replays == STEPS - WARMUP, step.stats
    if stash:
        assert step.stash_manager.read_status()["buffers"], "nothing was stashed"
    _, want = _hf_train(control, control, batches, stash, graphed=False)
    torch.testing.assert_close(losses, want, rtol=RTOL, atol=0)


def test_compiled_hf_model_bf16_graphed_equals_compiled_eager(gen):
    """bf16 OLMoE, compiled, with a stash: the captured step replays what the same compiled
    model computes eagerly."""
    from _hf_models import batch

    ours, control = _hf_models("olmoe", gen, torch.bfloat16)
    batches = [batch(gen, batch_size=4, seq_len=128, device="cuda") for _ in range(STEPS)]
    step, losses = _hf_train(ours, torch.compile(ours), batches, stash=True)
    assert step.stats.captures == 1, step.stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, want = _hf_train(control, torch.compile(control), batches, stash=True, graphed=False)
    torch.testing.assert_close(losses, want, rtol=1e-2, atol=0)
