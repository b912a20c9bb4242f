"""PNG figures of benchmark results (``graphstash bench ... --plot DIR``), one per suite."""
from __future__ import annotations

import pathlib


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def kernels_figure(result: dict, plt):
    """The kernels suite's figure: torch copy time over graphstash time per shape, device
    and host tier side by side (``result`` as ``graphstash bench kernels`` returns it)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, tier in zip(axes, ("device", "host")):
        rows = [r for r in result["results"] if r["tier"] == tier]
        labels = [f"{r['dtype'][:4]} {r['hidden']}x{r['rows'] // 1024}k {int(r['live'] * 100)}%"
                  for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        ax.axhline(0.95, color="tab:red", lw=1, ls="--", label="0.95")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.set_ylabel("torch copy time / graphstash time")
        ax.set_title(f"{tier} tier on {result['gpu']}")
        ax.legend(fontsize=8)
    return fig


def _graph(result: dict, plt):
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(result)
    _grouped_bars(ax, names, {"eager": [result[n]["eager_ms"] for n in names],
                              "graph_step": [result[n]["graph_step_ms"] for n in names]},
                  "step time (ms)")
    ax.set_yscale("log")
    ax.set_title("graph_step vs eager")
    return fig


def _modes(result: dict, plt, title: str):
    """Suites shaped {config: {mode: {"step_ms", "peak_mib", ...}}}."""
    configs = list(result)
    fig, axes = plt.subplots(len(configs), 2, figsize=(11, 3.6 * len(configs)), squeeze=False)
    for row, cfg in zip(axes, configs):
        modes = [m for m in result[cfg] if "step_ms" in result[cfg][m]]
        for ax, key, label in zip(row, ("step_ms", "peak_mib"), ("step time (ms)", "peak MiB")):
            ax.bar(range(len(modes)), [result[cfg][m][key] for m in modes], color="tab:green")
            ax.set_xticks(range(len(modes)))
            ax.set_xticklabels(modes, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{title}: {cfg}")
    return fig


def _stash(result: dict, plt):
    configs = list(result)
    fig, ax = plt.subplots(figsize=(7, 4))
    mib = 2 ** 20
    _grouped_bars(ax, configs, {
        "no stash": [result[c]["peak_plain"] / mib for c in configs],
        "stash (pool included)": [result[c]["peak_stash"] / mib for c in configs],
        "exact-size eager": [result[c]["peak_exact"] / mib for c in configs]}, "peak MiB")
    ax.set_title("stash_activations: peak memory of forward + backward")
    return fig


def write(results: dict, directory) -> list[pathlib.Path]:
    """Write one PNG per suite in ``results`` (as returned by the suites' ``run``; the run's
    ``meta`` block, where there is one, is not a suite)."""
    plt = pyplot()
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    makers = {"kernels": kernels_figure, "graph": _graph, "stash": _stash,
              "moe": lambda r, p: _modes({c: v.get("results", v) for c, v in r.items()}, p,
                                         "moe"),
              "offload": lambda r, p: _modes({"offload": r["results"]}, p, "offload"),
              "hf": lambda r, p: _modes(r, p, "hf")}
    written = []
    for suite, result in results.items():
        if suite == "meta":
            continue
        fig = makers[suite](result, plt)
        fig.tight_layout()
        path = out / f"{suite}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
