"""CuPy paged stash kernels against the reference backend, exactly: bytes, page ids, records,
ring state and flags; plus streams, CUDA-graph capture and out-of-range counts."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

import graphstash
from graphstash import PagedStashBuffer
from graphstash.errors import CaptureError

from _data import as_bytes, pattern

pytestmark = pytest.mark.gpu


def pair(max_tokens, hidden, dtype, **kw):
    """The same buffer twice: CuPy kernels and reference backend, both on the GPU."""
    kw.setdefault("page_size", 16)
    return (PagedStashBuffer(max_tokens, hidden, dtype=dtype, device="cuda", backend="cupy", **kw),
            PagedStashBuffer(max_tokens, hidden, dtype=dtype, device="cuda", backend="reference",
                             **kw))


def assert_same_pool(fast, ref):
    assert torch.equal(fast.state, ref.state), (fast.state.tolist(), ref.state.tolist())
    assert torch.equal(fast.status, ref.status), (fast.status.tolist(), ref.status.tolist())
    for a, b in zip(fast.free_lists, ref.free_lists):
        assert torch.equal(a, b)


def run_sequence(buf, ops, dtype, hidden, segments, cap, count_dtype, seed, **launch):
    """Replay a recorded op list on ``buf``; return the outputs and records, in order.
    ``launch`` (e.g. ``max_blocks``) goes to every stash and reload."""
    outputs, records, live = [], [], []
    for i, (kind, arg) in enumerate(ops):
        if kind == "stash":
            shape = (cap, hidden) if segments == 0 else (segments, cap, hidden)
            x = pattern(shape, dtype, salt=seed + i, device="cuda")
            n = torch.tensor(arg, dtype=count_dtype, device="cuda")
            live.append(buf.stash(x, n, **launch))
            records.append(live[-1].record())
        else:
            h = live.pop(arg % len(live))
            target = pattern(h.shape, dtype, salt=10_000 + i, device="cuda")   # sentinel
            buf.reload(h, out=target, zero_tail=(i % 3 == 0), **launch)
            outputs.append(as_bytes(target).clone())
            records.append(h.record())
    return outputs, records


def random_ops(rng, n_ops, segments, cap):
    ops, live = [], 0
    for _ in range(n_ops):
        if live and rng.random() < 0.45:
            ops.append(("reload", rng.randrange(1000)))
            live -= 1
        else:
            k = max(segments, 1)
            counts = [rng.choice([0, cap, rng.randrange(cap + 1)]) for _ in range(k)]
            ops.append(("stash", counts))
            live += 1
    ops += [("reload", 0)] * live
    return ops


@pytest.mark.parametrize("dtype,hidden", [
    (torch.bfloat16, 512),            # 1024-byte rows: 16-byte vectors
    (torch.float32, 130),             # 520-byte rows: 8-byte vectors
    (torch.float16, 6),               # 12-byte rows: 4-byte vectors
    (torch.float8_e4m3fn, 6),         # 6-byte rows: 2-byte vectors
    (torch.int8, 7),                  # 7-byte rows: bytes
    (torch.int64, 64),
])
@pytest.mark.parametrize("segments", [0, 5])
def test_kernels_equal_reference_on_random_sequences(dtype, hidden, segments):
    rng = random.Random(zlib.crc32(f"{dtype}-{hidden}-{segments}".encode()))
    cap = 70
    # small tiers so that sequences spill to host and overflow
    fast, ref = pair(12 * 16, hidden, dtype, host_tokens=6 * 16)
    ops = random_ops(rng, 40, segments, cap)
    for count_dtype in (torch.int32, torch.int64):
        out_f, rec_f = run_sequence(fast, ops, dtype, hidden, segments, cap, count_dtype, 1)
        out_r, rec_r = run_sequence(ref, ops, dtype, hidden, segments, cap, count_dtype, 1)
        assert rec_f == rec_r
        for a, b in zip(out_f, out_r):
            assert torch.equal(a, b)
        assert_same_pool(fast, ref)
        assert fast.read_status() == ref.read_status()
        fast.reset(clear_peaks=True)
        ref.reset(clear_peaks=True)


@pytest.mark.parametrize("max_blocks", [1, 3])
def test_capped_grid_equals_reference(max_blocks):
    """A grid capped below the work units (NOTE [dynamic units]) still copies every unit."""
    rng = random.Random(100 + max_blocks)
    cap, hidden, segments = 300, 2048, 3          # 4 KiB rows: many units per tensor
    fast, ref = pair(40 * 16, hidden, torch.bfloat16, host_tokens=20 * 16)
    ops = random_ops(rng, 24, segments, cap)
    out_f, rec_f = run_sequence(fast, ops, torch.bfloat16, hidden, segments, cap, torch.int32,
                                5, max_blocks=max_blocks)
    out_r, rec_r = run_sequence(ref, ops, torch.bfloat16, hidden, segments, cap, torch.int32, 5)
    assert rec_f == rec_r
    for a, b in zip(out_f, out_r):
        assert torch.equal(a, b)
    assert_same_pool(fast, ref)
    assert fast.read_status() == ref.read_status()


def test_large_tensor_roundtrip_and_spill_in_the_middle():
    hidden, rows = 4096, 3000
    buf = PagedStashBuffer(1024, hidden, dtype=torch.bfloat16, device="cuda", page_size=64,
                           host_tokens=4096)
    x = pattern((rows, hidden), torch.bfloat16, salt=3, device="cuda")
    n = torch.tensor([2900], dtype=torch.int32, device="cuda")
    h = buf.stash(x, n)
    rec = h.record()
    assert (rec["device_pages"], rec["host_pages"]) == (16, 30)
    out = buf.reload(h, zero_tail=True)
    assert torch.equal(as_bytes(out[:2900]), as_bytes(x[:2900]))
    assert torch.count_nonzero(as_bytes(out[2900:])) == 0
    st = buf.read_status()
    assert st["host_spill"] and not st["overflow"] and st["pages_in_use"] == 0


def test_count_beyond_rows_sets_flag_without_out_of_bounds_access():
    buf = PagedStashBuffer(4096, 256, dtype=torch.float32, device="cuda")
    x = pattern((3, 100, 256), torch.float32, salt=4, device="cuda")
    h = buf.stash(x, torch.tensor([5, 1 << 30, 7], dtype=torch.int64, device="cuda"))
    out = torch.full_like(x, 2.5)
    buf.reload(h, out=out)
    torch.cuda.synchronize()
    assert torch.all(out == 2.5)
    st = buf.read_status()
    assert st["overflow_reasons"] == ["count"] and st["pages_in_use"] == 0


def test_stash_and_reload_on_side_streams_are_ordered():
    buf = PagedStashBuffer(1 << 15, 1024, dtype=torch.bfloat16, device="cuda", page_size=64)
    pack, unpack = torch.cuda.Stream(), torch.cuda.Stream()
    xs = [pattern((4096, 1024), torch.bfloat16, salt=i, device="cuda") for i in range(6)]
    n = [torch.tensor([4096 - 300 * i], dtype=torch.int32, device="cuda") for i in range(6)]
    pack.wait_stream(torch.cuda.current_stream())
    handles = []
    with torch.cuda.stream(pack):
        for x, c in zip(xs, n):
            handles.append(buf.stash(x, c))
    outs = []
    with torch.cuda.stream(unpack):      # no explicit wait: the buffer orders itself
        for h in reversed(handles[3:]):
            outs.append(buf.reload(h))
    with torch.cuda.stream(pack):        # stash again after reloads on the other stream
        handles.append(buf.stash(xs[0], n[0]))
    torch.cuda.synchronize()
    for i, out in zip(reversed(range(3, 6)), outs):
        live = 4096 - 300 * i
        assert torch.equal(as_bytes(out[:live]), as_bytes(xs[i][:live]))
    assert handles[-1].record()["valid"] == 1


def test_capture_and_replay_with_changing_counts():
    graphstash.warmup()
    hidden, cap = 2048, 1024
    buf = PagedStashBuffer(4096, hidden, dtype=torch.bfloat16, device="cuda", page_size=64,
                           host_tokens=1024)       # 64 device + 16 host pages
    static_x = torch.empty((4, cap, hidden), dtype=torch.bfloat16, device="cuda")
    static_n = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):       # one eager pass on the capture stream first
        buf.reset()
        buf.reload(buf.stash(static_x, static_n))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.reset()
        h1 = buf.stash(static_x, static_n)
        h2 = buf.stash(static_x[1:], static_n[1:])
        out2 = buf.reload(h2, zero_tail=True)
        out1 = buf.reload(h1)
    gen = torch.Generator().manual_seed(5)
    for replay in range(4):
        x = pattern((4, cap, hidden), torch.bfloat16, salt=100 + replay, device="cuda")
        counts = torch.randint(0, 600, (4,), generator=gen, dtype=torch.int32)   # fits both
        if replay == 2:
            counts[:] = cap             # too much for both tiers: overflow on the second stash
        static_x.copy_(x)
        static_n.copy_(counts)
        graph.replay()
        torch.cuda.synchronize()
        st = buf.read_status()
        pages = [-(-int(c) // 64) for c in counts]
        free = buf.num_device_pages + buf.num_host_pages
        stored1 = sum(pages) <= free
        stored2 = sum(pages[1:]) <= free - (sum(pages) if stored1 else 0)
        assert st["overflow"] == (not stored1 or not stored2)
        assert stored1 and (stored2 or replay == 2)
        for s in range(4):
            c = int(counts[s])
            assert torch.equal(as_bytes(out1[s, :c]), as_bytes(x[s, :c]))
            if s and stored2:
                assert torch.equal(as_bytes(out2[s - 1, :c]), as_bytes(x[s, :c]))
                assert torch.count_nonzero(as_bytes(out2[s - 1, c:])) == 0
        assert st["pages_in_use"] == 0 and st["host_pages_in_use"] == 0


def test_compiling_inside_a_capture_is_a_capture_error():
    from graphstash import _kernels

    buf = PagedStashBuffer(256, 64, dtype=torch.float32, device="cuda")
    x = torch.ones(64, 64, device="cuda")
    n = torch.ones(1, dtype=torch.int32, device="cuda")
    saved = dict(_kernels._modules)
    _kernels._modules.clear()
    try:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(CaptureError, match="warmup"):
            with torch.cuda.graph(graph):
                buf.stash(x, n)
    finally:
        _kernels._modules.update(saved)


def test_reference_backend_refuses_capture():
    buf = PagedStashBuffer(256, 64, dtype=torch.float32, device="cuda", backend="reference")
    x = torch.ones(64, 64, device="cuda")
    n = torch.ones(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="reference"):
        with torch.cuda.graph(graph):
            buf.stash(x, n)


def test_bad_device_inputs():
    buf = PagedStashBuffer(256, 64, dtype=torch.float32, device="cuda")
    x = torch.ones(64, 64, device="cuda")
    with pytest.raises(TypeError, match=r"num_tokens: .*on cuda:0, got torch.int32 .* on cpu"):
        buf.stash(x, torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: .*on cuda:0.*on cpu"):
        buf.stash(x.cpu(), torch.ones(1, dtype=torch.int32, device="cuda"))
