"""CuPy launcher for the CUDA kernels in ``raw_kernels/``: the only package that imports cupy.

Kernels are compiled with ``cupy.RawModule`` once per (device, source), with the tunables
passed as ``-D`` defines, and launched on torch's *current* stream so they are ordered with
torch's work and recorded by ``torch.cuda.graph`` captures. Tensors are handed over as raw
device pointers: zero-copy, and it works for every dtype (fp8 included, which DLPack does not
carry). Grid arithmetic lives here.
"""
from __future__ import annotations

import functools
import os
import threading

import numpy as np
import torch

from raw_kernels import KERNEL_DIR, TUNABLES_HEADER, int_defines, source_path

from .._checks import forbid_capture
from .._untraced import constant_result
from ..errors import BackendUnavailableError

# Tunables compiled into the kernels with -D. Their defaults are written once, in
# raw_kernels/gs_tunables.cuh, and read from there; GRAPHSTASH_TUNABLES="THREADS=256,UNROLL=4"
# overrides them for a tuning run (docs/kernel-tuning.md).
TUNABLES = ("THREADS", "UNROLL", "MIN_BLOCKS", "STREAMING", "XCHG_UNROLL", "XCHG_MIN_BLOCKS")
_defaults = int_defines(TUNABLES_HEADER)
THREADS = _defaults["THREADS"]        # threads per block of every launch
UNROLL = _defaults["UNROLL"]
MIN_BLOCKS = _defaults["MIN_BLOCKS"]
STREAMING = _defaults["STREAMING"]
XCHG_UNROLL = _defaults["XCHG_UNROLL"]          # exchange push: vectors per lane per pass
XCHG_MIN_BLOCKS = _defaults["XCHG_MIN_BLOCKS"]
# Launcher-only settings (not compiled into any kernel):
BLOCKS_PER_SM = 8          # persistent grid: at most this many blocks per multiprocessor
# Most segments one stashed tensor may have: the segment table (16 bytes a segment) lives in
# the kernel's dynamic shared memory, which stays well inside the default 48 KiB per block.
MAX_SEGMENTS = 1024
for _item in filter(None, os.environ.get("GRAPHSTASH_TUNABLES", "").split(",")):
    _name, _value = _item.split("=")
    if _name not in TUNABLES + ("BLOCKS_PER_SM",):
        raise ValueError(f"GRAPHSTASH_TUNABLES: unknown tunable {_name!r}")
    globals()[_name] = int(_value)
VECTOR_WIDTHS = (16, 8, 4, 2, 1)
# launcher submodules of this package; each calls register_source() for its .cu file
KERNEL_MODULES = ("paged_stash", "moe", "experts", "exchange")

# module name -> (source file, kernel names compiled by warmup()); filled by register_source
_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {}
_lock = threading.Lock()
_modules: dict[tuple[int, str], object] = {}
_streams: dict[tuple[int, int], object] = {}


@functools.lru_cache(maxsize=1)
def _import_cupy():
    try:
        import cupy  # noqa: WPS433 - the one place cupy is imported
    except Exception as exc:  # ImportError, or a CUDA library mismatch raised at import
        raise BackendUnavailableError(f"cupy cannot be imported: {exc}") from exc
    return cupy


@constant_result
def availability() -> tuple[bool, str]:
    """Whether the CuPy kernels can run here, and why (or why not). Never raises.

    While ``torch.compile`` traces, the answer is computed eagerly and kept as a constant of
    the graph (asking CuPy is not something a graph can hold).
    """
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        cupy = _import_cupy()
    except BackendUnavailableError as exc:
        return False, str(exc)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # driver/runtime mismatch
        return False, f"cupy cannot use the CUDA driver: {exc}"
    if count < 1:
        return False, "cupy sees no CUDA device"
    return True, f"cupy {cupy.__version__} sees {count} CUDA device(s)"


def compile_options() -> tuple[str, ...]:
    """The NVRTC options every source is compiled with: C++17, ``raw_kernels/`` on the include
    path, and each tunable as ``-DGS_<NAME>=<value>``."""
    return ("--std=c++17", f"-I{KERNEL_DIR}",
            *(f"-DGS_{name}={globals()[name]}" for name in TUNABLES))


def _module(device_index: int, name: str):
    key = (device_index, name)
    module = _modules.get(key)
    if module is not None:
        return module
    forbid_capture(f"compiling the {name!r} kernels")
    cupy = _import_cupy()
    with _lock:
        module = _modules.get(key)
        if module is None:
            code = source_path(_SOURCES[name][0]).read_text()
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=code, options=compile_options())
                module.compile()
            _modules[key] = module
    return module


def _function(device_index: int, module_name: str, kernel: str):
    return _module(device_index, module_name).get_function(kernel)


class _RawStream:
    """A raw CUDA stream handle presented through the ``__cuda_stream__`` protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _cupy_stream(device_index: int):
    """CuPy view of torch's current stream on ``device_index`` (cached per stream handle)."""
    handle = torch._C._cuda_getCurrentRawStream(device_index)
    key = (device_index, handle)
    wrapped = _streams.get(key)
    if wrapped is None:
        cupy = _import_cupy()
        with cupy.cuda.Device(device_index):
            try:   # CuPy >= 13 takes any object with __cuda_stream__
                wrapped = cupy.cuda.Stream.from_external(_RawStream(handle))
            except (AttributeError, TypeError):
                wrapped = cupy.cuda.ExternalStream(handle)
        _streams[key] = wrapped
    return wrapped


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_resident: dict[tuple[int, str, str, int], int] = {}


def resident_blocks(device_index: int, module_name: str, kernel: str, shared_mem: int = 0) -> int:
    """Blocks of ``kernel`` that fit on the whole device at once (its persistent grid size).

    From the kernel's registers, its static plus ``shared_mem`` dynamic shared memory and the
    device's per-multiprocessor limits; cached per (device, kernel, shared_mem).
    """
    key = (device_index, module_name, kernel, shared_mem)
    blocks = _resident.get(key)
    if blocks is None:
        func = _function(device_index, module_name, kernel)
        props = torch.cuda.get_device_properties(device_index)
        regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
        threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        regs_per_warp = -(-func.num_regs * 32 // 256) * 256        # allocated per warp, in 256s
        by_regs = regs_per_sm // max(1, regs_per_warp * (THREADS // 32))
        by_smem = smem_per_sm // (func.shared_size_bytes + shared_mem + 1024)  # 1 KiB reserved
        by_threads = threads_per_sm // THREADS
        per_sm = max(1, min(by_regs, by_smem, by_threads, BLOCKS_PER_SM))
        blocks = per_sm * _sm_count(device_index)
        _resident[key] = blocks
    return blocks


def chunk_bytes(width: int) -> int:
    """Bytes one block copies per work item with vectors of ``width`` bytes."""
    return THREADS * UNROLL * width


def vector_width(row_bytes: int, *pointers: int) -> int:
    """Widest vector (bytes) dividing the row width and every base address."""
    for width in VECTOR_WIDTHS:
        if row_bytes % width == 0 and all(p % width == 0 for p in pointers):
            return width
    return 1


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument (8-byte pointer)."""
    return np.uint64(t.data_ptr())


_launchers: dict[tuple[int, str, str, int], tuple] = {}


def launch(module_name: str, kernel: str, items: int, device_index: int, args: tuple,
           shared_mem: int = 0, max_blocks: int | None = None) -> None:
    """Launch ``kernel`` on torch's current stream: a persistent grid of the blocks that fit on
    the device at once, but no more than ``items`` (units of work the launch may find) and,
    if given, no more than ``max_blocks`` (to leave multiprocessors to concurrent work)."""
    key = (device_index, module_name, kernel, shared_mem)
    entry = _launchers.get(key)
    if entry is None:
        raw = _function(device_index, module_name, kernel)
        entry = (raw, getattr(raw, "kernel", None),
                 resident_blocks(device_index, module_name, kernel, shared_mem))
        _launchers[key] = entry
    raw, function, blocks = entry
    grid = (max(1, min(items, blocks, max_blocks or blocks)), 1, 1)
    stream = _cupy_stream(device_index)
    if function is not None:
        try:   # the compiled function takes the stream directly: no current-stream switch
            function(grid, (THREADS, 1, 1), args, shared_mem, stream)
            return
        except TypeError:
            _launchers[key] = (raw, None, blocks)
    with stream:
        raw(grid, (THREADS, 1, 1), args, shared_mem=shared_mem)


def register_source(module_name: str, source: str, kernels: tuple[str, ...]) -> None:
    """Declare a kernel source file and the entry points ``warmup()`` must load from it."""
    _SOURCES[module_name] = (source, tuple(kernels))


def sources() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{module name: (source file, entry points)}`` of every launcher of this package (it
    imports them: each registers its source). Imports no CuPy, touches no GPU."""
    import importlib

    for submodule in KERNEL_MODULES:   # importing each registers its sources
        importlib.import_module(f"{__name__}.{submodule}")
    return dict(_SOURCES)


def warmup(device=None, modules=None) -> None:
    """Compile every registered kernel for ``device`` (default: current CUDA device), or
    those of the named modules only (``modules``: names given to :func:`register_source`)."""
    registered = sources()
    if modules is not None:
        unknown = sorted(set(modules) - set(registered))
        if unknown:
            raise ValueError(f"warmup(modules=): no kernel module {unknown}; "
                             f"known: {sorted(registered)}")
        registered = {name: registered[name] for name in modules}
    cupy = _import_cupy()
    index = torch.device(device if device is not None else "cuda").index
    index = torch.cuda.current_device() if index is None else index
    for name, (_, kernels) in registered.items():
        module = _module(index, name)
        with cupy.cuda.Device(index):
            for kernel in kernels:
                module.get_function(kernel)


def is_compiled(device_index: int, module_name: str = "paged_stash") -> bool:
    return (device_index, module_name) in _modules
