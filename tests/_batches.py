"""Batches of every container kind graph_step stages (NOTE [what a step may take]), shared by
the CPU and GPU staging tests: ``make(kind, a, b)`` builds the call's arguments around two
tensors, ``take(kind, args)`` gets them back and checks that the container types were kept."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

ROWS, WIDTH = 40, 32           # 1280 elements: torch's repr elides the middle of such a tensor


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    note: str = "fixed"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    ids: torch.Tensor
    mask: torch.Tensor


Pair = collections.namedtuple("Pair", ["ids", "mask"])


_ATTRS = []


def _attrs_batch_type():
    """A frozen, slotted attrs class (made once: the type is part of a call's signature)."""
    if not _ATTRS:
        attr = pytest.importorskip("attr")

        @attr.s(frozen=True, slots=True)
        class AttrsBatch:
            ids = attr.ib()
            mask = attr.ib()

        _ATTRS.append(AttrsBatch)
    return _ATTRS[0]


def _batch_encoding(a, b):
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding({"input_ids": a, "attention_mask": b})


def make(kind: str, a: torch.Tensor, b: torch.Tensor):
    """A batch of kind ``kind`` holding ``a`` and ``b``."""
    if kind == "tensors":
        return (a, b)
    if kind == "list":
        return ([a, b],)
    if kind == "nested":
        return ({"x": a, "more": [{"y": (b,)}]},)
    if kind == "namedtuple":
        return (Pair(a, b),)
    if kind == "dataclass":
        return (Batch(a, b),)
    if kind == "frozen_dataclass":
        return (FrozenBatch(a, b),)
    if kind == "batch_encoding":
        return (_batch_encoding(a, b),)
    if kind == "attrs":
        return (_attrs_batch_type()(a, b),)
    if kind == "mixed":
        return ({"enc": _batch_encoding(a, b[:1]), "rest": Batch(b[1:], b[:1])},)
    raise AssertionError(kind)


def take(kind: str, args) -> tuple:
    """The two tensors of a batch of kind ``kind``, checking that its types were kept."""
    if kind == "tensors":
        return args
    (batch,) = args
    if kind == "list":
        assert type(batch) is list
        return tuple(batch)
    if kind == "nested":
        assert type(batch["more"][0]["y"]) is tuple
        return batch["x"], batch["more"][0]["y"][0]
    if kind == "namedtuple":
        assert type(batch) is Pair
        return batch.ids, batch.mask
    if kind in ("dataclass", "frozen_dataclass"):
        assert type(batch) is (Batch if kind == "dataclass" else FrozenBatch)
        return batch.ids, batch.mask
    if kind == "batch_encoding":
        import transformers

        assert type(batch) is transformers.BatchEncoding
        return batch["input_ids"], batch["attention_mask"]
    if kind == "attrs":
        assert type(batch).__name__ == "AttrsBatch"
        return batch.ids, batch.mask
    if kind == "mixed":
        assert type(batch["rest"]) is Batch and batch["rest"].note == "fixed"
        return batch["enc"]["input_ids"], torch.cat([batch["enc"]["attention_mask"],
                                                     batch["rest"].ids])
    raise AssertionError(kind)


KINDS = ["tensors", "list", "nested", "namedtuple", "dataclass", "frozen_dataclass",
         "batch_encoding", "attrs", "mixed"]
