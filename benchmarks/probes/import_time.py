"""How long ``import graphstash`` takes next to ``import torch``: each measured in fresh Python
processes (the median of ``--runs``, the two
alternated), the clock read inside the process around the imports.

    python benchmarks/probes/import_time.py --runs 5

(from the checkout's root: the processes import the graphstash found first on their path,
the current directory's).

prints the medians of ``import torch`` alone and of ``import torch; import graphstash``, their
difference, the median of ``import graphstash`` timed alone after ``import torch`` in the same
process (less exposed to a loaded machine), and which heavy modules ``import graphstash`` left loaded (NOTE [import time] in
``graphstash/__init__.py``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

HEAVY = ("torch._dynamo", "cupy", "triton")
CODE = """
import json, sys, time
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
{extra}
total_s = time.perf_counter() - start
print(json.dumps({{"torch_s": torch_s, "total_s": total_s,
                  "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def measure(extra: str) -> dict:
    """One fresh process that imports torch, then runs ``extra``; its timings."""
    code = CODE.format(extra=extra, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes each (default 5)")
    args = parser.parse_args(argv)
    torch_only, with_gs = [], []
    for _ in range(args.runs):          # alternated: a load that comes and goes hits both
        torch_only.append(measure("")["total_s"])
        with_gs.append(measure("import graphstash"))
    t = statistics.median(torch_only)
    g = statistics.median(r["total_s"] for r in with_gs)
    print(f"import torch:                    {t:.3f} s (median of {args.runs} processes)")
    print(f"import torch; import graphstash: {g:.3f} s (median of {args.runs} processes)")
    own = statistics.median(r["total_s"] - r["torch_s"] for r in with_gs)
    print(f"graphstash over torch:           {g - t:.3f} s (medians' difference); "
          f"{own:.3f} s (median of import graphstash after import torch, in the same process)")
    print(f"heavy modules loaded by import graphstash: {with_gs[-1]['heavy'] or 'none'}")


if __name__ == "__main__":
    main()
