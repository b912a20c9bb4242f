"""The compatibility matrix (``python -m graphstash.tools.hf_matrix``): every transformers MoE
family whose experts use the experts interface runs under ``experts_implementation=
"graphstash"`` and matches the default implementation (float32, 3e-5 relative in the output,
the expert gradients and the output after an SGD step, with the experts' share of the output
large). A representative subset runs by default (GPT-OSS: biases, transposed and interleaved
weights, clamped GLU; DeepSeek-V4: clamped SwiGLU; Gemma-4: GELU-tanh; Nemotron-H: ReLU² in
plain experts; Aria: transposed weights; Muse Spark: a norm after each expert); every family
is ``slow``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers (the hf / dev extra)")

from graphstash.tools import hf_families, hf_matrix          # noqa: E402

FAST = ("gpt_oss", "deepseek_v4", "gemma4", "nemotron_h", "aria", "muse_spark")


def _assert_matches(family: str) -> None:
    row = hf_matrix.check(family)
    assert row.status == "matches", row
    assert row.output_error <= hf_matrix.RTOL and row.grad_error <= hf_matrix.RTOL, row
    assert row.step_error <= hf_matrix.RTOL, row
    assert row.share > hf_matrix.MIN_SHARE, row          # the experts make the output


@pytest.mark.parametrize("family", FAST)
def test_representative_families_match_the_default_implementation(family):
    if family not in hf_families.families():
        pytest.skip(f"this transformers has no {family} family")
    _assert_matches(family)


def _all_families():
    try:
        return hf_families.families()
    except ImportError:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in _all_families() if f not in FAST])
def test_every_family_matches_the_default_implementation(family):
    _assert_matches(family)


def test_the_matrix_finds_the_families_of_the_experts_interface():
    found = hf_families.families()
    assert {"mixtral", "qwen3_moe", "gpt_oss"} <= set(found)
    assert "llama" not in found
