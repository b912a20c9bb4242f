"""Autograd integration of the paged stash: saved-tensor hooks, layer groups, pack/unpack
streams, schedule recording and reload prefetch.

``stash_activations(num_tokens)`` marks a layer group; a :class:`StashManager` owns the
:class:`~graphstash.PagedStashBuffer`\\ s (one per dtype and row width), the side streams and
the status tensor; :class:`StashConfig` says how it sizes them. The design notes are beside
the code: sizing in ``buffers.py`` (warmup sizing), what is stashed in ``plan.py`` (budget,
stash plan), the scheduling in ``scheduler.py`` (pre-schedule, prefetch, capture).
"""
from __future__ import annotations

from .config import StashConfig
from .context import current_manager, require_zero_tail, stash_activations
from .manager import StashManager
from .trace import StashTrace

__all__ = ["StashConfig", "StashManager", "StashTrace", "current_manager", "require_zero_tail",
           "stash_activations"]
