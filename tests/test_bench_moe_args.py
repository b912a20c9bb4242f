"""``graphstash bench moe`` options and the model presets: bad values name their option."""
from __future__ import annotations

import dataclasses

import pytest

from graphstash.tools.bench import moe
from graphstash.tools.cli import build_parser
from graphstash.models import PRESETS, MoEConfig, preset


def _args(*argv):
    return build_parser().parse_args(["bench", "moe", *argv])


def test_presets_have_the_real_widths():
    q, m = PRESETS["qwen3-30b-a3b"], PRESETS["mixtral-8x7b"]
    assert (q.hidden, q.num_experts, q.topk, q.ffn, q.gated) == (2048, 128, 8, 768, True)
    assert (m.hidden, m.num_experts, m.topk, m.ffn, m.gated) == (4096, 8, 2, 14336, True)
    assert preset("mixtral-8x7b", layers=3).layers == 3
    assert PRESETS["mixtral-8x7b"].layers == 32            # the preset itself is untouched
    with pytest.raises(ValueError, match="name"):
        preset("mixtral")
    with pytest.raises(TypeError, match="overrides"):
        preset("mixtral-8x7b", width=3)


def test_options_select_configurations():
    assert set(moe.configs_from_args(_args(), quick=False)) == set(PRESETS) | set(moe.CONFIGS)
    got = moe.configs_from_args(_args("--preset", "qwen3-30b-a3b", "--layers", "2",
                                      "--tokens", "512", "--capacity-factor", "1.25"), False)
    assert got == {"qwen3-30b-a3b": dataclasses.replace(
        PRESETS["qwen3-30b-a3b"], layers=2, num_tokens=512, capacity_factor=1.25)}
    custom = moe.configs_from_args(_args("--hidden", "64", "--ffn", "96", "--experts", "4",
                                         "--topk", "2"), False)["custom"]
    assert (custom.hidden, custom.ffn, custom.num_experts, custom.topk, custom.gated) == \
        (64, 96, 4, 2, True)
    plain = moe.configs_from_args(_args("--hidden", "64", "--ffn", "96", "--experts", "4",
                                        "--topk", "2", "--plain-experts"), False)["custom"]
    assert not plain.gated
    assert moe.modes_from_args(_args("--modes", "plain graph,graph + budget")) == \
        ("plain graph", "graph + budget")


@pytest.mark.parametrize("argv, option", [
    (("--layers", "0"), "--layers"),
    (("--tokens", "-5"), "--tokens"),
    (("--capacity-factor", "nan"), "--capacity-factor"),
    (("--capacity-factor", "0"), "--capacity-factor"),
    (("--hidden", "64"), "--ffn"),                               # a custom shape needs all four
    (("--hidden", "64", "--ffn", "8", "--experts", "4", "--topk", "5"), "--topk"),
])
def test_bad_options_name_themselves(argv, option):
    with pytest.raises(ValueError, match=option):
        moe.configs_from_args(_args(*argv), False)


def test_bad_modes_name_the_option():
    with pytest.raises(ValueError, match="--modes"):
        moe.modes_from_args(_args("--modes", "graph"))


def test_bench_reports_bad_options_before_running(monkeypatch):
    from graphstash.tools.bench import main
    from graphstash.tools.options import FlagError

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)   # checked before the GPU
    with pytest.raises(FlagError, match="--layers: expected a positive int, got 0"):
        main(_args("--layers", "0"))


def test_moe_config_default_is_plain_experts():
    assert not MoEConfig().gated
