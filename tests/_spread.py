"""Which GPU a pytest-xdist worker sees when the single-GPU tests are spread over a machine's
GPUs (``GS_SPREAD_GPUS``, tests/conftest.py, scripts/gpu_suite.sh). No torch here: the choice
is made before anything in the worker imports what might start CUDA."""
from __future__ import annotations


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
