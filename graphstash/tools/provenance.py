"""Where a result came from: the ``meta`` block of every ``--json`` and the source line under
every Markdown table of the ``graphstash`` command.

:func:`collect` reads, without importing CuPy (only ``graphstash._kernels`` does) and without
starting any work on a GPU: the versions of graphstash, Python, torch, CuPy (its installed
distribution), CUDA (torch's build) and the NVIDIA driver (``nvidia-smi``, where there is one),
the GPUs torch sees (count and names), the command line, the git commit of the checkout
graphstash runs from (``+changes`` when its tree differs from that commit), a digest of the
sources that ran (:func:`source_digest`) and the time (UTC). Anything that cannot be read is
None.

NOTE [source digest]: the commit says which code ran only where git's view of the tree is
right; a tree copied onto another machine without its ``.git`` (or with a stale one) names a
commit it is not, and ``+changes`` cannot see that: on four H200, benches of a newer tree
printed the older commit their copy's ``.git`` held. The digest is computed from the files
themselves (every ``.py`` of ``graphstash``, every source of ``raw_kernels``), so two runs
with the same digest ran the same code; ``python -m graphstash.tools.provenance`` prints the
digest of a checkout, to match a figure to a commit.

Example::

    meta = provenance.collect(["bench", "moe", "--quick"])
    print(provenance.line(meta))
    # graphstash 0.1.0 (commit 1a2b3c4d5e6f, sources 0f1e2d3c4b5a), torch 2.13.0, ...
"""
from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import shlex
import subprocess

import torch

PROGRAM = "graphstash"
_TIMEOUT_S = 10.0


def _run(argv: list, cwd: str | None = None) -> str | None:
    """What ``argv`` prints (stripped), or None when it cannot run or fails."""
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                              timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(directory: str | None = None) -> str | None:
    """The commit of the git checkout holding ``directory`` (default: graphstash's own), with
    ``+changes`` when tracked files differ from it; None outside a checkout."""
    if directory is None:
        import graphstash

        directory = os.path.dirname(os.path.abspath(graphstash.__file__))
    commit = _run(["git", "rev-parse", "HEAD"], cwd=directory)
    if not commit:
        return None
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory)
    return commit + ("+changes" if changed else "")


_SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".h")


def source_digest(roots: list | None = None) -> str | None:
    """The first 12 hex digits of SHA-256 over the source files under ``roots`` (default:
    the ``graphstash`` and ``raw_kernels`` packages that are imported), each as its path
    relative to its root's parent and its bytes, in path order; files whose suffix is not a
    source's (``__pycache__``, built objects) are left out (NOTE [source digest]). None when
    a root cannot be read."""
    import hashlib

    if roots is None:
        import graphstash
        import raw_kernels

        roots = [os.path.dirname(os.path.abspath(m.__file__)) for m in (graphstash, raw_kernels)]
    files = []
    try:
        for root in roots:
            if not os.path.isdir(root):
                return None
            base = os.path.dirname(os.path.abspath(root))
            for where, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                files += [(os.path.relpath(os.path.join(where, n), base).replace(os.sep, "/"),
                           os.path.join(where, n)) for n in names
                          if n.endswith(_SOURCE_SUFFIXES)]
        digest = hashlib.sha256()
        for rel, path in sorted(files):
            with open(path, "rb") as f:
                data = f.read()
            digest.update(f"{rel}\0{len(data)}\0".encode())
            digest.update(data)
    except OSError:
        return None
    return digest.hexdigest()[:12]


def cupy_version() -> str | None:
    """The version of the installed CuPy distribution (``cupy-cuda12x``, ...), read from its
    metadata: CuPy itself is not imported here."""
    names = importlib.metadata.packages_distributions().get("cupy") or []
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (None without one)."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def gpus() -> list:
    """The names of the CUDA devices torch sees (empty on a machine without one)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def collect(argv: list | None = None) -> dict:
    """The ``meta`` block: versions, GPUs, the command line ``graphstash`` + ``argv``, the
    commit and the time (see the module docstring); JSON-able."""
    import graphstash

    names = gpus()
    command = None if argv is None else shlex.join([PROGRAM, *map(str, argv)])
    return {"graphstash": graphstash.__version__, "commit": git_commit(),
            "sources": source_digest(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cupy": cupy_version(),
            "driver": driver_version() if names else None,
            "gpu_count": len(names), "gpus": names,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "command": command,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def line(meta: dict) -> str:
    """``meta`` as one line: what ran, on what, by which command, when."""
    which = []
    if meta.get("commit"):
        base, plus, changes = meta["commit"].partition("+")
        which.append(f"commit {base[:12]}{plus}{changes}")
    if meta.get("sources"):
        which.append(f"sources {meta['sources']}")
    commit = f" ({', '.join(which)})" if which else ""
    if meta.get("gpus"):
        counts: dict = {}
        for name in meta["gpus"]:
            counts[name] = counts.get(name, 0) + 1
        where = ", ".join(f"{n} x {name}" for name, n in counts.items())
        where += f", driver {meta['driver']}" if meta.get("driver") else ""
    else:
        where = "no GPU"
    parts = [f"graphstash {meta['graphstash']}{commit}", f"torch {meta['torch']}",
             f"CUDA {meta['cuda'] or 'none'}", f"CuPy {meta['cupy'] or 'none'}", where]
    text = ", ".join(parts)
    if meta.get("command"):
        text += f"; `{meta['command']}`"
    return f"{text}; {meta['time']}"


if __name__ == "__main__":         # the digest of the sources importable here, and their commit
    print(f"sources {source_digest()} commit {git_commit()}")
