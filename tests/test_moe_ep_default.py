"""``MoEModel(config, group=g)`` as README shows it (no ``exchange=``), built then moved, on two
gloo ranks (and four, slow): equal to NCCL's chunks and to the one-device reference in outputs
and every gradient (tests/_ep_default.py); experts that do not split evenly over the ranks are
refused naming the argument; and a config cannot change under a model."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from _ep_default import default_path_case
from _ranks import run_ranks
from graphstash.models import MoEConfig, MoEModel


def _cpu_rank(rank: int, world: int) -> dict:
    return default_path_case(rank, world, torch.device("cpu"), (torch.float32, torch.float64))


def test_default_path_built_then_moved_equals_chunks_and_reference():
    for result in run_ranks(_cpu_rank, 2):
        # the exchange is built at the first forward and rebuilt after the move to float64
        assert result == str({"kinds": ["live rows over gloo", "live rows over gloo"],
                              "resent_kinds": ["live rows over gloo, resent"] * 2,
                              "chunks_kind": "nccl chunks"}), result


def _four_ranks(rank: int, world: int) -> dict:
    return default_path_case(rank, world, torch.device("cpu"), (torch.float64,))


@pytest.mark.slow
def test_default_path_four_gloo_ranks():
    for result in run_ranks(_four_ranks, 4):
        assert "live rows over gloo" in result, result


def _six_experts_over_four_ranks(rank: int, world: int) -> str:
    """6 experts over 4 ranks: every way of building the expert-parallel model, and the
    exchange factory, refuses them with a ValueError naming the argument, on every rank
    before any collective (the barrier after them completes: the ranks are still in step)."""
    import torch.distributed as dist

    from graphstash.moe.exchange import build_gloo_transport, make_exchange

    assert world == 4
    group = dist.group.WORLD
    config = MoEConfig(hidden=16, ffn=16, num_experts=6, topk=2, layers=1, num_tokens=8)
    refused = r"config\.num_experts: expected a multiple of the group size 4, got 6"
    for kwargs in ({}, {"exchange": None}, {"mode": "plain"}, {"mode": "stash"},
                   {"mode": "dropless"}):
        with pytest.raises(ValueError, match=refused):
            MoEModel(config, group=group, **kwargs)
    transport = build_gloo_transport(capacity_rows=64, row_bytes=64, max_experts=8)
    with pytest.raises(ValueError, match=refused):
        MoEModel(config, exchange=transport)
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the group's 4 "
                                         "ranks .*got 6"):
        make_exchange(group, topk=2, num_experts=6)
    dist.barrier()
    transport.close()
    return "refused"


@pytest.mark.slow
def test_experts_that_do_not_split_over_four_ranks_are_refused():
    assert run_ranks(_six_experts_over_four_ranks, 4) == ["'refused'"] * 4


def test_experts_that_do_not_split_over_a_transports_ranks_are_refused():
    """The same check in one process: a four-rank transport that never talks to its peers
    (refused before any collective)."""
    from graphstash.moe.exchange import GlooTransport
    from graphstash.moe.exchange import layout as X

    layout = X.RegionLayout(4, 64, 64, 8)
    transport = GlooTransport(kind="gloo", rank=0, world_size=4, layout=layout,
                              region=torch.zeros(layout.nbytes, dtype=torch.uint8),
                              table=torch.zeros(X.XF_FIELDS, 4, dtype=torch.int64),
                              timeout_s=1.0)
    config = MoEConfig(hidden=16, ffn=16, num_experts=6, topk=2, layers=1, num_tokens=8)
    with pytest.raises(ValueError, match=r"config\.num_experts: expected a multiple of the "
                                         r"group size 4, got 6"):
        MoEModel(config, exchange=transport)


def _rebuilt_on_move(rank: int, world: int) -> str:
    import torch.distributed as dist

    from _ep_default import config_for

    model = MoEModel(config_for(world), group=dist.group.WORLD, seed=3)
    assert model.exchange_kind == "live rows (built at the first forward)"
    x = torch.randn(48, 16)
    model(x)
    first = model.exchange
    assert first is not None and first.row_bytes == 16 * 4
    model.to(torch.float64)
    model(x.double())
    second = model.exchange
    assert second is not first and first.closed and second.row_bytes == 16 * 8
    model(x.double())                          # the same device and dtype: kept
    return "same" if model.exchange is second else "other"


def test_exchange_rebuilt_for_the_dtype_the_model_moved_to():
    assert run_ranks(_rebuilt_on_move, 2) == ["'same'", "'same'"]


def _resend_refused_where_nothing_resends(rank: int, world: int) -> str:
    """``resend_rows`` with NCCL's chunks or the plain peer is refused naming it, before any
    collective; a handle of NCCL's chunks refuses to regather (NOTE [resent rows])."""
    import torch.distributed as dist

    from _ep_default import config_for
    from graphstash.moe import dispatch
    from graphstash.moe.exchange import make_exchange

    group = dist.group.WORLD
    config = config_for(world, resend_rows=True)
    for kwargs in ({"exchange": None}, {"mode": "plain"}):
        with pytest.raises(ValueError, match=r"config\.resend_rows: only the live-row exchange"):
            MoEModel(config, group=group, **kwargs)
    x = torch.randn(8, 16)
    idx = torch.stack([torch.arange(8) % 8, (torch.arange(8) + 1) % 8], 1)
    _, _, handle = dispatch(x, idx, torch.full((8, 2), 0.5), 8, budget=64,
                            exchange=make_exchange(group, kind="nccl chunks"))
    assert not handle.regathers
    with pytest.raises(ValueError, match=r"handle: regather\(\) needs a one-device dispatch or "
                                         r"an exchange that resends its rows"):
        handle.regather(x)
    dist.barrier()
    return "refused"


def test_resend_rows_is_refused_where_nothing_resends():
    assert run_ranks(_resend_refused_where_nothing_resends, 2) == ["'refused'"] * 2
    with pytest.raises(TypeError, match="resend_rows: expected a bool, got int"):
        MoEConfig(resend_rows=1)
    # one device: nothing to resend; the experts gather their rows again anyway
    model = MoEModel(MoEConfig(hidden=16, ffn=16, layers=1, num_tokens=8, resend_rows=True))
    assert model.exchange_kind == "one device"


def _weights_changed_before_backward(rank: int, world: int) -> str:
    """The experts' weights changed in place between the forward and the backward: the
    overlapped backward (NOTE [exchange beside the experts]) refuses, on every rank at the
    same point, instead of computing an input gradient from other weights."""
    import dataclasses

    import torch.distributed as dist

    from _ep_default import config_for, rank_inputs

    model = MoEModel(dataclasses.replace(config_for(world), overlap_sms=1),
                     group=dist.group.WORLD, seed=3)
    xs, projs = rank_inputs(rank, world, torch.device("cpu"), torch.float32)
    loss = (model(xs[rank]) * projs[rank]).sum()
    with torch.no_grad():
        model.blocks[1].w1.mul_(2.0)
    with pytest.raises(RuntimeError, match="w1 or tokens_per_expert was modified in place"):
        loss.backward()
    dist.barrier()
    return "refused"


def test_overlapped_backward_refuses_weights_changed_since_the_forward():
    assert run_ranks(_weights_changed_before_backward, 2) == ["'refused'"] * 2


def test_overlap_sms_is_checked_by_name():
    with pytest.raises(ValueError, match="overlap_sms: expected an int >= 0, got -1"):
        MoEConfig(overlap_sms=-1)
    with pytest.raises(TypeError, match="overlap_sms: expected an int, got float"):
        MoEConfig(overlap_sms=1.5)
    # one device: nothing is pushed, so nothing runs beside the experts and the handle
    # refuses to push home
    from graphstash.moe import dispatch

    x, idx = torch.randn(8, 16), torch.randint(0, 4, (8, 2))
    _, _, handle = dispatch(x, idx, torch.rand(8, 2), 4, budget=None)
    assert not handle.overlaps and handle.beside() is None
    with pytest.raises(ValueError, match="handle: send_home\\(\\) needs an expert-parallel"):
        handle.send_home(torch.zeros(handle.budget_rows, 16))


def test_config_is_frozen():
    config = MoEConfig(hidden=16, attention=True, heads=4)
    with pytest.raises(dataclasses.FrozenInstanceError, match="heads"):
        config.heads = 5
    with pytest.raises(ValueError, match="heads"):
        dataclasses.replace(config, heads=5)
    with pytest.raises(ValueError, match="heads"):
        dataclasses.replace(config, heads=0)


def test_model_validates_its_config_again():
    config = MoEConfig(hidden=16, attention=True, heads=4)
    object.__setattr__(config, "heads", 5)        # past the frozen dataclass on purpose
    with pytest.raises(ValueError, match="heads: expected a divisor of hidden=16"):
        MoEModel(config)


def test_exchange_argument_is_checked():
    with pytest.raises(TypeError, match="exchange: expected 'auto', None or a"):
        MoEModel(MoEConfig(hidden=16), exchange="live")


def test_stash_mode_without_a_manager_says_what_happens():
    model = MoEModel(MoEConfig(hidden=16, ffn=16, layers=1, num_tokens=8), mode="stash")
    x = torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match="no StashManager is current"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)                                   # once per model
        with torch.no_grad():
            MoEModel(MoEConfig(hidden=16, ffn=16, layers=1, num_tokens=8), mode="stash")(x)
