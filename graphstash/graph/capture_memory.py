"""The memory a captured step holds beside an eager one, and what graph_step gives back
before it captures (NOTE [capture memory]).

NOTE [capture memory]: a captured step allocates nothing when it replays: its activations,
temporaries and gradients live in the graph's private pool, laid out once by the capture,
where the gradients take memory the forward's activations freed (the first backward inside
the graph writes them, NOTE [gradients]), as in an eager step that zeroes them to None. So
its peak of allocated memory is the capture's, and beside an eager step of the same model
the capture holds only a static copy of every tensor argument (the caller's own tensors stay
alive too) and the cuBLAS workspaces of graph_step's stream (the warmup calls create them,
running on that stream as the capture must). That is the floor; docs/compile-capture.md
gives it measured. What the device holds is more than what is allocated: the ordinary pool
keeps the blocks the warmup steps freed cached, several GiB at real widths, while the
graph's pool reserves its own blocks for the same activations, and both stay reserved while
the graph lives. :func:`release_warmup_cache` returns the ordinary pool's free blocks to the
device right before the capture, so the graph's pool takes the memory the warmup used
instead of adding to it.
"""
from __future__ import annotations

import torch


def release_warmup_cache(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the device before a capture (NOTE
    [capture memory]). Blocks in use and the pools of live graphs are untouched; not
    capturable (it synchronises the device)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
