"""``graphstash bench moe``'s modes on the CPU at a tiny size (graph_step runs every step eagerly
there; on the call that would capture it refuses any compile, as a capture would), the compile
switch of the shared training set-up, the ratio to the best peer, failures reported in the
table, and the kernel-time shares of ``--profile``. Compiled code uses ``aot_eager`` (dynamo
and AOTAutograd without Inductor's code generation); the timed figures come from ``graphstash
bench moe`` on a GPU."""
from __future__ import annotations

import json

import pytest
import torch

import graphstash
from graphstash.models import MoEConfig
from graphstash.tools import training
from graphstash.tools.bench import kernel_share, moe
from graphstash.tools.cli import build_parser

TINY = MoEConfig(hidden=32, ffn=48, num_experts=4, topk=2, layers=1, num_tokens=64,
                 capacity_factor=1.0, gated=True)
TINY_ARGS = ("--hidden", "32", "--ffn", "48", "--experts", "4", "--topk", "2", "--layers", "1",
             "--tokens", "64", "--steps", "2")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread_fresh_dynamo():
    """One intra-op thread (tiny ops on a shared 2-core machine wait on each other) and
    dynamo's caches empty before and after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


class CountingBackend:
    """``aot_eager`` that counts the graphs it compiles."""

    def __init__(self):
        self.graphs = 0
        self._inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self._inner(graph_module, example_inputs)


def _args(*argv):
    return build_parser().parse_args(["bench", "moe", *argv])


def _seed(gen) -> int:
    return int(torch.randint(1 << 20, (1,), generator=gen))


# ---- the compile switch of the shared set-up ---------------------------------------------------
def test_compiled_training_run_equals_the_uncompiled_one(gen):
    """``training.build(compile_kwargs=...)``: the step calls the compiled model (it compiles
    in the first warmup call, nothing after), and trains exactly as the uncompiled model does
    (float32; NOTE [training loss] reaches every parameter, which moves)."""
    config = TINY
    batches = training.batches(config, 4, seed=_seed(gen), device=CPU, dtype=torch.float32)
    backend = CountingBackend()
    runs = {}
    for name, kwargs in (("eager", None), ("compiled", {"backend": backend})):
        with training.quiet_cpu_graph_step(False):
            run = training.build(config, "budget", CPU, torch.float32, graphed=True, seed=3,
                                 lr=1e-2, compile_kwargs=kwargs)
            initial = [p.detach().clone() for p in run.model.parameters()]
            losses = []
            for i, (x, y) in enumerate(batches):
                losses.append(float(run.step(x, y)))
                if name == "compiled" and i == training.WARMUP - 1:
                    after_warmup = backend.graphs
        runs[name] = (run, initial, losses)
    compiled, initial, losses = runs["compiled"]
    assert compiled.compiled is not None and runs["eager"][0].compiled is None
    assert after_warmup > 0 and backend.graphs == after_warmup
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["eager"][2]),
                               rtol=1e-5, atol=1e-6)
    for (name, p), p0, q in zip(compiled.model.named_parameters(), initial,
                                runs["eager"][0].model.parameters()):
        assert float((p.detach() - p0).abs().max()) > 1e-4, name    # the loss reached it
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_kwargs_must_be_a_dict():
    with pytest.raises(TypeError, match="compile_kwargs: expected a dict"):
        training.build(TINY, "budget", CPU, torch.float32, graphed=False,
                       compile_kwargs="inductor")


# ---- the modes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["plain compiled graph",
                                  pytest.param("graph + budget compiled", marks=pytest.mark.slow)])
def test_compiled_mode_runs_on_the_cpu(gen, mode):
    """The compiled modes under graph_step: compiled in the warmup (the call that would
    capture refuses a compile), every figure reported; on the CPU no memory figures."""
    batches = training.batches(TINY, 3, seed=_seed(gen), device=CPU, dtype=torch.bfloat16)
    backend = CountingBackend()
    figures = moe.run_mode(mode, TINY, None, CPU, batches, 2,
                           compile_kwargs={"backend": backend})
    assert backend.graphs > 0
    assert figures["step_ms"] > 0 and figures["reruns"] == 0 and figures["overflow"] == 0
    assert figures["peak_mib"] is None and figures["activation_peak_mib"] is None
    assert figures["kernels"] is None                         # --profile: CUDA only


def test_run_mode_refuses_unknown_modes_and_too_few_batches():
    with pytest.raises(ValueError, match="mode: expected one of plain eager"):
        moe.run_mode("compiled", TINY, None, CPU, [], 2)
    with pytest.raises(ValueError, match="batches: expected at least 3"):
        moe.run_mode("plain eager", TINY, None, CPU, [None, None], 2)


@pytest.mark.slow
def test_every_mode_runs_on_the_cpu(capsys):
    """``run`` with every mode, the compiled ones with ``aot_eager``: each finishes, the best
    peer is one of the plain modes, the table and the JSON hold every mode."""
    out = moe.run(args=_args(*TINY_ARGS), device=CPU, compile_kwargs={"backend": "aot_eager"})
    result = out["custom"]
    assert list(result["results"]) == list(moe.MODES)
    for mode, r in result["results"].items():
        assert "error" not in r, (mode, r)
        assert r["ratio_to_best_peer"] > 0
    assert result["best_peer"] in moe.PEERS
    json.dumps(out)
    printed = capsys.readouterr().out
    for mode in moe.MODES:
        assert mode in printed


# ---- the table: ratio to the best peer, failures -----------------------------------------------
def _figures(step_ms, act=None, kernels=None):
    return {"step_ms": step_ms, "peak_mib": None if act is None else act + 100.0,
            "activation_peak_mib": act, "exchanged_mib": 0.0, "over_budget": 0,
            "overflow": 0, "reruns": 0, "stashed_groups": 0, "groups": 0, "kernels": kernels}


FAKE = {"plain eager": 30.0, "plain graph": 25.0, "plain compiled eager": 22.0,
        "plain compiled graph": 20.0, "eager dropless": 40.0, "graph + budget": 18.0,
        "graph + budget + stash": 19.0}


def _fake_run_mode(mode, config, group, device, batches, steps, *, compile_kwargs=None,
                   profile=False, **_):
    if mode == "graph + budget compiled":
        raise graphstash.CaptureError("the step compiled inside the capture\ndetails",
                                      cause="compile")
    kernels = None
    if profile:
        kernels = kernel_share.shares([("GemmUniversal<GroupProblemShape<>>", 600.0),
                                       ("FusedAdamMathFunctor", 200.0),
                                       ("triton_poi_fused_silu", 200.0)], 1)
    return _figures(FAKE[mode], act=10 * FAKE[mode], kernels=kernels)


def test_ratios_are_to_the_fastest_peer_and_a_failed_mode_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(moe, "run_mode", _fake_run_mode)
    out = moe.run(args=_args(*TINY_ARGS, "--profile"), device=CPU)["custom"]
    results = out["results"]
    assert out["best_peer"] == "plain compiled graph"
    assert results["graph + budget"]["ratio_to_best_peer"] == pytest.approx(0.9)
    assert results["plain eager"]["ratio_to_best_peer"] == pytest.approx(1.5)
    assert results["graph + budget"]["activation_ratio_to_best_peer"] == pytest.approx(0.9)
    failed = results["graph + budget compiled"]
    assert failed == {"error": "failed: CaptureError(compile): the step compiled inside the "
                               "capture"}
    printed = capsys.readouterr().out
    lines = {}
    for line in printed.splitlines():           # the first row of each mode: the main table
        lines.setdefault(line.split("  ")[0].strip(), line)
    assert "0.900" in lines["graph + budget"]
    assert lines["graph + budget compiled"].endswith(failed["error"])
    assert "best peer of this run, 'plain compiled graph'" in printed
    # --profile: the shares table, one row per mode that ran
    assert "grouped GEMM" in printed and "optimizer" in printed
    assert printed.count("60.0%") == len(FAKE) and printed.count("20.0%") == 2 * len(FAKE)


def test_best_peer_ignores_failed_peers_and_graphstash_modes():
    results = {"plain eager": _figures(30.0), "plain compiled graph": {"error": "failed: x"},
               "graph + budget": _figures(10.0)}
    assert moe.best_peer(results) == "plain eager"
    assert moe.add_ratios(results) == "plain eager"
    assert results["graph + budget"]["ratio_to_best_peer"] == pytest.approx(1 / 3)
    assert results["graph + budget"]["activation_ratio_to_best_peer"] is None   # CPU: no peak
    assert moe.best_peer({"graph + budget": _figures(10.0)}) is None


def test_compiled_modes_are_graphed_or_eager_as_named():
    assert set(moe.COMPILED) <= set(moe.MODES) and set(moe.PEERS) <= set(moe.MODES)
    assert "plain compiled graph" in moe.GRAPHED and "graph + budget compiled" in moe.GRAPHED
    assert "plain compiled eager" not in moe.GRAPHED
    assert {moe.MODEL_MODE[m] for m in moe.PEERS} == {"plain"}
    assert moe.modes_from_args(_args("--modes", "plain compiled graph,graph + budget compiled")) \
        == ("plain compiled graph", "graph + budget compiled")
