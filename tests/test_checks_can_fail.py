"""Each family of gradient checks fails when a backward is wrong.

A test-only fault (``_faults.py``: one kernel's backward scaled, the reloaded stash rows
scaled, the expert-parallel exchange's gradients scaled, all injected here and never by
library code) is armed on one side of a check, and the check must raise AssertionError; the
fault must have fired (``hits``), so a fault that no longer reaches the code under test shows
too. Without the fault the same checks pass (the tests that run them).

Families (the check, the fault that turns it red):

- dispatch/combine: graphstash's MoE layer against the plain-PyTorch peer
  (``plain_peer_check``): dispatch's backward (``combine_rows``) or combine's backward
  (``gather_rows``) scaled by 1.25;
- expert MLP: the same check: the expert activation's backward (``act_backward``) scaled;
- budget against dropless (``budget_dropless_check``): combine's backward scaled while the
  budget model runs;
- stash: stash mode against budget mode (``stash_budget_check``): the reloaded rows halved;
- graph-vs-eager: ``graph_step`` training against an eager loop
  (``graph_step_eager_check``; the GPU twin in ``test_moe_gpu.py``): the expert backward
  scaled inside the decorated step only;
- compiled-vs-eager: ``_compile_data.compare_compiled``: the compiled model's gradient
  scaled (``test_compile.py``);
- expert parallel (gloo): the two-rank exchange against the one-device reference: the
  exchange's backward scaled (``test_moe_ep.py``).
"""
from __future__ import annotations

import pytest

from _faults import kernel_fault, reload_fault
from _moe_checks import (budget_dropless_check, graph_step_eager_check, plain_peer_check,
                         stash_budget_check)


def _must_fail(check, fault) -> None:
    with pytest.raises(AssertionError):
        check()
    assert fault.hits > 0, f"the {fault.name} fault never fired: it no longer reaches the check"


@pytest.mark.parametrize("kernel", ["combine_rows", "gather_rows"])
@pytest.mark.parametrize("mode", ["dropless", "budget"])
def test_dispatch_combine_check_fails_on_a_wrong_backward(gen, kernel, mode):
    with kernel_fault(kernel) as fault:
        _must_fail(lambda: plain_peer_check(gen, True, mode, fault=fault, faulty=mode), fault)


@pytest.mark.parametrize("gated", [False, True])
def test_expert_mlp_check_fails_on_a_wrong_backward(gen, gated):
    with kernel_fault("act_backward") as fault:
        _must_fail(lambda: plain_peer_check(gen, gated, fault=fault, faulty="dropless"), fault)


def test_budget_dropless_check_fails_on_a_wrong_budget_backward(gen):
    with kernel_fault("gather_rows") as fault:
        _must_fail(lambda: budget_dropless_check(gen, False, fault=fault, faulty="budget"),
                   fault)


def test_stash_check_fails_on_wrong_reloaded_rows(gen):
    with reload_fault() as fault:
        _must_fail(lambda: stash_budget_check(gen, fault=fault, faulty="stash"), fault)


def test_graph_step_eager_check_passes_and_fails_on_a_wrong_graphed_backward(gen):
    graph_step_eager_check(gen)
    with kernel_fault("act_backward") as fault:
        _must_fail(lambda: graph_step_eager_check(gen, fault=fault, faulty="graph"), fault)


def test_a_disarmed_fault_changes_nothing(gen):
    """The faults corrupt only while armed: the checks pass with one installed but never
    armed on either side (so a red check above is the fault's doing)."""
    with kernel_fault("act_backward") as fault:
        plain_peer_check(gen, True, fault=fault, faulty=None)
    assert fault.hits == 0
