"""One owner for the step's status (graphstash/status.py): validation, the current step
(NOTE [current step]), flags combined across ranks through a registered reducer (NOTE [flags
across ranks]), and over-budget flags that reach whoever reads them in eager use (NOTE [eager
over budget])."""
from __future__ import annotations

import warnings

import pytest
import torch

import graphstash
from graphstash import _layout as L
from graphstash.errors import OverBudgetError
from graphstash.models import MoEConfig, MoEModel
from graphstash.moe import budget_rows, default_status, dispatch
from graphstash.stash import StashConfig, StashManager
from graphstash.status import StepStatus, check_status, current

from _grad_checks import projected_loss, projection
from _moe_data import routing, tokens


def _models(capacity_factor: float, seed: int):
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=2, num_tokens=40,
                       capacity_factor=capacity_factor, gated=True)
    budget = MoEModel(config, mode="budget", seed=seed)          # no status= passed
    control = MoEModel(config, mode="dropless", seed=seed)
    control.load_state_dict(budget.state_dict())
    return config, budget, control


def _projection(config, gen, device="cpu"):
    """The loss's fixed random projection of the output: it reaches every parameter (the mean
    square of the final RMSNorm's output would be constant)."""
    return projection((config.num_tokens, config.hidden), gen, device) / config.num_tokens


def _train(model, x, proj, steps_of=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x):
        loss = projected_loss(model(x), proj)
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)    # "runs eagerly without a CUDA graph"
        train_step = graphstash.graph_step(step, optimizer=opt, warmup=1)
        losses = [train_step(xi) for xi in x]
    return train_step, losses


def _eager_control(model, x, proj):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for xi in x:
        opt.zero_grad(set_to_none=True)
        loss = projected_loss(model(xi), proj)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("capacity_factor,flagged", [(0.4, True), (2.0, False)])
def test_moe_model_over_budget_reaches_step_without_wiring(gen, capacity_factor, flagged):
    """capacity 0.4 x T*K rows: the first step drops rows, is flagged through the step's
    status, reruns dropless and updates once, and the budgets grow to what the routing needed
    (NOTE [adaptive budgets]), so the next steps fit: exactly as eager dropless training;
    capacity 2: never flagged, and the budget forward is the dropless one."""
    config, model, control = _models(capacity_factor, seed=int(torch.randint(100, (1,),
                                                                               generator=gen)))
    x = [tokens(config.num_tokens, config.hidden, gen, offset=40 * i) / config.num_tokens
         for i in range(3)]
    proj = _projection(config, gen)
    module_status = default_status("cpu")
    module_status.zero_()
    initial = [p.detach().clone() for p in model.parameters()]
    train_step, losses = _train(model, x, proj)
    want = _eager_control(control, x, proj)
    stats = train_step.stats
    assert stats.steps == 3
    assert stats.over_budget == (1 if flagged else 0)
    assert stats.eager_reruns == (1 if flagged else 0)
    grown = [s["capacity_factor"] > capacity_factor for s in model.budgets.stats()]
    assert all(grown) if flagged else not any(grown)
    assert int(module_status[L.SS_OVER_BUDGET]) == 0     # the flag went to the step's status
    for got, ref in zip(losses, want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for (name, a), b, a0 in zip(model.named_parameters(), control.parameters(), initial):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        assert float((a - a0).detach().abs().max()) > 1e-4, name   # updates reached it


def test_default_status_is_the_running_steps(gen):
    x = tokens(12, 8, gen)
    idx, w = routing(12, 2, 4, gen)
    mine = StepStatus("cpu")
    assert current() is None
    with mine.activate():
        assert default_status("cpu") is mine.tensor
        assert current(torch.device("cpu")) is mine
        assert current(torch.device("meta")) is None         # another device: not it
        dispatch(x, idx, w, 4, budget=5)                     # 24 rows asked, 5 kept
    assert current() is None and default_status("cpu") is not mine.tensor
    assert mine.read() == {"overflow": 0, "host_spill": False, "over_budget": True,
                           "tokens_peak": 24}


def test_one_owner_per_status_tensor():
    """The graph step, its stash manager and the manager's buffers share one status and one
    owner (NOTE [status owner])."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step = graphstash.graph_step(lambda: None, stash=StashConfig(), device="cpu")
        manager = step.stash_manager
    assert step.status is manager.status is step.step_status.tensor
    assert manager.step_status is step.step_status
    assert StepStatus.of(step.status) is step.step_status
    assert StepStatus.adopt(step.status) is step.step_status
    shared = StashManager(device="cpu", status=step.step_status)
    assert shared.step_status is step.step_status
    buf = graphstash.PagedStashBuffer(64, 4, dtype=torch.float32, device="cpu", page_size=8,
                                      status=step.step_status)
    assert buf.status is step.status


@pytest.mark.parametrize("bad, error, match", [
    ("x", TypeError, "status: expected an int32 tensor of shape \\(8,\\) on cpu .*got str"),
    (torch.zeros(8, dtype=torch.int64), ValueError, "status: expected an int32 tensor"),
    (torch.zeros(3, dtype=torch.int32), ValueError, "status: expected an int32 tensor"),
    (torch.zeros(16, dtype=torch.int32)[::2], ValueError, "status: expected a contiguous"),
])
def test_one_validator_for_status_arguments(gen, bad, error, match):
    """dispatch, grouped_mm and check_status refuse the same bad statuses the same way; on the
    CPU too (grouped_mm(status='x') used to be accepted there)."""
    from graphstash.moe import grouped_mm

    with pytest.raises(error, match=match):
        check_status("status", bad, torch.device("cpu"))
    x = tokens(6, 4, gen)
    idx, w = routing(6, 2, 3, gen)
    with pytest.raises(error, match=match):
        dispatch(x, idx, w, 3, budget=20, status=bad)
    with pytest.raises(error, match=match):
        grouped_mm(x, torch.rand(2, 5, 4, generator=gen),
                   torch.tensor([3, 3], dtype=torch.int32), status=bad)


def test_default_status_on_cuda_without_cuda_names_device():
    if torch.cuda.is_available():
        pytest.skip("checks the error a machine without CUDA gives")
    with pytest.raises(ValueError, match="device: 'cuda' requested but torch sees no CUDA"):
        default_status("cuda")
    with pytest.raises(TypeError, match="device: expected a torch.device"):
        default_status(3.5)


class OtherRanks:
    """A FlagReducer standing for a transport: adds the flags the other ranks raised."""

    def __init__(self):
        self.others = torch.zeros(3, dtype=torch.int32)
        self.calls = 0

    def all_reduce_flags_(self, flags: torch.Tensor) -> None:
        self.calls += 1
        flags.add_(self.others)


def test_registered_reducer_combines_the_flags_of_a_step(gen):
    """A step whose own flags are clear but whose reducer reports another rank over budget is
    rerun dropless, as every rank must (NOTE [flags across ranks]); with distributed=False
    the reducer is not asked."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    reducer = OtherRanks()
    reruns = []

    def step(x):
        reruns.append(graphstash.is_dropless())
        loss = (model(x) * torch.ones(8)).sum()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train_step = graphstash.graph_step(step, optimizer=opt, warmup=1, device="cpu")
        train_step.step_status.register_reducer(reducer)
        train_step(torch.randn(4, 8, generator=gen))
        reducer.others[L.SS_OVER_BUDGET] = 1                 # another rank dropped rows
        train_step(torch.randn(4, 8, generator=gen))
    stats = train_step.stats
    assert reducer.calls == 2 and stats.steps == 2
    assert (stats.over_budget, stats.eager_reruns) == (1, 1) and reruns == [False, False, True]
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    train_step.step_status.register_reducer(reducer)         # the same one again: fine
    with pytest.raises(ValueError, match="reducer: this status already combines"):
        train_step.step_status.register_reducer(OtherRanks())
    with pytest.raises(TypeError, match="reducer: expected an object with all_reduce_flags_"):
        train_step.step_status.register_reducer(object())
    train_step.step_status.register_reducer(None)
    assert train_step.step_status.reducer is None
    alone = StepStatus("cpu")
    alone.register_reducer(reducer)
    assert alone.reduced_flags(distributed=False)[:3].tolist() == [0, 0, 0]
    assert alone.reduced_flags()[:3].tolist() == [0, 0, 1]


def _tight(gen, T=40, E=4, K=2):
    x = tokens(T, 8, gen)
    idx, w = routing(T, K, E, gen, skew=3.0)
    return x, idx, w, E, budget_rows(T, K, E, capacity_factor=0.3)


@pytest.mark.parametrize("eager_overflow", ["raise", "warn"])
def test_eager_manager_sees_over_budget_at_end_step(gen, eager_overflow):
    """Issue 27.9: a dispatch over budget inside an eager `with StashManager:` loop used to
    flag only the module default; now end_step() reports it (sticky until clear_status())."""
    x, idx, w, E, budget = _tight(gen)
    manager = StashManager(device="cpu", eager_overflow=eager_overflow)
    default_status("cpu").zero_()
    manager.begin_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # no call-site warning here
        with manager:
            dispatch(x, idx, w, E, budget=budget)
    assert int(default_status("cpu")[L.SS_OVER_BUDGET]) == 0
    if eager_overflow == "raise":
        with pytest.raises(OverBudgetError, match="dropped the rest"):
            manager.end_step()
        manager.begin_step()
        with pytest.raises(OverBudgetError):                # sticky
            manager.end_step()
    else:
        with pytest.warns(RuntimeWarning, match="routed more rows than its static budget"):
            manager.end_step()
    manager.clear_status()
    manager.begin_step()
    with manager:
        dispatch(x, idx, w, E, budget=budget_rows(40, 2, E, capacity_factor=1.0))
    manager.end_step()                                      # fits: nothing to report


def test_over_budget_outside_any_step_warns_once_per_call_site(gen):
    """Issue 27.9: outside graph_step, a manager and status=, an over-budget dispatch warns,
    naming where it was called from; a budget that holds any routing is never read back."""
    x, idx, w, E, budget = _tight(gen)
    with pytest.warns(RuntimeWarning, match="more rows than the budget") as caught:
        dispatch(x, idx, w, E, budget=budget)
    assert caught[0].filename == __file__
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")                    # the default filter
        for _ in range(3):
            dispatch(x, idx, w, E, budget=budget)           # one call site: one warning
        dispatch(x, idx, w, E, budget=budget)               # another call site
    assert len([s for s in seen if "more rows than the budget" in str(s.message)]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch(x, idx, w, E, budget=budget_rows(40, 2, E, capacity_factor=1.0))
        dispatch(x, idx, w, E, budget=budget, status=StepStatus("cpu").tensor)   # given


def test_budget_model_in_eval_warns_instead_of_changing_logits_quietly(gen):
    """Issue 27.9: a budget-mode MoEModel used outside training (eval) with a budget below
    the routed rows changes its outputs; it now says so at the caller's line."""
    config = MoEConfig(hidden=16, ffn=24, num_experts=4, topk=2, layers=2, num_tokens=40,
                       capacity_factor=0.3)
    model = MoEModel(config, mode="budget", seed=1).eval()
    x = tokens(40, 16, gen) / 40
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="more rows than the budget") as w:
        model(x)
    assert w[0].filename == __file__


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor,flagged", [(0.4, True), (2.0, False)])
def test_moe_model_captured_over_budget_reruns_without_wiring(gen, capacity_factor, flagged):
    """The same on a GPU with the step captured: the 0.4 budget is flagged through the step's
    status at the first step, skipped on the device and rerun dropless; the budgets grow, one
    eager step runs at their new sizes and the graph captured then replays without a rerun;
    losses and weights follow eager dropless training (fp32)."""
    config, model, control = _models(capacity_factor, seed=int(torch.randint(100, (1,),
                                                                               generator=gen)))
    model, control = model.cuda(), control.cuda()
    x = [(tokens(config.num_tokens, config.hidden, gen, offset=40 * i) / config.num_tokens).cuda()
         for i in range(5)]
    proj = _projection(config, gen, "cuda")
    train_step, losses = _train(model, x, proj)
    want = _eager_control(control, x, proj)
    stats = train_step.stats
    assert stats.captures == 1 and stats.replays == (3 if flagged else 4), stats
    assert stats.over_budget == (1 if flagged else 0), stats
    assert stats.eager_reruns == (1 if flagged else 0), stats
    for got, ref in zip(losses, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(model.named_parameters(), control.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_eager_over_budget_on_the_gpu_warns_and_reaches_the_manager(gen):
    """The eager paths of NOTE [eager over budget] on a GPU: a warning outside everything
    (one host read), the manager's end_step() inside `with manager:`."""
    x, idx, w, E, budget = _tight(gen)
    x, idx, w = x.cuda(), idx.cuda(), w.cuda()
    with pytest.warns(RuntimeWarning, match="more rows than the budget"):
        dispatch(x, idx, w, E, budget=budget)
    manager = StashManager(device="cuda")
    manager.begin_step()
    with manager:
        dispatch(x, idx, w, E, budget=budget)
    with pytest.raises(OverBudgetError):
        manager.end_step()
