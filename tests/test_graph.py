"""CPU tests of the graph manager: eager fallback, recovery protocol, staging, optimizer checks,
device-side update skipping (the same tensor code the graph captures)."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from _peak_owner import MovingOwner

import graphstash
from graphstash import _layout as L
from graphstash.errors import ReleasedError
from graphstash.graph import DeviceUpdate, GraphStep, check_optimizer, graph_step
from graphstash.graph import _staging as S
from graphstash.graph.capture_errors import describe as describe_capture_failure
from graphstash.status import raise_peak


class FlaggingMLP(torch.nn.Module):
    """MLP whose forward raises a status flag when ``marker`` says so (never when dropless).

    A flagged forward also poisons its activations with NaN, as an overflowed stash would
    leave garbage: the update of such a step must be skipped and rerun.
    """

    def __init__(self, width: int = 16, depth: int = 3, dropout: float = 0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.dropout = torch.nn.Dropout(dropout)
        self.flag_index = L.SS_OVERFLOW
        self.dropless_calls = 0

    @property
    def status(self):
        """The running step's status tensor (NOTE [current step]), or None outside a step."""
        owner = graphstash.status.current()
        return None if owner is None else owner.tensor

    def forward(self, x, marker=None):
        h = x
        for i, layer in enumerate(self.layers):
            h = self.dropout(torch.relu(layer(h)))
            if i == 0 and marker is not None and self.status is not None:
                if graphstash.is_dropless():
                    self.dropless_calls += 1
                else:
                    s = self.status[self.flag_index: self.flag_index + 1]
                    s.copy_(torch.maximum(s, marker))
                    # added, not selected, so an unflagged step's gradient stays NaN-free
                    h = h + torch.where(marker.bool(), float("nan"), 0.0).to(h.dtype)
        return h


def _data(gen, steps, batch=8, width=16, flagged=()):
    xs = [torch.randn(batch, width, generator=gen) for _ in range(steps)]
    ys = [torch.randn(batch, width, generator=gen) for _ in range(steps)]
    ms = [torch.tensor([1 if i in flagged else 0], dtype=torch.int32) for i in range(steps)]
    return xs, ys, ms


def _eager_reference(model, opt, xs, ys):
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _make_pair(opt_factory, dropout=0.0):
    torch.manual_seed(0)
    model = FlaggingMLP(dropout=dropout)
    ref = copy.deepcopy(model)
    return model, opt_factory(model.parameters()), ref, opt_factory(ref.parameters())


def _assert_same_state(opt_a, opt_b, model_a, model_b):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eager_fallback_matches_eager_training_with_forced_overflow(gen, name):
    model, opt, ref, ref_opt = _make_pair(OPTIMIZERS[name], dropout=0.1)
    flagged = {3, 4, 9}
    xs, ys, ms = _data(gen, 12, flagged=flagged)

    @graph_step(optimizer=opt, warmup=2, device="cpu")
    def train_step(x, y, marker):
        loss = torch.nn.functional.mse_loss(model(x, marker), y)
        loss.backward()
        return loss

    torch.manual_seed(1)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        losses = [train_step(x, y, m) for x, y, m in zip(xs, ys, ms)]
    torch.manual_seed(1)
    ref_losses = _eager_reference(ref, ref_opt, xs, ys)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), f"step {i}: {a} != {b}"
    _assert_same_state(opt, ref_opt, model, ref)
    st = train_step.stats
    assert (st.steps, st.overflows, st.eager_reruns, st.replays, st.captures) == (12, 3, 3, 0, 0)
    assert st.mode == "eager" and model.dropless_calls == 3
    if "step" in opt.state[next(model.parameters())]:
        assert int(opt.state[next(model.parameters())]["step"]) == 12   # each update once


def test_over_budget_flag_reruns_and_calls_on_overflow(gen):
    model, opt, ref, ref_opt = _make_pair(OPTIMIZERS["adamw"])
    model.flag_index = L.SS_OVER_BUDGET
    seen = []
    xs, ys, ms = _data(gen, 5, flagged={2})

    def step(x, y, marker):
        loss = torch.nn.functional.mse_loss(model(x, marker), y)
        loss.backward()
        return {"loss": loss, "n": 3}

    train_step = GraphStep(step, optimizer=opt, device="cpu", on_overflow=seen.append)
    with pytest.warns(RuntimeWarning):
        outs = [train_step(x, y, m) for x, y, m in zip(xs, ys, ms)]
    ref_losses = _eager_reference(ref, ref_opt, xs, ys)
    assert [o["n"] for o in outs] == [3] * 5
    assert all(torch.equal(o["loss"], r) for o, r in zip(outs, ref_losses))
    assert seen == [{"overflow": False, "host_spill": False, "over_budget": True}]
    st = train_step.stats
    assert (st.over_budget, st.overflows, st.eager_reruns) == (1, 0, 1)
    _assert_same_state(opt, ref_opt, model, ref)


def test_cpu_fallback_warns_once_and_counts(gen):
    w = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = torch.optim.SGD([w], lr=0.1)

    @graph_step(optimizer=opt, device="cpu")
    def train_step(x):
        loss = (w * x).sum()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            train_step(torch.randn(4, generator=gen))
    msgs = [str(c.message) for c in caught if "graph_step" in str(c.message)]
    assert len(msgs) == 1 and "eagerly" in msgs[0]
    st = train_step.stats
    assert (st.steps, st.eager_steps, st.replays, st.mode) == (4, 4, 0, "eager")
    assert set(st.as_dict()) >= {"steps", "replays", "eager_reruns", "overflows", "host_spills",
                                 "captures", "capture_ms", "peak_memory_bytes", "stash_pages_peak"}


def test_microbatches_accumulate_and_update_once(gen):
    """Gradient accumulation over microbatches: one update per step, after the last one."""
    model, opt, ref, ref_opt = _make_pair(OPTIMIZERS["adam_foreach"], dropout=0.1)
    steps = [[tuple(torch.randn(8, 16, generator=gen) for _ in range(2)) for _ in range(4)]
             for _ in range(6)]

    @graph_step(optimizer=opt, warmup=1, device="cpu")
    def train_step(micro):
        total = 0.0
        for x, y in micro:
            loss = torch.nn.functional.mse_loss(model(x), y) / len(micro)
            loss.backward()
            total = total + loss.detach()
        return total

    torch.manual_seed(1)
    with pytest.warns(RuntimeWarning):
        losses = [train_step(micro) for micro in steps]
    torch.manual_seed(1)
    for i, micro in enumerate(steps):
        ref_opt.zero_grad()
        total = 0.0
        for x, y in micro:
            loss = torch.nn.functional.mse_loss(ref(x), y) / len(micro)
            loss.backward()
            total = total + loss.detach()
        ref_opt.step()
        assert torch.equal(losses[i], total), f"step {i}"
    _assert_same_state(opt, ref_opt, model, ref)
    assert int(opt.state[next(model.parameters())]["step"]) == len(steps)


def _stash_step(stash, model, tokens, config, *, per_layer, probe=None):
    """A step whose layers run inside stash groups: one per layer, or one around them all;
    ``probe()`` runs after its backward."""

    def step(x, y):
        h = x
        if per_layer:
            for i, layer in enumerate(model.layers):
                with stash.stash_activations(tokens, name=f"layer{i}"):
                    h = model.dropout(torch.relu(layer(h)))
        else:
            with stash.stash_activations(tokens, name="all"):
                h = model(h)
        loss = torch.nn.functional.mse_loss(h, y)
        loss.backward()
        if probe is not None:
            probe()
        return loss

    return GraphStep(step, optimizer=model.opt, warmup=1, device="cpu", stash=config)


def _overflowing_stash(gen, owner=None):
    """10 calls of a step whose stash starts at 0.2 of its demand, the losses and the state
    equal to an eager loop's; with ``owner`` (a step-peak owner) the step raises its peak.
    Returns ``(train_step, config, opt, runs)``: ``runs`` has ``(dropless, pages released)``
    for every run of the step function past the warmup."""
    stash = pytest.importorskip("graphstash.stash")
    model, opt, ref, ref_opt = _make_pair(OPTIMIZERS["adamw"])
    model.opt = opt
    xs, ys, _ = _data(gen, 10, batch=256)
    tokens = torch.tensor([256], dtype=torch.int32)
    config = stash.StashConfig(page_size=32, device_factor=0.2, host_tier=False,
                               min_tensor_bytes=0, backend="reference")
    runs, one = [], torch.ones((), dtype=torch.int32)

    def probe():
        if owner is not None:
            raise_peak(graphstash.status.current().peaks, owner.slot, one)
        runs.append((graphstash.is_dropless(), stash.current_manager().released))

    train_step = _stash_step(stash, model, tokens, config, per_layer=True, probe=probe)
    with pytest.warns(RuntimeWarning):
        losses = [train_step(x, y) for x, y in zip(xs, ys)]
    ref_losses = _eager_reference(ref, ref_opt, xs, ys)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    _assert_same_state(opt, ref_opt, model, ref)
    assert int(opt.state[next(model.parameters())]["step"]) == 10
    return train_step, config, runs


def test_stash_overflow_reruns_grows_budget_and_matches_eager(gen):
    """A tiny stash budget overflows; each flagged step runs again with a grown stash (NOTE
    [rerun by capture]) or dropless, and updates once."""
    train_step, config, runs = _overflowing_stash(gen)
    st = train_step.stats
    # layers 0 and 1 are stashed (2 saved [256, 16] tensors each, 8 pages apiece: 32 pages),
    # the last one is kept; 0.2, 0.3, 0.45, 0.675 of that overflow, 1.0125 fits. A call that
    # overflowed runs again with the grown stash, as a replay would be recaptured (NOTE [rerun
    # by capture]), and when that overflows too, reruns dropless: 0.2 -> 0.3 -> dropless,
    # 0.45 -> 0.675 -> dropless
    assert st.stash_pages_peak == 32
    assert (st.overflows, st.capture_reruns, st.eager_reruns, st.steps) == (4, 2, 2, 10), st
    assert train_step.stash_manager.config.device_factor == pytest.approx(0.2 * 1.5 ** 4)
    assert config.device_factor == 0.2                  # grown in a copy, not in place
    # the pages are released while a dropless rerun runs, and only then (NOTE [rerun memory])
    assert [dropless for dropless, _ in runs].count(True) == st.eager_reruns, runs
    assert all(released == dropless for dropless, released in runs), runs


def test_stash_overflow_reruns_dropless_when_its_peaks_move_a_budget(gen):
    """NOTE [rerun by capture]: when the peaks of a step whose stash overflowed change what a
    graph bakes in, the rerun is the dropless one, and the next call is the eager step at the
    new sizes (NOTE [budgets the step adapts]). The same as tests/test_graph_gpu.py's."""
    owner = MovingOwner()
    train_step, _, runs = _overflowing_stash(gen, owner)
    st = train_step.stats
    assert st.overflows >= 2 and st.capture_reruns == 0, st
    assert st.eager_reruns == st.overflows == owner.flagged, (st, owner.flagged)
    assert st.budget_changes == st.overflows, st
    assert [dropless for dropless, _ in runs].count(True) == st.eager_reruns, runs


def test_stash_config_shared_by_two_steps_is_not_grown_by_one(gen):
    """Two decorated steps share one StashConfig; the one that overflows grows its own copy:
    the config and the other step's manager keep device_factor 0.2."""
    stash = pytest.importorskip("graphstash.stash")
    config = stash.StashConfig(page_size=32, device_factor=0.2, host_tier=False,
                               min_tensor_bytes=0, backend="reference")
    steps = []
    for _ in range(2):
        model, opt, _, _ = _make_pair(OPTIMIZERS["adamw"])
        model.opt = opt
        steps.append(_stash_step(stash, model, torch.tensor([256], dtype=torch.int32), config,
                                 per_layer=True))
    xs, ys, _ = _data(gen, 2, batch=256)
    with pytest.warns(RuntimeWarning):
        for x, y in zip(xs, ys):       # a warmup step measures, the next one overflows
            steps[0](x, y)
        steps[1](xs[0], ys[0])         # a warmup step only: measures, never overflows
    assert steps[0].stats.overflows > 0 and steps[1].stats.overflows == 0
    assert steps[0].stash_manager.config.device_factor > 0.2
    assert config.device_factor == 0.2
    assert steps[1].stash_manager.config.device_factor == 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device_factor = 1.0


def test_single_stash_group_is_kept_not_stashed(gen):
    """One group around the whole model is followed directly by its own backward, so the
    manager keeps its tensors (NOTE [last group kept]): nothing is stashed, nothing overflows."""
    stash = pytest.importorskip("graphstash.stash")
    model, opt, _, _ = _make_pair(OPTIMIZERS["adamw"])
    model.opt = opt
    xs, ys, _ = _data(gen, 4, batch=256)
    tokens = torch.tensor([256], dtype=torch.int32)
    config = stash.StashConfig(page_size=32, device_factor=0.2, host_tier=False,
                               min_tensor_bytes=0, backend="reference")
    train_step = _stash_step(stash, model, tokens, config, per_layer=False)
    with pytest.warns(RuntimeWarning):
        for x, y in zip(xs, ys):
            train_step(x, y)
    st = train_step.stats
    assert (st.stash_pages_peak, st.overflows) == (0, 0)
    assert train_step.stash_manager.schedule == [("F", 0, "all"), ("B", 0, "all")]


def test_release_then_reset(gen):
    w = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = torch.optim.SGD([w], lr=0.1)
    train_step = GraphStep(lambda x: (w * x).sum().backward(), optimizer=opt, device="cpu")
    with pytest.warns(RuntimeWarning):
        train_step(torch.randn(4, generator=gen))
    train_step.release()
    with pytest.raises(ReleasedError, match="reset"):
        train_step(torch.randn(4, generator=gen))
    train_step.reset()
    train_step(torch.randn(4, generator=gen))
    assert train_step.stats.steps == 2


def test_argument_validation():
    fn = lambda: None   # noqa: E731
    with pytest.raises(ValueError, match="warmup"):
        GraphStep(fn, warmup=-1)
    with pytest.raises(ValueError, match="outputs"):
        GraphStep(fn, outputs="copy")
    with pytest.raises(ValueError, match="on_new_shape"):
        GraphStep(fn, on_new_shape="ignore")
    with pytest.raises(TypeError, match="optimizer"):
        GraphStep(fn, optimizer="adam")
    with pytest.raises(ValueError, match="scaler"):
        GraphStep(fn, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="budget_growth"):
        GraphStep(fn, budget_growth=1.0)
    with pytest.raises(TypeError, match="fn"):
        GraphStep(3)


# ---- optimizer checks ---------------------------------------------------------------------
def test_check_optimizer_accepts_capturable_and_sgd():
    p = [torch.nn.Parameter(torch.randn(3))]
    check_optimizer(torch.optim.AdamW(p, capturable=True))
    check_optimizer(torch.optim.Adam(p, capturable=True, foreach=True))
    check_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9))


def test_check_optimizer_rejects_with_what_to_change():
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match=r"capturable=False.*AdamW\(params, \.\.\., capturable=True\)"):
        check_optimizer(torch.optim.AdamW(p))
    with pytest.raises(ValueError, match="no capturable option"):
        check_optimizer(torch.optim.LBFGS(p))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        check_optimizer(object())
    opt = torch.optim.Adam(p, capturable=True)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "capturable": False})
    with pytest.raises(ValueError, match="param group 1"):
        check_optimizer(opt)


# ---- device-side update skipping -------------------------------------------------------------
def _opt_with_state(factory, gen, nan_grads=False):
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(7, generator=gen).to(torch.float64))]
    opt = factory(params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()                      # the state exists before the guarded step
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if nan_grads:
            p.grad[0] = float("nan")
    return params, opt


def _snapshot(params, opt):
    return ([p.detach().clone() for p in params],
            [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
             for p in params])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["auto", "mask"])
def test_device_update_skip_leaves_everything_unchanged(gen, name, mode):
    params, opt = _opt_with_state(OPTIMIZERS[name], gen, nan_grads=True)
    before = _snapshot(params, opt)
    update = DeviceUpdate(opt, mode=mode, device="cpu")
    update.step(torch.tensor(True))
    after = _snapshot(params, opt)
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(before[1], after[1]):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not hasattr(opt, "found_inf")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["auto", "mask"])
def test_device_update_without_flag_equals_plain_step(gen, name, mode):
    state = gen.get_state()
    params, opt = _opt_with_state(OPTIMIZERS[name], gen)
    gen.set_state(state)
    ref_params, ref_opt = _opt_with_state(OPTIMIZERS[name], gen)
    DeviceUpdate(opt, mode=mode, device="cpu").step(torch.tensor(False))
    ref_opt.step()
    got, want = _snapshot(params, opt), _snapshot(ref_params, ref_opt)
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(got[1], want[1]):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_device_update_mode_choice():
    p = [torch.nn.Parameter(torch.randn(3))]
    assert DeviceUpdate(torch.optim.AdamW(p, fused=True), device="cpu").mode == "found_inf"
    assert DeviceUpdate(torch.optim.SGD(p, lr=0.1, fused=True), device="cpu").mode == "found_inf"
    assert DeviceUpdate(torch.optim.Adam(p, foreach=True), device="cpu").mode == "mask"
    with pytest.raises(ValueError, match="fused"):
        DeviceUpdate(torch.optim.Adam(p, foreach=True), mode="found_inf", device="cpu")


def _scaled_setup(gen, fused):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    return model, opt, scaler


@pytest.mark.parametrize("fused", [False, True])
def test_device_update_with_scaler_matches_scaler_step(gen, fused):
    x = torch.randn(3, 4, generator=gen)
    results = []
    for way in ("eager", "device"):
        model, opt, scaler = _scaled_setup(gen, fused)
        update = DeviceUpdate(opt, scaler=scaler, device="cpu")
        for step in range(4):
            opt.zero_grad()
            loss = model(x).pow(2).sum() * (float("inf") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            if way == "eager":
                update.eager_step()
            else:
                update.step(torch.tensor(False))
        results.append((model.weight.detach().clone(), scaler.get_scale(),
                        opt.state[model.weight]["step"].clone()))
    (w0, s0, k0), (w1, s1, k1) = results
    assert torch.equal(w0, w1) and s0 == s1 and torch.equal(k0, k1)
    assert int(k0) == 3          # the inf step was skipped by the scaler


def test_device_update_with_scaler_flag_undoes_scale_update(gen):
    model, opt, scaler = _scaled_setup(gen, fused=False)
    update = DeviceUpdate(opt, scaler=scaler, device="cpu")
    x = torch.randn(3, 4, generator=gen)
    scaler.scale(model(x).sum()).backward()
    update.eager_step()
    w, scale, tracker = (model.weight.detach().clone(), scaler._scale.clone(),
                         scaler._growth_tracker.clone())
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    update.step(torch.tensor(True))
    assert torch.equal(model.weight, w)
    assert torch.equal(scaler._scale, scale) and torch.equal(scaler._growth_tracker, tracker)


# ---- staging ---------------------------------------------------------------------------------
def test_signature_and_mismatch_names_the_argument(gen):
    x = torch.randn(4, 3, generator=gen)
    micro = [{"x": torch.randn(2, 3, generator=gen), "y": torch.ones(2)} for _ in range(3)]
    args, kwargs = (x, micro), {"scale": 2}
    leaves, spec = S.flatten_call(args, kwargs)
    sig = S.signature(leaves, spec)
    assert sig == S.signature(*S.flatten_call((x.clone(), [dict(m) for m in micro]), {"scale": 2}))
    bad_micro = [dict(m) for m in micro]
    bad_micro[2] = {"x": torch.randn(5, 3, generator=gen), "y": torch.ones(2)}
    args2 = (x, bad_micro)
    sig2 = S.signature(*S.flatten_call(args2, kwargs))
    msg = S.describe_mismatch(sig, sig2, args2, kwargs)
    assert "args[1][2]['x']" in msg and "(2, 3)" in msg and "(5, 3)" in msg
    sig3 = S.signature(*S.flatten_call(args, {"scale": 3}))
    assert "kwargs['scale'] changed from 2 to 3" in S.describe_mismatch(sig, sig3, args, {"scale": 3})
    sig4 = S.signature(*S.flatten_call((x,), kwargs))
    assert "structure" in S.describe_mismatch(sig, sig4, (x,), kwargs)
    sig5 = S.signature(*S.flatten_call((x.double(), micro), kwargs))
    assert "torch.float64" in S.describe_mismatch(sig, sig5, (x.double(), micro), kwargs)


def test_static_inputs_stage_every_microbatch(gen):
    micro = [(torch.randn(2, 3, generator=gen), torch.arange(2) + 10 * i) for i in range(4)]
    leaves, spec = S.flatten_call((micro,), {"n": 4})
    static = S.StaticInputs(leaves, spec, ((micro,), {"n": 4}))
    (static_micro,), kw = static.args_kwargs()
    assert kw == {"n": 4} and len(static_micro) == 4
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(static_micro, micro))
    assert static.nbytes == 4 * (2 * 3 * 4 + 2 * 8)
    new = [(torch.randn(2, 3, generator=gen), torch.arange(2) + 100 * i) for i in range(4)]
    ptrs = [t.data_ptr() for t in static.tensors]
    static.stage(S.flatten_call((new,), {"n": 4})[0])
    assert [t.data_ptr() for t in static.tensors] == ptrs      # same buffers, new contents
    for (sx, sy), (nx, ny) in zip(static_micro, new):
        assert torch.equal(sx, nx) and torch.equal(sy, ny)


def test_copy_tree_into_checks_structure(gen):
    dst = {"a": torch.zeros(2), "b": [torch.zeros(3)]}
    src = {"a": torch.ones(2), "b": [torch.full((3,), 2.0)]}
    assert S.copy_tree_into(dst, src) and torch.equal(dst["b"][0], src["b"][0])
    assert not S.copy_tree_into(dst, {"a": torch.ones(3), "b": [torch.ones(3)]})


def test_capture_failure_message_names_the_line():
    def step():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    try:
        step()
    except RuntimeError as exc:
        msg, _ = describe_capture_failure(exc, "train_step")
    assert "capturing train_step failed at" in msg and "test_graph.py" in msg
    assert "raise RuntimeError" in msg and ".item()" in msg


def test_graph_step_drives_a_manager_through_the_step_protocol(gen):
    """graph_step(stash=manager) takes any StepParticipant; a StashConfig is not one."""
    from graphstash.graph.protocol import StepParticipant

    stash = pytest.importorskip("graphstash.stash")
    manager = stash.StashManager(stash.StashConfig(min_tensor_bytes=0), device="cpu")
    assert isinstance(manager, StepParticipant)
    assert not isinstance(stash.StashConfig(), StepParticipant)
    model, opt, _, _ = _make_pair(OPTIMIZERS["adamw"])
    model.opt = opt
    step = _stash_step(stash, model, torch.tensor([256], dtype=torch.int32), manager,
                       per_layer=True)
    xs, ys, _ = _data(gen, 2, batch=256)
    with pytest.warns(RuntimeWarning):
        for x, y in zip(xs, ys):
            step(x, y)
    assert step.stash_manager is manager and step.status is manager.status
    assert step.stats.steps == 2
