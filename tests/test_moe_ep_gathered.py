"""Gathered tokens on gloo ranks (tests/_ep_gathered.py): ``MoEModel`` with
``exchange_kind="gathered tokens"`` as README shows it, built then moved, kept and regathered,
and the dispatch API with a weighted combine, against the one-device reference; two ranks,
four under ``slow``. README's default picks them where top-K is above the ranks (NOTE [auto
exchange]). Misuse is refused naming the argument."""
from __future__ import annotations

import pytest
import torch

from _ep_gathered import model_case, weighted_case
from _ranks import run_ranks


def _model_rank(rank: int, world: int) -> dict:
    return model_case(rank, world, torch.device("cpu"), (torch.float32, torch.float64))


def test_gathered_model_equals_reference():
    kinds = [["gathered tokens", "gathered tokens"]] * 2
    assert run_ranks(_model_rank, 2) == [str({"kinds": kinds})] * 2


def _skewed_rank(rank: int, world: int) -> dict:
    return model_case(rank, world, torch.device("cpu"), (torch.float64,), routing="skew:1.5",
                      capacity_factor=1.0)


def test_gathered_model_over_budget_under_skew_equals_reference_dropless():
    """A budget the skewed routing overflows: eager forwards drop rows and warn, so the
    model runs under graphstash.dropless() as graph_step's rerun would."""
    assert len(run_ranks(_skewed_dropless_rank, 2)) == 2


def _skewed_dropless_rank(rank: int, world: int) -> dict:
    from graphstash import dropless

    with dropless():
        return _skewed_rank(rank, world)


def _four_ranks(rank: int, world: int) -> dict:
    return model_case(rank, world, torch.device("cpu"), (torch.float64,))


@pytest.mark.slow
def test_gathered_model_four_gloo_ranks():
    assert len(run_ranks(_four_ranks, 4)) == 4


def _auto_rank(rank: int, world: int) -> dict:
    """README's ``MoEModel(config, group=g)`` at top-K above the ranks (NOTE [auto
    exchange]): the gathered tokens, equal to the reference (tests/_ep_gathered.py); the
    live rows where ``overlap_sms`` or ``exchange_kind="live rows"`` asks for them, and
    for tokens on a GPU of this gloo group (ranks sharing one GPU)."""
    import dataclasses

    import torch.distributed as dist

    from _ep_default import config_for
    from graphstash.models import MoEModel
    from graphstash.moe.exchange import collectives_run

    group = dist.group.WORLD
    config = config_for(world, topk=world + 1)
    model = MoEModel(config, group=group)
    assert model.exchange_kind == "gathered tokens or live rows (chosen at the first forward)"
    kinds = {}
    for what, over in (("overlap_sms", dict(overlap_sms=1)),
                       ("live rows", dict(exchange_kind="live rows"))):
        m = MoEModel(dataclasses.replace(config, **over), group=group)
        m(torch.randn(config.num_tokens, config.hidden))
        kinds[what] = m.exchange_kind
    assert collectives_run(group, torch.device("cpu"))
    assert not collectives_run(group, torch.device("cuda"))     # gloo: the live rows' IPC
    return {**model_case(rank, world, torch.device("cpu"), (torch.float64,), auto=True),
            **kinds}


def test_readme_default_gathers_where_topk_is_above_the_ranks():
    want = {"kinds": [["gathered tokens", "gathered tokens, resent"]],
            "overlap_sms": "live rows over gloo", "live rows": "live rows over gloo"}
    assert run_ranks(_auto_rank, 2) == [str(want)] * 2


def _weighted_rank(rank: int, world: int) -> str:
    return weighted_case(rank, world, torch.device("cpu"), torch.float64)


def test_gathered_weighted_combine_equals_one_device():
    assert run_ranks(_weighted_rank, 2) == [str(["tokens", "rows"])] * 2


def _refusals(rank: int, world: int) -> str:
    import torch.distributed as dist

    from graphstash.models import MoEConfig, MoEModel
    from graphstash.moe.exchange import GatheredTokens, build_gloo_transport, make_exchange

    group = dist.group.WORLD
    with pytest.raises(TypeError, match="resend: expected a bool"):
        GatheredTokens(group, resend=1)
    with pytest.raises(ValueError, match="overlap_sms: gathered tokens run on NCCL"):
        make_exchange(group, kind="gathered tokens", overlap_sms=4)
    with pytest.raises(ValueError, match="chunk_rows: gathered tokens send no chunks"):
        make_exchange(group, kind="gathered tokens", chunk_rows=4)
    transport = build_gloo_transport(capacity_rows=64, row_bytes=64, max_experts=8)
    with pytest.raises(ValueError, match="kind: a transport carries live rows"):
        make_exchange(transport=transport, kind="gathered tokens")
    config = MoEConfig(hidden=16, ffn=16, num_experts=8, topk=2, layers=1, num_tokens=8,
                       exchange_kind="gathered tokens")
    with pytest.raises(ValueError, match="config.exchange_kind: 'gathered tokens' runs over"):
        MoEModel(config, exchange=transport)
    with pytest.raises(ValueError, match="config.exchange_kind: 'gathered tokens' runs over"):
        MoEModel(config, group=group, exchange=None)
    dist.barrier()
    transport.close()
    return "refused"


def test_gathered_misuse_is_refused_naming_the_argument():
    assert run_ranks(_refusals, 2) == ["'refused'"] * 2


def test_unknown_exchange_kind_is_refused():
    from graphstash.models import MoEConfig

    with pytest.raises(ValueError, match="exchange_kind: expected one of"):
        MoEConfig(exchange_kind="gathered")
