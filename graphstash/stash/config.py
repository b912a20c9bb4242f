"""``StashConfig``: page size, tier sizing factors and the saved-tensor filter of a manager."""
from __future__ import annotations

import dataclasses

from .. import _kernels
from .._backend import BACKENDS
from .._checks import require_positive_int
from ..errors import BackendUnavailableError
from ..paging import MAX_PAGE_SIZE, MAX_PAGES

PREFETCH_POINTS = ("at_last_unpack", "after_release", "on_demand")
POLICIES = ("auto", "always", "never")
POOLS = ("per_group", "shared")


@dataclasses.dataclass(frozen=True)
class StashConfig:
    """How a :class:`~graphstash.StashManager` sizes its buffers and picks what it stashes.

    Frozen: a manager that grows after an overflow derives a new config
    (``dataclasses.replace``), so one config can be shared by several managers and steps.

    Attributes:
        page_size: rows per page of every buffer.
        device_factor: device tier = ``device_factor x`` peak demand (pages in use), measured
            in warmup steps (see NOTE [warmup sizing] in ``graphstash/stash/buffers.py``);
            0 only with a host tier (``host_tier`` and ``host_factor > 0``).
        host_factor: pinned-host tier = ``host_factor x`` peak demand (0: no host tier).
        host_tier: allow a pinned-host tier at all (``False`` ignores ``host_factor``).
        min_tensor_bytes: saved tensors smaller than this are left to autograd.
        initial_tokens: device rows of a buffer created before any demand was measured; 0
            keeps saved tensors un-stashed until the demand of a warmup step sized it.
        backend: ``"auto"``, ``"cupy"`` or ``"reference"`` (see :class:`PagedStashBuffer`).
        prefetch: when the reload of the next group in backward is issued (NOTE [prefetch]
            in ``scheduler.py``): ``"at_last_unpack"`` (default) when the last saved tensor of
            the group before it is unpacked, so the reload also runs beside that group's last
            backward op; ``"after_release"`` once autograd released every saved tensor of that
            group (its backward ran), so the reload reuses its memory: a lower peak, less
            overlap; ``"on_demand"`` never ahead: a group is reloaded when its backward unpacks
            its first saved tensor (no reloaded group beside another group's backward, the
            copy in the step's critical path).
        copy_blocks: thread blocks one stash or reload may use on the side streams (0: as
            many as fit on the device). The copies run beside compute; capping them leaves
            multiprocessors to that compute (NOTE [copy blocks] in ``scheduler.py``).
        policy: whether groups are stashed at all (NOTE [stash plan] in ``plan.py``):
            ``"auto"`` (default) stashes only when the warmup measurement says it lowers the
            step's peak, ``"always"`` and ``"never"`` force the choice.
        pool: where stashed rows live (NOTE [pages per group] in ``scheduler.py``):
            ``"per_group"`` (default) gives each layer group its own buffer whose pages are
            allocated when the group is stashed, from the step's own memory, and freed once
            its reload is done (a host tier's pinned pages stay allocated, per group);
            ``"shared"`` gives each (dtype, row width) one buffer whose pages are allocated
            with it and held across steps.
    """

    page_size: int = 64
    device_factor: float = 1.10
    host_factor: float = 0.0
    host_tier: bool = True
    min_tensor_bytes: int = 1 << 16
    initial_tokens: int = 0
    backend: str = "auto"
    copy_blocks: int = 0
    prefetch: str = "at_last_unpack"
    policy: str = "auto"
    pool: str = "per_group"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TypeError/ValueError naming the first field that is out of range, and
        :class:`~graphstash.errors.BackendUnavailableError` for ``backend="cupy"`` where the
        CuPy kernels cannot run.

        The bounds are the pools no GPU could hold or the kernels address (NOTE [config
        bounds]), so a bad value is refused here, not by the allocator at the first sized step.
        """
        # NOTE [config bounds]: page ids and page counts are 32-bit in the kernels (and rows
        # per page are counted in 32 bits), so a page of more than 2**30 rows, or a tier
        # factor above 2**31 - 1 (it multiplies a peak demand of at least one page), could
        # never be allocated or addressed (graphstash.paging.MAX_PAGE_SIZE, MAX_PAGES). What
        # a factor gives for a measured demand is checked again when the pool is sized.
        require_positive_int("page_size", self.page_size)
        if self.page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size: expected an int in [1, {MAX_PAGE_SIZE}] (rows per "
                             f"page; the kernels count rows in 32 bits), got {self.page_size}")
        for name in ("device_factor", "host_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
            if not 0.0 <= value <= MAX_PAGES:
                raise ValueError(f"{name}: expected a finite float in [0, {MAX_PAGES}] (the tier "
                                 f"holds {name} x the peak demand in pages, and page ids are "
                                 f"32-bit), got {value}")
        if not isinstance(self.host_tier, bool):
            raise TypeError(f"host_tier: expected a bool, got {type(self.host_tier).__name__}")
        if self.device_factor == 0 and not (self.host_tier and self.host_factor > 0):
            raise ValueError(
                f"device_factor: expected a float > 0 when there is no host tier (host_tier="
                f"{self.host_tier}, host_factor={self.host_factor}), got 0: every stash would "
                "overflow. Pass device_factor > 0, or host_factor > 0 for a host-only stash")
        require_positive_int("min_tensor_bytes", self.min_tensor_bytes, allow_zero=True)
        require_positive_int("initial_tokens", self.initial_tokens, allow_zero=True)
        if -(-self.initial_tokens // self.page_size) > MAX_PAGES:
            raise ValueError(f"initial_tokens: expected at most {MAX_PAGES} pages of page_size="
                             f"{self.page_size} rows, got {self.initial_tokens} rows")
        require_positive_int("copy_blocks", self.copy_blocks, allow_zero=True)
        if self.prefetch not in PREFETCH_POINTS:
            raise ValueError(f"prefetch: expected one of {PREFETCH_POINTS}, got {self.prefetch!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        if self.pool not in POOLS:
            raise ValueError(f"pool: expected one of {POOLS}, got {self.pool!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "cupy":
            ok, why = _kernels.availability()
            if not ok:
                raise BackendUnavailableError(f"backend: 'cupy' cannot run here ({why}); pass "
                                              "backend='auto' or 'reference'")
