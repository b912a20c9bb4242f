"""Training-like routing of the reference model (NOTE [training-like routing]): the specs, the
bias each gives, and what the router then does with it."""
from __future__ import annotations

import pytest
import torch

from graphstash.models import MoEConfig, MoEModel, Routing, parse_routing, routing_bias


def test_specs_parse_and_print():
    assert parse_routing("balanced") == Routing()
    assert parse_routing("skew:1.5") == Routing("skew", 1.5)
    assert parse_routing("zipf:1.2") == Routing("zipf", 1.2)
    assert parse_routing("drift") == Routing("drift", 1.5, 10)
    assert parse_routing("drift:2:5") == Routing("drift", 2.0, 5)
    assert str(parse_routing("drift:2:5")) == "drift:2:5"
    for bad in ("skew", "skew:x", "zipf:-1", "drift:1:0", "tilt:1", "balanced:1", "skew:nan",
                "drift:1:2:3"):
        with pytest.raises(ValueError, match="routing: expected 'balanced', 'skew:X'"):
            parse_routing(bad)
    with pytest.raises(TypeError, match="routing: expected a spec string"):
        parse_routing(1.5)
    with pytest.raises(ValueError, match="routing"):
        MoEConfig(routing="skew")


def test_bias_of_each_spec():
    assert torch.equal(routing_bias("balanced", 8), torch.zeros(8))
    skew = routing_bias("skew:1.5", 8, world_size=4)
    assert skew.tolist() == [1.5, 1.5] + [0.0] * 6          # rank 0's two experts
    assert routing_bias("skew:1", 7).tolist() == [1.0] * 4 + [0.0] * 3   # one device: a half
    zipf = routing_bias("zipf:1.2", 5)
    assert zipf[0] == 0 and bool((zipf[1:] < zipf[:-1]).all())
    torch.testing.assert_close(zipf[3], torch.tensor(-1.2 * torch.log(torch.tensor(4.0)).item()))
    firsts = [routing_bias("drift:2:3", 8, world_size=2, step=s).nonzero()[0].item()
              for s in (0, 2, 3, 5, 6)]
    assert firsts == [0, 0, 4, 4, 0]                         # moves every 3 steps, wraps


def _shares(model, x, world=2):
    """The share of the slots each rank's experts receive in the first block."""
    block = model.blocks[0]
    idx, _ = block.route(block.norm(x))
    per = model.config.num_experts // world
    return [float(((idx // per) == r).float().mean()) for r in range(world)]


def test_skew_favours_one_ranks_experts_and_drift_moves():
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(0))
    config = MoEConfig(hidden=32, ffn=16, num_experts=8, topk=2, layers=1, num_tokens=512)
    base = _shares(MoEModel(config, seed=1), x)
    skewed = _shares(MoEModel(MoEConfig(**{**config.__dict__, "routing": "skew:3"}), seed=1), x)
    assert skewed[0] > base[0] + 0.2, (base, skewed)
    drift = MoEModel(MoEConfig(**{**config.__dict__, "routing": "drift:3:4"}), seed=1)
    first = _shares(drift, x)
    drift.set_routing_step(4)
    moved = _shares(drift, x)
    assert first[0] > 0.7 and moved[1] > 0.7, (first, moved)
    with pytest.raises(ValueError, match="step: expected an int >= 0"):
        drift.set_routing_step(-1)


def test_balanced_model_is_unchanged_and_bias_is_not_saved():
    config = MoEConfig(hidden=16, ffn=16, num_experts=4, layers=2, num_tokens=8)
    plain = MoEModel(config, seed=2)
    assert all(b.routing_bias is None for b in plain.blocks)
    skewed = MoEModel(MoEConfig(**{**config.__dict__, "routing": "zipf:1"}), seed=2)
    assert set(skewed.state_dict()) == set(plain.state_dict())
    x = torch.randn(8, 16)
    # the same weights: only the router bias differs, and it changes the output
    assert not torch.equal(plain(x), skewed(x))
    skewed.load_state_dict(plain.state_dict())
    for b in skewed.blocks:
        b.routing_bias.zero_()
    torch.testing.assert_close(plain(x), skewed(x), rtol=0, atol=0)


def test_drift_steps_advance_with_each_call_of_a_bench_step():
    from graphstash.tools.training import routed_step

    config = MoEConfig(hidden=16, ffn=16, num_experts=4, layers=1, num_tokens=8,
                       routing="drift:2:1")
    model = MoEModel(config, seed=0)
    seen = []
    step = routed_step(model, lambda x: seen.append(model.blocks[0].routing_bias.clone()))
    for _ in range(3):
        step(None)
    assert [b.nonzero()[0].item() for b in seen] == [0, 2, 0]      # moved at every call
    still = MoEModel(MoEConfig(**{**config.__dict__, "routing": "skew:2"}), seed=0)
    plain = object()
    assert routed_step(still, plain) is plain                       # constant bias: unchanged


def test_bench_flag_is_checked_by_name():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "graphstash", "bench", "moe", "--device", "cpu",
                           "--quick", "--routing", "zipf"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc
    assert "graphstash bench: error: --routing: expected 'balanced', 'skew:X'" in proc.stderr
