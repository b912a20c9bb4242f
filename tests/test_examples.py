"""``examples/``: each does what its docstring says on a CPU, and says where it runs."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(example, argv, capsys) -> tuple[list, list]:
    assert example.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    return out, [float(line.split("loss ")[1]) for line in out if line.startswith("step ")]


def test_hf_example_on_the_cpu_runs_tiny_and_says_so_first(capsys):
    out, losses = _run(_load("hf_moe_train"), ["--device", "cpu", "--steps", "4"], capsys)
    assert out[0].startswith("hf_moe_train: tiny Qwen3-MoE") and "on cpu: eagerly" in out[0]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert out[-1].startswith("0 graph replays, 4 eager steps, 0 dropless reruns")


@pytest.mark.slow
def test_hf_example_by_default_learns_what_its_docstring_says(capsys):
    """Without flags on a CPU: the tiny model's loss falls from a uniform guess (ln 64) to
    well below it in the default 20 steps."""
    out, losses = _run(_load("hf_moe_train"), ["--device", "cpu"], capsys)
    assert len(losses) == 20
    assert abs(losses[0] - torch.log(torch.tensor(64.0)).item()) < 0.3, losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert out[-1].startswith("0 graph replays, 20 eager steps, 0 dropless reruns")
