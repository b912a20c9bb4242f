"""Run the headline stash/reload case and the torch copies a few times, for ncu.

    ncu --clock-control none -k regex:"gs_|copy|Copy" python benchmarks/probes/profile_stash.py
"""
import torch

import graphstash

rows, hidden, live = 16384, 4096, 0.7
n = int(rows * live)
x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
counts = torch.tensor([n], dtype=torch.int32, device="cuda")
out = torch.empty_like(x)
staging = torch.empty_like(x)
buf = graphstash.PagedStashBuffer(rows, hidden, dtype=torch.bfloat16, device="cuda")
graphstash.warmup()
for _ in range(3):
    buf.reload(buf.stash(x, counts), out=out)
    staging[:n].copy_(x[:n])
    out[:n].copy_(staging[:n])
torch.cuda.synchronize()
