"""Which GPU a pytest-xdist worker sees when the single-GPU tests are spread over a machine's
GPUs (``GS_SPREAD_GPUS``, tests/conftest.py, scripts/gpu_suite.sh), and which tests one part
of a suite split over several runs takes (``GS_SHARD``). No torch here: the choice is made
before anything in the worker imports what might start CUDA."""
from __future__ import annotations

import zlib


def spread_gpu(worker: str, gpus: int, visible: str | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of pytest-xdist worker ``worker`` (``"gw3"``) when the
    single-GPU tests are spread over ``gpus`` GPUs (``GS_SPREAD_GPUS``, tests/conftest.py):
    worker ``k`` takes GPU ``k mod gpus``, numbered within ``visible`` (the launcher's
    ``CUDA_VISIBLE_DEVICES``) where that is set. None for the controller process (not
    ``gwN``). ValueError naming ``GS_SPREAD_GPUS`` for fewer than one GPU or more than
    ``visible`` lists."""
    if gpus < 1:
        raise ValueError(f"GS_SPREAD_GPUS: expected a number of GPUs >= 1, got {gpus}")
    if not (worker.startswith("gw") and worker[2:].isdigit()):
        return None
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else \
        [str(i) for i in range(gpus)]
    if gpus > len(ids):
        raise ValueError(f"GS_SPREAD_GPUS: {gpus} GPUs, but CUDA_VISIBLE_DEVICES lists "
                         f"{len(ids)} ({visible})")
    return ids[int(worker[2:]) % gpus]


def parse_shard(text: str) -> tuple[int, int]:
    """``GS_SHARD`` (``"k/n"``, 1 <= k <= n) as ``(k, n)``: run the k-th of n disjoint parts of
    the suite (tests/conftest.py). ValueError naming ``GS_SHARD`` otherwise."""
    parts = text.strip().split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"GS_SHARD: expected 'k/n' (the k-th of n parts), got {text!r}")
    k, n = (int(p) for p in parts)
    if not 1 <= k <= n:
        raise ValueError(f"GS_SHARD: expected 1 <= k <= n in 'k/n', got {text!r}")
    return k, n


def in_shard(nodeid: str, k: int, n: int) -> bool:
    """Whether test ``nodeid`` belongs to part ``k`` of ``n``: by a hash of the id, so every
    process that collects the suite (the controller and each pytest-xdist worker, on any
    machine) puts each test in the same part, whatever the order it collects them in, and the
    parametrized cases of one test fall in different parts."""
    return zlib.crc32(nodeid.encode()) % n == k - 1
