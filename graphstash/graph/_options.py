"""The options of :func:`~graphstash.graph_step`, written once: :class:`StepOptions`.

``graph_step(fn, **options)`` and ``GraphStep(fn, **options)`` both build a
:class:`StepOptions` from their keywords, so every option has one name, one default and one
check. Bad values raise TypeError/ValueError naming the option.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch


def _check_device(device) -> torch.device | None:
    """``device=`` parsed, or ValueError/TypeError naming it."""
    if device is None:
        return None
    expected = "'cpu', 'cuda', 'cuda:N', a torch.device or None"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device: expected {expected}, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device: expected {expected}, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected {expected} (graph_step runs on CUDA, or eagerly on "
                         f"the CPU), got {device!r}")
    return dev


def _check_generators(generators) -> tuple:
    """``generators=`` as a tuple of ``torch.Generator``, or TypeError naming it."""
    expected = "a list or tuple of torch.Generator (or one torch.Generator)"
    if isinstance(generators, torch.Generator):
        return (generators,)
    if not isinstance(generators, (list, tuple)):
        raise TypeError(f"generators: expected {expected}, got {type(generators).__name__}")
    for i, gen in enumerate(generators):
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"generators[{i}]: expected a torch.Generator, got "
                            f"{type(gen).__name__}")
    return tuple(generators)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Everything :func:`~graphstash.graph_step` takes besides the step function.

    Each field is documented in :func:`~graphstash.graph_step`; construction checks every
    value (TypeError/ValueError naming the option). ``generators`` is normalised to a tuple and
    ``device`` to a ``torch.device`` (or None).

    Example::

        options = StepOptions(optimizer=opt, warmup=3)
        train_step = GraphStep(fn, **options.as_keywords())
    """

    optimizer: torch.optim.Optimizer | None = None
    scaler: object = None
    warmup: int = 2
    stash: object = None
    outputs: str = "clone"
    on_new_shape: str = "error"
    max_graphs: int = 4
    graph_memory_budget: int | None = None
    budget_growth: float = 1.5
    on_overflow: object = None
    generators: tuple = ()
    process_group: object = None
    distributed: object = "auto"
    update_skip: str = "auto"
    device: torch.device | None = None
    release_warmup_cache: bool = True

    def __post_init__(self):
        opt = self.optimizer
        if opt is not None and not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got "
                            f"{type(opt).__name__}")
        if isinstance(opt, torch.optim.LBFGS):
            raise ValueError("optimizer: LBFGS re-evaluates the loss through a closure several "
                             "times per step; graph_step calls optimizer.step() once, without a "
                             "closure. Use a first-order optimizer (AdamW, Adam or SGD)")
        if self.scaler is not None and opt is None:
            raise ValueError("scaler: a GradScaler needs the optimizer it scales; pass optimizer=")
        if self.scaler is not None and not hasattr(self.scaler, "unscale_"):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got "
                            f"{type(self.scaler).__name__}")
        warmup = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
        if self.outputs not in ("clone", "static"):
            raise ValueError(f"outputs: expected 'clone' (detached copies) or 'static' (the "
                             f"graph's own tensors, overwritten by the next call), got "
                             f"{self.outputs!r}")
        if self.on_new_shape not in ("error", "recapture"):
            raise ValueError(f"on_new_shape: expected 'error' or 'recapture', got "
                             f"{self.on_new_shape!r}")
        graphs = self.max_graphs
        if isinstance(graphs, bool) or not isinstance(graphs, int) or graphs < 1:
            raise ValueError(f"max_graphs: expected an int >= 1, got {graphs!r}")
        budget = self.graph_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget <= 0):
            raise ValueError(f"graph_memory_budget: expected a positive int (bytes) or None, "
                             f"got {budget!r}")
        growth = self.budget_growth
        if isinstance(growth, bool) or not isinstance(growth, (int, float)):
            raise TypeError(f"budget_growth: expected a finite number > 1, got "
                            f"{type(growth).__name__}")
        if not math.isfinite(growth) or growth <= 1.0:
            raise ValueError(f"budget_growth: expected a finite number > 1, got {growth!r}")
        if self.on_overflow is not None and not callable(self.on_overflow):
            raise TypeError(f"on_overflow: expected a callable or None, got "
                            f"{type(self.on_overflow).__name__}")
        if not (self.distributed is True or self.distributed is False
                or (isinstance(self.distributed, str) and self.distributed == "auto")):
            raise ValueError(f"distributed: expected 'auto', True or False, got "
                             f"{self.distributed!r}")
        if self.update_skip not in ("auto", "found_inf", "mask"):
            raise ValueError(f"update_skip: expected 'auto', 'found_inf' or 'mask', got "
                             f"{self.update_skip!r}")
        if not isinstance(self.release_warmup_cache, bool):
            raise TypeError(f"release_warmup_cache: expected a bool, got "
                            f"{type(self.release_warmup_cache).__name__}")
        object.__setattr__(self, "budget_growth", float(growth))
        object.__setattr__(self, "generators", _check_generators(self.generators))
        object.__setattr__(self, "device", _check_device(self.device))

    @classmethod
    def from_keywords(cls, where: str, keywords: dict) -> "StepOptions":
        """Options from ``keywords``; an unknown keyword raises TypeError naming it."""
        unknown = sorted(set(keywords) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{where}: unexpected keyword argument(s) {unknown}; the options "
                            f"are {list(OPTION_NAMES)}")
        return cls(**keywords)

    def as_keywords(self) -> dict:
        """The options as the keywords ``graph_step`` takes (not copied deeper)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(StepOptions))


def keyword_signature(leading: list[inspect.Parameter]) -> inspect.Signature:
    """``leading`` parameters followed by every option as a keyword-only parameter (for
    ``help()`` and ``inspect.signature`` of ``graph_step`` and ``GraphStep``)."""
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                 annotation=f.type)
               for f in dataclasses.fields(StepOptions)]
    return inspect.Signature(leading + options)


__all__ = ["StepOptions", "OPTION_NAMES", "keyword_signature"]
