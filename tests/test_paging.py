"""PagedStashBuffer on the reference backend (CPU): data, page accounting, spill, overflow,
ring wrap-around, segmented tensors and bad input."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphstash
from graphstash import PagedStashBuffer
from graphstash.errors import PoolExhaustedError, ReleasedError, StaleHandleError

from _data import as_bytes, pattern

H = 8          # elements per row
P = 4          # rows per page


def make_buffer(device_pages=8, host_pages=0, dtype=torch.float32, hidden=H, page=P, **kw):
    return PagedStashBuffer(device_pages * page, hidden, dtype=dtype, device="cpu", page_size=page,
                            host_tokens=host_pages * page, **kw)


def counts(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def check_reloaded(out, x, n_per_segment):
    """Rows [0, n_s) of each segment of ``out`` equal ``x`` byte for byte."""
    out3 = out.view(-1, *out.shape[-2:]) if out.dim() == 3 else out.unsqueeze(0)
    x3 = x.view(-1, *x.shape[-2:]) if x.dim() == 3 else x.unsqueeze(0)
    for s, n in enumerate(n_per_segment):
        assert torch.equal(as_bytes(out3[s, :n]), as_bytes(x3[s, :n])), f"segment {s} differs"


def test_stash_reload_roundtrip_and_page_accounting():
    buf = make_buffer(device_pages=8)
    x = pattern((20, H), torch.float32, salt=1)
    handle = buf.stash(x, counts(10))
    rec = handle.record()
    assert rec["valid"] == 1 and rec["num_pages"] == 3 and rec["device_pages"] == 3
    assert rec["page_ids"] == [0, 1, 2]            # ring order from a fresh buffer
    assert buf.read_status()["pages_in_use"] == 3
    out = torch.full_like(x, -7.0)
    buf.reload(handle, out=out)
    check_reloaded(out, x, [10])
    assert torch.all(out[10:] == -7.0)             # rows past the live count untouched
    status = buf.read_status()
    assert status["pages_in_use"] == 0 and status["peak_pages"] == 3
    assert status["demand_pages"] == 0 and status["peak_demand_pages"] == 3
    assert status["peak_tokens"] == 10 and not status["overflow"]


def test_zero_tail_and_count_extremes():
    buf = make_buffer(device_pages=16)
    x = pattern((12, H), torch.float32, salt=2)
    for n in (0, 1, 4, 12):
        h = buf.stash(x, counts(n))
        assert h.record()["num_pages"] == -(-n // P)
        out = buf.reload(h, out=torch.full_like(x, 3.0), zero_tail=True)
        check_reloaded(out, x, [n])
        assert torch.count_nonzero(out[n:]) == 0
    assert buf.read_status()["pages_in_use"] == 0


def test_int64_counts_and_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8,
                  torch.int32, torch.int64, torch.uint8, torch.bool):
        hidden = 3                                   # odd row widths, too
        buf = make_buffer(device_pages=4, dtype=dtype, hidden=hidden)
        x = pattern((9, hidden), dtype, salt=3)
        h = buf.stash(x, counts(7, dtype=torch.int64))
        out = buf.reload(h)
        check_reloaded(out, x, [7])


def test_segmented_tensor_pages_in_segment_order():
    buf = make_buffer(device_pages=16, dtype=torch.bfloat16)
    x = pattern((4, 10, H), torch.bfloat16, salt=4)
    n = [5, 0, 10, 1]
    h = buf.stash(x, counts(*n))
    rec = h.record()
    assert rec["counts"] == n
    assert rec["num_pages"] == 2 + 0 + 3 + 1
    assert rec["page_ids"] == list(range(6))
    out = buf.reload(h, zero_tail=True)
    check_reloaded(out, x, n)
    for s, ns in enumerate(n):
        assert torch.count_nonzero(out[s, ns:].float()) == 0


def test_spill_to_host_is_per_page_in_the_middle_of_a_tensor():
    buf = make_buffer(device_pages=3, host_pages=4)
    x = pattern((20, H), torch.float32, salt=5)
    h = buf.stash(x, counts(19))                   # 5 pages: 3 device + 2 host
    rec = h.record()
    assert (rec["device_pages"], rec["host_pages"]) == (3, 2)
    assert rec["page_ids"] == [0, 1, 2, 3, 4]      # host ids follow the device ids
    status = buf.read_status()
    assert status["host_spill"] and not status["overflow"]
    assert status["host_pages_in_use"] == 2
    check_reloaded(buf.reload(h), x, [19])
    status = buf.read_status()
    assert status["pages_in_use"] == 0 and status["host_pages_in_use"] == 0


def test_overflow_stores_nothing_and_corrupts_nothing():
    buf = make_buffer(device_pages=4, host_pages=1)
    a = pattern((16, H), torch.float32, salt=6)
    b = pattern((16, H), torch.float32, salt=7)
    c = pattern((8, H), torch.float32, salt=8)
    ha = buf.stash(a, counts(12))                  # 3 pages
    hb = buf.stash(b, counts(16))                  # 4 pages: only 2 free -> overflow
    assert hb.record()["valid"] == 0
    status = buf.read_status()
    assert status["overflow"] and status["overflow_reasons"] == ["pool"]
    assert status["pages_in_use"] == 3 and status["demand_pages"] == 7
    hc = buf.stash(c, counts(8))                   # 2 pages still fit: 1 device + 1 host
    assert hc.record()["valid"] == 1
    sentinel = torch.full_like(b, 9.0)
    assert torch.equal(buf.reload(hb, out=sentinel.clone()), sentinel)   # writes nothing
    check_reloaded(buf.reload(hc), c, [8])
    check_reloaded(buf.reload(ha), a, [12])
    status = buf.read_status()
    assert status["overflow"] and status["pages_in_use"] == 0 and status["demand_pages"] == 0
    assert status["peak_demand_pages"] == 9        # what the pool should have held
    buf.reset()
    status = buf.read_status()
    assert not status["overflow"] and status["pages_in_use"] == 0
    h = buf.stash(pattern((20, H), torch.float32, salt=9), counts(20))   # all 5 pages
    assert h.record()["page_ids"] == [0, 1, 2, 3, 4]


def test_count_beyond_rows_sets_overflow_instead_of_reading_out_of_bounds():
    buf = make_buffer(device_pages=8)
    x = pattern((4, 6, H), torch.float32, salt=10)
    h = buf.stash(x, counts(2, 7, 1, 0))           # 7 > 6 rows in segment 1
    assert h.record()["valid"] == 0
    status = buf.read_status()
    assert status["overflow_reasons"] == ["count"] and status["pages_in_use"] == 0
    h2 = buf.stash(x, counts(2, -1, 1, 0))
    assert h2.record()["valid"] == 0
    buf.reload(h)
    buf.reload(h2)
    assert buf.read_status()["demand_pages"] == 0


def test_ring_wraps_around_many_times_without_reset():
    buf = make_buffer(device_pages=5)
    gen = random.Random(11)
    outstanding = []
    for i in range(60):
        if outstanding and (len(outstanding) >= 2 or gen.random() < 0.4):
            h, x, n = outstanding.pop(gen.randrange(len(outstanding)))
            check_reloaded(buf.reload(h), x, [n])
        else:
            n = gen.randint(1, 8)
            x = pattern((8, H), torch.float32, salt=i)
            outstanding.append((buf.stash(x, counts(n)), x, n))
    assert buf.state[0].item() > 5                  # the head went round the ring
    for h, x, n in outstanding:
        check_reloaded(buf.reload(h), x, [n])
    assert buf.read_status()["pages_in_use"] == 0
    assert not buf.read_status()["overflow"]


class _Model:
    """Pages a correct pool must hand out, computed independently of the implementation."""

    def __init__(self, dev, host):
        self.dev_free = list(range(dev))
        self.host_free = list(range(dev, dev + host))

    def stash(self, need):
        if need > len(self.dev_free) + len(self.host_free):
            return None
        take_dev = min(need, len(self.dev_free))
        ids = self.dev_free[:take_dev] + self.host_free[:need - take_dev]
        self.dev_free = self.dev_free[take_dev:]
        self.host_free = self.host_free[need - take_dev:]
        return ids

    def reload(self, ids, dev):
        self.dev_free += [i for i in ids if i < dev]
        self.host_free += [i for i in ids if i >= dev]


@settings(max_examples=60, deadline=None)
@given(dev=st.integers(1, 6), host=st.integers(0, 3), segments=st.integers(1, 3),
       ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 9), min_size=3, max_size=3),
                              st.integers(0, 1000)), min_size=1, max_size=25))
def test_random_non_lifo_sequences_match_a_free_list_model(dev, host, segments, ops):
    buf = make_buffer(device_pages=dev, host_pages=host)
    model = _Model(dev, host)
    live = []
    overflowed = False
    for i, (do_stash, ns, pick) in enumerate(ops):
        if do_stash or not live:
            n = ns[:segments]
            x = pattern((segments, 9, H), torch.float32, salt=i)
            h = buf.stash(x, counts(*n))
            expect = model.stash(sum(-(-v // P) for v in n))
            rec = h.record()
            if expect is None:
                overflowed = True
                assert rec["valid"] == 0
            else:
                assert rec["valid"] == 1 and rec["page_ids"] == expect
                live.append((h, x, n, expect))
        else:
            h, x, n, ids = live.pop(pick % len(live))
            check_reloaded(buf.reload(h), x, n)
            model.reload(ids, dev)
        status = buf.read_status()
        in_use = sum(len(ids) for *_, ids in live)
        assert status["pages_in_use"] + status["host_pages_in_use"] == in_use
        assert status["overflow"] == overflowed
    ids = [i for *_, page_ids in live for i in page_ids]
    assert len(ids) == len(set(ids))                 # no page held twice


def test_reset_makes_handles_stale_and_rings_whole_again():
    buf = make_buffer(device_pages=4)
    x = pattern((16, H), torch.float32, salt=12)
    h = buf.stash(x, counts(16))
    buf.reset()
    with pytest.raises(StaleHandleError, match="reset"):
        buf.reload(h)
    h2 = buf.stash(x, counts(16))
    assert h2.record()["page_ids"] == [0, 1, 2, 3]
    buf.reload(h2)
    with pytest.raises(StaleHandleError, match="already reloaded"):
        buf.reload(h2)


def test_release_and_reallocate():
    buf = make_buffer(device_pages=4)
    x = pattern((8, H), torch.float32, salt=13)
    h = buf.stash(x, counts(8))
    buf.release()
    assert buf.released and buf.device_bytes == 0
    for call in (lambda: buf.stash(x, counts(8)), lambda: buf.reload(h), buf.reset,
                 buf.read_status):
        with pytest.raises(ReleasedError, match="reallocate"):
            call()
    buf.reallocate(max_tokens=8 * P)
    assert buf.num_device_pages == 8
    with pytest.raises(StaleHandleError):
        buf.reload(h)
    check_reloaded(buf.reload(buf.stash(x, counts(8))), x, [8])


def test_dropped_handles_free_their_record_slots():
    buf = make_buffer(device_pages=64, record_entries=64)
    x = pattern((8, H), torch.float32, salt=14)
    for _ in range(40):      # each record takes 4 + 1 + 2 entries; without freeing, 9 fit
        buf.reload(buf.stash(x, counts(8)))
        buf.stash(x, counts(0))   # dropped: its slot comes back when the handle dies
    kept = [buf.stash(x, counts(1)) for _ in range(9)]
    with pytest.raises(PoolExhaustedError, match="record_entries"):
        buf.stash(x, counts(1))
    assert len(kept) == 9


def test_shared_status_between_buffers():
    status = graphstash.new_status("cpu")
    a = make_buffer(device_pages=1, status=status)
    b = make_buffer(device_pages=4, dtype=torch.bfloat16, status=status)
    a.stash(pattern((8, H), torch.float32, salt=15), counts(8))   # overflows a
    assert b.read_status()["overflow"]                            # seen through b
    b.reset()                                                     # shared: not cleared by b
    assert int(status[0]) != 0
    b.reset(clear_status=True)
    assert int(status[0]) == 0


# ---- bad input ---------------------------------------------------------------------------

def test_constructor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="hidden_size"):
        PagedStashBuffer(64, 8.0, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", page_size=0)
    with pytest.raises(TypeError, match="dtype"):
        PagedStashBuffer(64, 8, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="backend"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", backend="triton")
    with pytest.raises(ValueError, match="backend"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", backend="cupy")
    with pytest.raises(ValueError, match="max_tokens"):
        PagedStashBuffer(0, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="host_tokens"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cpu", host_tokens=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device.*no CUDA"):
        PagedStashBuffer(64, 8, dtype=torch.float32, device="cuda")


def test_stash_rejects_bad_x_and_num_tokens():
    buf = make_buffer()
    x = pattern((8, H), torch.float32, salt=16)
    with pytest.raises(TypeError, match=r"x: .*float32.*got torch.float16"):
        buf.stash(x.half(), counts(1))
    with pytest.raises(ValueError, match=r"x: .*\[rows, 8\].*got .*\(8, 4\)"):
        buf.stash(x[:, :4].contiguous(), counts(1))
    with pytest.raises(ValueError, match="x: .*non-contiguous"):
        buf.stash(pattern((8, 2 * H), torch.float32, salt=1)[:, ::2], counts(1))
    with pytest.raises(ValueError, match="x: "):
        buf.stash(x.view(2, 4, 2, 4), counts(1))
    with pytest.raises(TypeError, match="x: "):
        buf.stash(x.numpy(), counts(1))
    with pytest.raises(TypeError, match=r"num_tokens: expected an int32 or int64 tensor .*got torch.float32"):
        buf.stash(x, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"num_tokens: .*shape \(1,\).*got .*\(2,\)"):
        buf.stash(x, counts(1, 2))
    with pytest.raises(ValueError, match=r"num_tokens: .*shape \(2,\)"):
        buf.stash(x.view(2, 4, H), counts(1))
    with pytest.raises(TypeError, match="num_tokens: "):
        buf.stash(x, 3)
    with pytest.raises(ValueError, match="max_blocks: expected an int > 0, got 0"):
        buf.stash(x, counts(1), max_blocks=0)
    with pytest.raises(TypeError, match="max_blocks: expected an int, got float"):
        buf.stash(x, counts(1), max_blocks=2.0)
    assert buf.read_status()["pages_in_use"] == 0 and not buf.read_status()["overflow"]


def test_reload_rejects_bad_handle_and_out():
    buf = make_buffer()
    other = make_buffer()
    x = pattern((8, H), torch.float32, salt=17)
    h = buf.stash(x, counts(8))
    with pytest.raises(TypeError, match="handle: "):
        buf.reload(x)
    with pytest.raises(ValueError, match="another"):
        other.reload(h)
    with pytest.raises(ValueError, match=r"out: .*shape \(8, 8\)"):
        buf.reload(h, out=torch.empty(9, H))
    with pytest.raises(TypeError, match="out: "):
        buf.reload(h, out=torch.empty(8, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: .*non-contiguous"):
        buf.reload(h, out=torch.empty(H, 8).t())
    with pytest.raises(TypeError, match="zero_tail"):
        buf.reload(h, zero_tail=1)
    with pytest.raises(ValueError, match="max_blocks: "):
        buf.reload(h, max_blocks=-3)
    # nothing above consumed the handle or its pages
    check_reloaded(buf.reload(h), x, [8])
    assert buf.read_status()["pages_in_use"] == 0


# ---- records of consumed handles, odd strides (issue: misuse is never silent) ----------------
def test_record_of_a_reloaded_handle_is_not_another_handles_record():
    """A reload frees the handle's record slot; the next stash reuses it. The reloaded
    handle's record must say -1, not show the new handle's record as its own."""
    buf = make_buffer(device_pages=8)
    x = pattern((12, H), torch.float32, salt=31)
    first = buf.stash(x, counts(12))
    buf.reload(first)
    second = buf.stash(pattern((12, H), torch.float32, salt=32), counts(8))
    assert second.record()["valid"] == 1
    assert first.record() == {"valid": -1, "num_pages": 0, "device_pages": 0, "host_pages": 0,
                              "counts": [], "page_ids": []}


def test_record_of_a_stale_handle_raises():
    buf = make_buffer(device_pages=8)
    old = buf.stash(pattern((12, H), torch.float32, salt=33), counts(12))
    buf.reset()
    buf.stash(pattern((12, H), torch.float32, salt=34), counts(4))     # reuses the slot
    with pytest.raises(StaleHandleError, match="reset"):
        old.record()


def test_single_column_rows_with_transposed_strides_roundtrip_without_leaking_slots():
    """``[rows, 1]`` with strides ``(1, rows)`` is contiguous by torch's rule; stash and reload
    must move its rows (and not leak a record slot per call when something fails)."""
    rows = 10
    buf = PagedStashBuffer(4 * rows, 1, dtype=torch.float32, device="cpu", page_size=4,
                           record_entries=2 * (L_HEADER + 1 + 3))
    for i in range(20):                  # ten times the record table, were a slot kept
        x = pattern((1, rows), torch.float32, salt=40 + i).t()
        assert x.stride() == (1, rows) and x.is_contiguous()
        out = pattern((1, rows), torch.float32, salt=90 + i).t()             # same strides
        h = buf.stash(x, counts(7))
        buf.reload(h, out=out)
        want = pattern((1, rows), torch.float32, salt=90 + i).reshape(-1)
        want[:7] = x.reshape(-1)[:7]                       # live rows restored, the rest kept
        assert torch.equal(as_bytes(out.reshape(-1)), as_bytes(want))


def test_failed_stash_launch_returns_its_record_slot(monkeypatch):
    from graphstash.reference import paged_stash as reference

    buf = make_buffer(device_pages=8, record_entries=L_HEADER + 1 + 3)
    x = pattern((12, H), torch.float32, salt=35)

    def broken(*args):
        raise RuntimeError("launch failed (injected)")

    monkeypatch.setattr(reference, "stash", broken)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="injected"):
            buf.stash(x, counts(12))
    monkeypatch.undo()
    check_reloaded(buf.reload(buf.stash(x, counts(12))), x, [12])


L_HEADER = graphstash._layout.H_HEADER
