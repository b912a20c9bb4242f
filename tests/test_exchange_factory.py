"""The one factory of row exchanges and the one sizing of a transport's region
(NOTE [exchange sizing], NOTE [row exchange])."""
from __future__ import annotations

import pytest

from _ranks import run_ranks
from graphstash.moe import NcclChunks, budget_rows
from graphstash.moe.exchange import (GroupExchange, LiveRows, build_gloo_transport,
                                     make_exchange, receive_rows)


@pytest.mark.parametrize("tokens,topk,experts,world,factor,pad", [
    (8192, 8, 128, 2, 1.25, None), (8192, 8, 128, 4, 1.25, 16), (100, 2, 8, 2, 0.5, None),
    (64, 2, 4, 2, 3.0, 8)])
def test_receive_rows_is_the_budget_or_the_rows_sent(tokens, topk, experts, world, factor, pad):
    budget = budget_rows(tokens * world, topk, experts, capacity_factor=factor,
                         pad_multiple=pad, world_size=world)
    rows = receive_rows(tokens, topk, experts, world_size=world, capacity_factor=factor,
                        pad_multiple=pad)
    assert rows == max(budget, tokens * topk)
    assert receive_rows(8192, 8, 128, world_size=2, capacity_factor=1.25) == 81920
    with pytest.raises(ValueError, match="num_tokens"):
        receive_rows(0, topk, experts, world_size=world, capacity_factor=factor)


def test_make_exchange_from_nothing():
    assert make_exchange() is None
    with pytest.raises(ValueError, match="kind: expected one of"):
        make_exchange(kind="rows")
    with pytest.raises(ValueError, match="chunk_rows: NCCL's chunks need a group"):
        make_exchange(chunk_rows=4)
    with pytest.raises(ValueError, match="resend: only an expert-parallel live-row exchange"):
        make_exchange(resend=True)
    with pytest.raises(TypeError, match="resend: expected a bool, got int"):
        make_exchange(resend=1)
    with pytest.raises(ValueError, match="overlap_sms: only an expert-parallel live-row"):
        make_exchange(overlap_sms=16)


def _group_kinds(rank: int, world: int) -> list:
    import torch.distributed as dist

    group = dist.group.WORLD
    transport = build_gloo_transport(group, capacity_rows=8, row_bytes=64, max_experts=8)
    live = make_exchange(transport=transport)
    assert isinstance(live, LiveRows) and live.transport is transport
    assert live.kind == "live rows over gloo" and live.world_size == world
    chunks = make_exchange(group, kind="nccl chunks", chunk_rows=4)
    lazy = make_exchange(group, topk=2, num_experts=4, capacity_factor=1.5)
    with pytest.raises(ValueError, match="chunk_rows: the live-row exchange sends no chunks"):
        make_exchange(group, chunk_rows=4)
    with pytest.raises(ValueError, match="topk: the live-row exchange is sized from topk"):
        make_exchange(group)
    # the live rows only, said in their kind (NOTE [resent rows])
    resent = make_exchange(transport=transport, resend=True)
    assert resent.resend and not live.resend and resent.kind == "live rows over gloo, resent"
    assert make_exchange(group, topk=2, num_experts=4, resend=True).resend
    with pytest.raises(ValueError, match="resend: NCCL's chunks keep what arrived"):
        make_exchange(group, kind="nccl chunks", resend=True)
    with pytest.raises(TypeError, match="resend: expected a bool, got str"):
        LiveRows(transport, resend="yes")
    # pushes beside the experts (NOTE [exchange beside the experts]): off by default on the
    # CPU, any count there means the early push home; refused by name where nothing pushes
    assert live.overlap_sms == 0 and "overlap_sms=0" in repr(live)
    assert make_exchange(transport=transport, overlap_sms=8).overlap_sms == 8
    assert make_exchange(group, topk=2, num_experts=4, overlap_sms=0).overlap_sms == 0
    with pytest.raises(ValueError, match="overlap_sms: NCCL's chunks run on NCCL's own"):
        make_exchange(group, kind="nccl chunks", overlap_sms=8)
    with pytest.raises(ValueError, match="overlap_sms: expected an int >= 0, got -1"):
        LiveRows(transport, overlap_sms=-1)
    with pytest.raises(TypeError, match="overlap_sms: expected an int, got bool"):
        make_exchange(group, topk=2, num_experts=4, overlap_sms=True)
    return [type(chunks).__name__, chunks.chunk_rows, isinstance(chunks, NcclChunks),
            isinstance(lazy, GroupExchange), lazy.kind]


def test_make_exchange_over_a_group():
    for result in run_ranks(_group_kinds, 2):
        assert result == repr(["NcclChunks", 4, True, True,
                               "live rows (built at the first forward)"]), result
