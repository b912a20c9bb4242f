"""Registers, spills and SASS of every kernel, compiled as the loader compiles them (no GPU).

Compiles each ``raw_kernels/*.cu`` for ``--arch`` with ``graphstash._kernels.compile_options()``
(nvcc standing in for NVRTC), reads ``ptxas -v`` and ``cuobjdump -sass``, and prints one row
per entry point: registers, spill bytes, SASS instructions (NOPs left out) and a hash of the
instruction text. ``--save F`` writes the rows as JSON; ``--compare F`` prints which kernels
changed against a saved run, so a change meant to leave the generated code alone can show it
does (docs/kernel-tuning.md, "Refactors that must not change the code").

Usage: ``python benchmarks/probes/kernel_sass.py [--arch sm_90] [--save F | --compare F]``;
needs ``nvcc``, ``cuobjdump`` and ``nvdisasm`` on the PATH.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from graphstash import _kernels  # noqa: E402
from raw_kernels import KERNEL_DIR  # noqa: E402


def kernel_rows(arch: str) -> dict[str, dict]:
    """``{kernel: {"source", "registers", "spill_bytes", "sass", "hash"}}`` of every source."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted(KERNEL_DIR.glob("*.cu")):
            cubin = Path(tmp) / f"{source.stem}.cubin"
            built = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                                    *_kernels.compile_options(), "-o", str(cubin), str(source)],
                                   capture_output=True, text=True, check=True)
            info, current = {}, None
            for line in built.stderr.splitlines():
                m = re.search(r"Compiling entry function '(\w+)'", line)
                if m:
                    current = info.setdefault(m.group(1), {})
                m = re.search(r"(\d+) bytes spill stores", line)
                if m and current is not None:
                    current["spill_bytes"] = int(m.group(1))
                m = re.search(r"Used (\d+) registers", line)
                if m and current is not None:
                    current["registers"] = int(m.group(1))
            sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
            name, code = None, {}
            for line in sass.splitlines():
                m = re.match(r"\s*Function : (\w+)", line)
                if m:
                    name = m.group(1)
                    code[name] = []
                    continue
                m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
                if m and name:
                    code[name].append(re.sub(r"\s+", " ", m.group(1)))
            for kernel, instructions in code.items():
                rows[kernel] = dict(
                    source=source.name, **info.get(kernel, {}),
                    sass=sum(1 for i in instructions if not i.startswith("NOP")),
                    hash=hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    rows = kernel_rows(args.arch)
    print(f"{'kernel':<36}{'source':<18}{'regs':>5}{'spill':>7}{'sass':>7}  hash")
    for kernel, r in sorted(rows.items()):
        print(f"{kernel:<36}{r['source']:<18}{r.get('registers', '?'):>5}"
              f"{r.get('spill_bytes', '?'):>7}{r['sass']:>7}  {r['hash']}")
    if args.save:
        args.save.write_text(json.dumps(rows, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(args.compare.read_text())
        same = [k for k in rows if k in before and before[k]["hash"] == rows[k]["hash"]
                and before[k].get("registers") == rows[k].get("registers")]
        print(f"\n{len(same)} of {len(rows)} kernels identical to {args.compare}")
        for k in sorted(set(rows) | set(before)):
            if k not in same:
                print(f"  differs or new/gone: {k}")


if __name__ == "__main__":
    main()
