"""The graph manager: :func:`graph_step` captures a whole training iteration in a CUDA graph,
skips a flagged update on the device, reruns it eagerly (dropless) and tears down on request."""
from __future__ import annotations

from ._options import StepOptions
from ._step import GraphInfo, GraphStep, GraphStepStats, ReplayInfo, graph_step, live_graphs
from ._update import DeviceUpdate, check_optimizer

__all__ = ["GraphStep", "GraphStepStats", "GraphInfo", "ReplayInfo", "StepOptions",
           "DeviceUpdate", "check_optimizer", "graph_step", "live_graphs"]
