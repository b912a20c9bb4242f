"""``graphstash bench hf`` on the CPU: its presets and options, and its runs at a tiny OLMoE size
(graph_step runs every step eagerly on the CPU, so what is checked is the wiring: which model
is compiled how, what each run reports, failures reported and not raised). The full run of
every compiled run (``aot_eager``: dynamo and AOTAutograd without Inductor's code generation)
is slow-marked; the timed figures come from ``graphstash bench hf`` on a GPU."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from graphstash.tools.bench import hf
from graphstash.tools.cli import build_parser

# A tiny OLMoE (the family of the olmoe-1b-7b preset): 1 layer, 4 experts top-2, 2 x 16 tokens.
TINY = hf.HFBenchConfig("olmoe", hidden=32, layers=1, num_experts=4, topk=2, ffn=24, vocab=96,
                        heads=4, kv_heads=4, head_dim=None, batch=2, seq_len=16, steps=4)
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


def _args(*argv):
    return build_parser().parse_args(["bench", "hf", *argv])


def _data(gen, c=TINY):
    """``c.steps`` batches of token ids drawn from the test's generator."""
    return [torch.randint(0, c.vocab, (c.batch, c.seq_len), generator=gen)
            for _ in range(c.steps)]


# ---- presets and options ---------------------------------------------------------------------
def test_olmoe_preset_has_olmoe_1b_7b_widths():
    c = hf.configs_from_args(_args("--preset", "olmoe-1b-7b"), False)["olmoe-1b-7b"]
    assert (c.hidden, c.num_experts, c.topk, c.ffn, c.heads, c.vocab) == \
        (2048, 64, 8, 1024, 16, 50304)
    assert (c.layers, c.batch, c.seq_len, c.steps) == (8, 4, 2048, 14)
    config = hf.hf_config(c)
    assert type(config).__name__ == "OlmoeConfig"
    assert (config.hidden_size, config.intermediate_size, config.num_experts,
            config.num_experts_per_tok, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.num_hidden_layers, config.norm_topk_prob) == \
        (2048, 1024, 64, 8, 16, 16, 50304, 8, False)


def test_gpt_oss_preset_has_gpt_oss_20b_widths_and_runs_through_graphstash(gen):
    """hidden 2880, 32 experts top-4, 4 layers, 4 x 2048 tokens; its experts (biases,
    transposed and interleaved weights, clamped GLU) build under "graphstash" (meta device:
    nothing is allocated)."""
    import transformers as tf

    import graphstash.integrations.transformers as gst

    c = hf.configs_from_args(_args("--preset", "gpt-oss-20b"), False)["gpt-oss-20b"]
    assert (c.hidden, c.num_experts, c.topk, c.ffn, c.layers, c.batch, c.seq_len) == \
        (2880, 32, 4, 2880, 4, 4, 2048)
    config = hf.hf_config(c)
    assert type(config).__name__ == "GptOssConfig"
    assert (config.hidden_size, config.intermediate_size, config.num_local_experts,
            config.num_experts_per_tok, config.num_hidden_layers, config.layer_types) == \
        (2880, 2880, 32, 4, 4, ["sliding_attention", "full_attention"] * 2)
    gst.register()
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, experts_implementation="graphstash",
                                                    attn_implementation=c.attention)
    assert len(gst.experts_modules(model)) == 4


def test_olmoe_preset_at_8_layers_has_3_56_billion_parameters():
    """The issue's model: OLMoE-1B-7B cut to 8 layers is 3.56 B parameters (counted on the
    meta device: nothing is allocated)."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf.hf_config(hf.CONFIGS["olmoe-1b-7b"]),
                                                    experts_implementation="grouped_mm")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(3.5626e9, rel=1e-4)


def test_options_change_the_preset_and_quick_shrinks_it():
    got = hf.configs_from_args(_args("--preset", "olmoe-1b-7b", "--layers", "2", "--batch",
                                     "1", "--seq", "512", "--steps", "6"), False)
    assert got == {"olmoe-1b-7b": dataclasses.replace(
        hf.CONFIGS["olmoe-1b-7b"], layers=2, batch=1, seq_len=512, steps=6)}
    every = hf.configs_from_args(_args(), False)
    assert list(every) == list(hf.CONFIGS) and every["qwen3-moe"] == hf.CONFIGS["qwen3-moe"]
    short = hf.configs_from_args(_args("--quick"), True)["mixtral"]
    assert (short.layers, short.batch, short.steps) == (2, 2, 8)
    assert hf.configs_from_args(_args("--quick", "--layers", "3"), True)["mixtral"].layers == 3


def test_runs_option_keeps_the_reference_first():
    assert hf.runs_from_args(_args()) == tuple(hf.RUNS)
    picked = hf.runs_from_args(_args("--runs", "graphstash + compile + graph_step, "
                                     "HF grouped_mm + compile"))
    assert picked == ("HF grouped_mm eager", "HF grouped_mm + compile",
                      "graphstash + compile + graph_step")


@pytest.mark.parametrize("argv, message", [
    (("--layers", "0"), "--layers: expected a positive int, got 0"),
    (("--batch", "-1"), "--batch: expected a positive int, got -1"),
    (("--seq", "1"), "--seq: expected an int >= 2, got 1"),
    (("--steps", "3"), "--steps: expected an int >= 4, got 3"),
])
def test_bad_sizes_name_their_option(argv, message):
    with pytest.raises(ValueError, match=message):
        hf.configs_from_args(_args(*argv), False)


def test_bad_runs_name_the_option():
    with pytest.raises(ValueError, match="--runs: expected names from .*got 'HF compiled'"):
        hf.runs_from_args(_args("--runs", "HF compiled"))


def test_compile_arguments_per_mode():
    assert hf.compile_arguments(None, None) is None
    assert hf.compile_arguments("default", None) == {}
    assert hf.compile_arguments("reduce-overhead", None) == {"mode": "reduce-overhead"}
    # another backend takes no Inductor mode; Inductor named explicitly keeps it
    assert hf.compile_arguments("reduce-overhead", {"backend": "aot_eager"}) == \
        {"backend": "aot_eager"}
    assert hf.compile_arguments("reduce-overhead", {"backend": "inductor"}) == \
        {"backend": "inductor", "mode": "reduce-overhead"}


# ---- the runs ----------------------------------------------------------------------------------
def test_uncompiled_runs_train_alike_and_report_their_figures(gen, capsys):
    """HF eager, HF under graph_step and the graphstash backend under graph_step, through
    :func:`hf.run` as the command runs them: the same losses step by step (graph_step adds
    nothing on the CPU; the graphstash experts differ from HF's by rounding only), the loss
    falls, and the table and the JSON say so."""
    args = _args("--runs", "HF grouped_mm + graph_step,graphstash + graph_step")
    results = hf.run(args=args, device=CPU, configs={"tiny": TINY})
    runs = results["tiny"]
    assert list(runs) == ["HF grouped_mm eager", "HF grouped_mm + graph_step",
                          "graphstash + graph_step"]
    ref = runs["HF grouped_mm eager"]
    assert ref["error"] is None and len(ref["losses"]) == TINY.steps
    assert runs["HF grouped_mm + graph_step"]["max_rel_loss_diff"] == 0.0
    assert 0.0 <= runs["graphstash + graph_step"]["max_rel_loss_diff"] < 1e-3
    for res in runs.values():
        assert res["error"] is None and res["step_ms"] > 0 and res["tokens_per_s"] > 0
        assert res["peak_mib"] is None                       # no memory figures on the CPU
        assert res["best_hf"] in hf.HF_PEERS and res["config"]["family"] == "olmoe"
    assert runs["graphstash + graph_step"]["captures"] == 0   # eager on the CPU
    json.dumps(results)                                      # --json writes it
    out = capsys.readouterr().out
    assert "tiny: 1 layers, hidden 32, 4 experts top-2" in out and "2 x 16 = 32 tokens" in out
    for name in runs:
        assert name in out


def test_losses_fall_over_the_steps(gen):
    """The batches repeat one sequence, so the model learns it: a run whose optimizer did not
    step, or whose gradients did not reach the weights, would repeat its loss (at the bench's
    lr, 1e-4, five steps take off about 0.7 %)."""
    one = torch.randint(0, TINY.vocab, (TINY.batch, TINY.seq_len), generator=gen)
    res = hf.run_one(dataclasses.replace(TINY, steps=5), "graphstash + graph_step", CPU,
                     [one] * 5)
    losses = res["losses"]
    assert res["error"] is None
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.995 * losses[0], \
        losses


class RecordingCompile:
    """Stands in for ``torch.compile``: records its arguments, returns a wrapper that counts
    the calls and runs the model uncompiled (the wiring without dynamo's seconds)."""

    def __init__(self):
        self.kwargs, self.calls = [], 0

    def __call__(self, model, **kwargs):
        self.kwargs.append(kwargs)

        def compiled(*args, **kw):
            self.calls += 1
            return model(*args, **kw)
        return compiled


@pytest.mark.parametrize("name, kwargs, marks", [
    ("HF grouped_mm + compile", {}, 0),
    ("HF grouped_mm + compile (reduce-overhead)", {"mode": "reduce-overhead"}, 4),
    ("graphstash + compile", {}, 0),
    ("graphstash + compile + graph_step", {}, 0)])
def test_compiled_runs_call_the_compiled_model(gen, monkeypatch, name, kwargs, marks):
    fake = RecordingCompile()
    steps = []
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    data = _data(gen)
    res = hf.run_one(TINY, name, CPU, data)
    assert res["error"] is None
    assert fake.kwargs == [kwargs] and fake.calls == TINY.steps
    assert len(steps) == marks             # reduce-overhead: a new iteration per step
    ref = hf.run_one(TINY, "HF grouped_mm eager", CPU, data)
    assert hf.max_rel_diff(res["losses"], ref["losses"]) < 1e-3


def test_a_failed_run_is_reported_and_the_next_runs(gen, monkeypatch, capsys):
    import graphstash
    import graphstash.integrations.transformers as gst

    def refused(model, **kwargs):
        raise graphstash.CaptureError("the capture was refused\nsecond line", cause="compile")

    monkeypatch.setattr(gst, "configure", refused)
    args = _args("--runs", "graphstash + graph_step,HF grouped_mm + graph_step")
    runs = hf.run(args=args, device=CPU, configs={"tiny": TINY})["tiny"]
    failed = runs["graphstash + graph_step"]
    assert failed["error"] == "CaptureError(compile): the capture was refused"
    assert "step_ms" not in failed and failed["max_rel_loss_diff"] is None
    assert runs["HF grouped_mm + graph_step"]["error"] is None        # ran after it
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("graphstash + graph_step ")]
    assert row and row[0].endswith("failed: CaptureError(compile): the capture was refused"), row


def test_comparisons_take_the_fastest_hf_run_that_worked():
    def ok(ms, peak, losses):
        return {"error": None, "step_ms": ms, "peak_mib": peak, "losses": losses}

    runs = {"HF grouped_mm eager": ok(10.0, 400.0, [2.0, 1.0]),
            "HF grouped_mm + compile": ok(8.0, 300.0, [2.0, 1.001]),
            "HF grouped_mm + compile (reduce-overhead)": {"error": "x", "losses": [2.0]},
            "graphstash + compile + graph_step": ok(6.0, 240.0, [2.002, 1.0])}
    hf.add_comparisons(runs)
    ours = runs["graphstash + compile + graph_step"]
    assert ours["best_hf"] == "HF grouped_mm + compile"
    assert ours["ratio_to_best_hf"] == pytest.approx(0.75)
    assert ours["peak_ratio_to_best_hf"] == pytest.approx(0.8)
    assert ours["speedup"] == pytest.approx(10 / 6)
    assert ours["max_rel_loss_diff"] == pytest.approx(1e-3)
    assert runs["HF grouped_mm + compile"]["max_rel_loss_diff"] == pytest.approx(1e-3)
    failed = runs["HF grouped_mm + compile (reduce-overhead)"]
    assert failed["speedup"] is None and failed["ratio_to_best_hf"] is None


@pytest.mark.slow
def test_every_run_compiled_for_real_on_a_tiny_olmoe(gen, capsys):
    """All eight runs, the compiled ones with ``aot_eager``: each finishes (no compile after
    graph_step's warmup: on the CPU the call that would capture refuses one) and trains as HF
    eager does."""
    args = _args()
    runs = hf.run(args=args, device=CPU, configs={"tiny": TINY},
                  compile_kwargs={"backend": "aot_eager"})["tiny"]
    assert list(runs) == list(hf.RUNS)
    for name, res in runs.items():
        assert res["error"] is None, (name, res["error"])
        assert res["max_rel_loss_diff"] < 1e-3, name
    out = capsys.readouterr().out
    assert "failed" not in out
