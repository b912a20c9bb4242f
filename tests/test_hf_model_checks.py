"""What transformers' own model tests check for Qwen3-MoE, Mixtral, Qwen2-MoE and GPT-OSS, with
the graphstash experts backend against the default one: greedy generation with the dynamic
and the static key/value cache, save_pretrained / from_pretrained (the backend chosen at load),
and the tiny test configs' ``hidden_act="gelu"``. (transformers' test files live in its source
repository, not in the wheel; these are their checks written against the backends.)
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (the hf / dev extra)")

import graphstash.integrations.transformers as gst            # noqa: E402
from graphstash.tools import hf_families                        # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"]


@pytest.fixture(autouse=True, scope="module")
def _registered():
    gst.register()


def _pair(family: str, seed: int = 0, **overrides):
    """The family's tiny causal LM with the default experts and with graphstash's, same
    weights (each override set on the config before building)."""
    import transformers as tf

    cls = hf_families.model_class(family)
    config = hf_families.shrink(cls.config_class(), family)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.use_cache = True
    models = []
    for implementation in (None, gst.IMPLEMENTATION):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            models.append(tf.AutoModelForCausalLM.from_config(
                config, experts_implementation=implementation).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


def _prompt(seed: int = 1):
    return torch.randint(0, hf_families.VOCAB - 8, (2, 6),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_equals_the_default_backend(family, cache):
    ref, ours = _pair(family)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        want = ref.generate(_prompt(), **kwargs)
        got = ours.generate(_prompt(), **kwargs)
    assert want.shape[1] == _prompt().shape[1] + 8
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_with_the_backend_equals_the_default(family, tmp_path):
    """A checkpoint saved from a graphstash model loads with experts_implementation=
    "graphstash" (checked at load) and gives the default backend's logits."""
    import transformers as tf

    ref, ours = _pair(family)
    ours.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                     experts_implementation=gst.IMPLEMENTATION)
    assert loaded.config._experts_implementation == gst.IMPLEMENTATION
    ids = _prompt()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_test_configs_gelu_equals_the_default(family):
    """transformers' tiny test configs set hidden_act="gelu": the experts run GELU."""
    ref, ours = _pair(family, hidden_act="gelu")
    assert type(ours.model.layers[0].mlp.experts.act_fn).__name__ == "GELUActivation"
    ids = _prompt()
    with torch.no_grad():
        out = [model(input_ids=ids, labels=ids).logits for model in (ref, ours)]
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5 * float(out[0].abs().max()))
