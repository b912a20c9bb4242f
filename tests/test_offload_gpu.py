"""Activation offload and tensor swap on the GPU: bitwise gradients, memory peak, CUDA graph
capture with replays, misuse errors."""
from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
import torch.nn.functional as F

from graphstash.errors import CaptureError, SavedTensorModifiedError, SavedTensorsError
from graphstash.offload import ActivationOffloader
from graphstash.swap import TensorSwapper

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    """Pre-LN transformer block with explicit attention (saves strided q/k/v views)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(w // self.heads), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Mixed(torch.nn.Module):
    """Several layer types: embedding, conv, batch norm, pooling, SDPA, dropout, linear."""

    def __init__(self, vocab=512, width=256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.conv = torch.nn.Conv1d(width, width, 5, padding=2)
        self.bn = torch.nn.BatchNorm1d(width)
        self.attn_in = torch.nn.Linear(width, 3 * width)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 8)

    def stages(self):
        def s0(tokens):
            return self.emb(tokens)

        def s1(x):
            y = self.bn(self.conv(x.transpose(1, 2)))
            y = F.max_pool1d(F.silu(y), 3, stride=1, padding=1)
            return x + y.transpose(1, 2)

        def s2(x):
            q, k, v = self.attn_in(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.drop(self.out(a.transpose(1, 2).flatten(2)))

        def s3(x):
            return self.head(F.layer_norm(x, x.shape[-1:])).float().pow(2).mean()

        return [s0, s1, s2, s3]


def _blocks(n=6, width=256, heads=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(width, heads) for _ in range(n)).cuda()


def _input(step, shape=(4, 128, 256)):
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    pos = torch.arange(shape[1], device="cuda", dtype=torch.float32)[None, :, None] / shape[1]
    return torch.randn(shape, device="cuda", generator=g) + pos


def _forward(blocks, x, mode=None, tool=None):
    h = x * 1.0
    if mode is None:
        for b in blocks:
            h = b(h)
    elif mode == "offload-ctx":
        with tool:
            for i, b in enumerate(blocks):
                with tool.group(f"block{i}"):
                    h = b(h)
    elif mode == "offload-fn":
        with tool:
            for i, b in enumerate(blocks):
                h = tool.group_start(h, f"block{i}")
                h = tool.group_commit(b(h))
    elif mode == "swap":
        for b in blocks:
            with tool.swap("blocks.*"):
                h = b(h)
    return h.float().pow(2).mean()


def _grads(module, x=None):
    out = [p.grad.clone() for p in module.parameters()]
    if x is not None:
        out.append(x.grad.clone())
    module.zero_grad(set_to_none=True)
    return out


def _eager_step(blocks, step, mode=None, tool=None):
    x = _input(step).requires_grad_()
    _forward(blocks, x, mode, tool).backward()
    return _grads(blocks, x)


def _assert_bitwise(a, b, what):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"{what}: gradient {i} differs (max abs {(u - v).abs().max()})"


def _tool(mode):
    if mode == "swap":
        return TensorSwapper(min_tensor_bytes=1 << 16)
    return ActivationOffloader(min_tensor_bytes=1 << 16, keep_last=1)


@pytest.mark.parametrize("mode", ["offload-ctx", "offload-fn", "swap"])
def test_transformer_gradients_bitwise(mode):
    blocks = _blocks()
    tool = _tool(mode)
    for step in range(3):
        ref = _eager_step(blocks, step)
        _assert_bitwise(_eager_step(blocks, step), ref, "baseline twice")   # determinism
        _assert_bitwise(_eager_step(blocks, step, mode, tool), ref, f"{mode} step {step}")
    assert tool.host_pool.in_use_bytes == 0
    allocations = tool.host_pool.allocations
    _eager_step(blocks, 3, mode, tool)
    assert tool.host_pool.allocations == allocations        # pinned buffers reused


@pytest.mark.parametrize("mode", ["offload", "swap"])
def test_mixed_layers_gradients_bitwise(mode):
    torch.manual_seed(1)
    model = Mixed().cuda()
    tool = TensorSwapper(min_tensor_bytes=1 << 14) if mode == "swap" else \
        ActivationOffloader(min_tensor_bytes=1 << 14, keep_last=1)

    def step(i, use_tool):
        g = torch.Generator(device="cuda").manual_seed(i)
        tokens = torch.randint(0, 512, (8, 96), device="cuda", generator=g)
        torch.manual_seed(50 + i)                            # dropout masks
        h = tokens
        stages = model.stages()
        if not use_tool:
            for s in stages:
                h = s(h)
        elif mode == "swap":
            for s in stages:
                with tool.swap("stage.*"):
                    h = s(h)
        else:
            with tool:
                for j, s in enumerate(stages):
                    with tool.group(f"stage{j}"):
                        h = s(h)
        h.backward()
        return _grads(model)

    torch.backends.cudnn.deterministic = True
    try:
        for i in range(3):
            ref = step(i, False)
            _assert_bitwise(step(i, False), ref, "baseline twice")
            _assert_bitwise(step(i, True), ref, f"{mode} step {i}")
    finally:
        torch.backends.cudnn.deterministic = False
    moved = tool.summary()["total"] if mode == "offload" else tool.swapped_bytes("stage.*")
    assert moved > 0


def _peak(fn):
    """Peak device memory of ``fn()`` above what was allocated just before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def _distinct_saved_bytes(blocks, x, min_bytes):
    """Per block: bytes of the distinct device storages autograd saves in its forward (each
    storage counted once, whole), parameters and their views left out."""
    per_block = []
    h = x * 1.0
    for block in blocks:
        storages = {}

        def pack(t):
            base = t._base if t._base is not None else t
            if (t.is_cuda and t.numel() * t.element_size() >= min_bytes
                    and not (base.is_leaf and base.requires_grad)):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = block(h)
        per_block.append(sum(storages.values()))
    return per_block


@pytest.mark.parametrize("mode", ["offload-fn", "swap"])
def test_memory_peak_drops(mode):
    blocks = _blocks(n=12, width=512, heads=8)
    shape = (8, 256, 512)
    tool = _tool(mode)

    def step(use):
        x = _input(0, shape).requires_grad_()
        _forward(blocks, x, mode if use else None, tool if use else None).backward()
        x.grad = None
        for p in blocks.parameters():
            p.grad.zero_()                                   # grads stay allocated in both runs

    step(False)
    step(True)                                               # warmup: pool, layer count
    # what offloading can free at most: the distinct storages saved by every block but the
    # last, which stays on the device (keep_last=1; swap learns the layer count)
    saved = sum(_distinct_saved_bytes(blocks, _input(0, shape).requires_grad_(), 1 << 16)[:-1])
    base = _peak(lambda: step(False))
    peak = _peak(lambda: step(True))
    moved = tool.summary()["total"] if mode != "swap" else tool.swapped_bytes("blocks.*")
    drop = base - peak
    print(f"\n{mode}: peak without {base / 2**20:.1f} MiB, with {peak / 2**20:.1f} MiB, "
          f"moved {moved / 2**20:.1f} MiB (distinct saved {saved / 2**20:.1f} MiB), "
          f"drop {drop / 2**20:.1f} MiB = {drop / moved:.1%} of moved")
    # "moved" counts each device storage once (views of one storage, saves by several ops)
    assert 0.9 * saved <= moved <= saved
    assert drop >= 0.8 * moved


@pytest.mark.parametrize("mode", ["offload-fn", "offload-ctx", "swap"])
def test_capture_and_replay_match_eager(mode):
    blocks = _blocks(n=4)
    eager = copy.deepcopy(blocks)
    tool = _tool(mode)
    static_x = _input(0).requires_grad_()

    def step():
        _forward(blocks, static_x, mode, tool).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                            # warmup, as the graph manager does
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    blocks.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert tool.host_pool.in_use_bytes == 0
    for i in range(10):
        with torch.no_grad():
            static_x.copy_(_input(100 + i))
        graph.replay()
        torch.cuda.synchronize()
        ref = _eager_step(eager, 100 + i)
        got = [p.grad for p in blocks.parameters()] + [static_x.grad]
        _assert_bitwise(got, ref, f"{mode} replay {i}")


def test_capture_without_warmup_is_refused():
    blocks = _blocks(n=2)
    off = ActivationOffloader(min_tensor_bytes=1 << 16)
    x = _input(0).requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="host buffer"):
        with torch.cuda.graph(graph):
            _forward(blocks, x, "offload-fn", off)
    off.reset()


def test_misuse_on_gpu():
    blocks = _blocks(n=3)
    off = ActivationOffloader(min_tensor_bytes=1 << 16, keep_last=0)
    x = _input(0).requires_grad_()
    with off:
        h = off.group_start(x * 1, "a")
        y = torch.sin(h)
        h2 = off.group_commit(y)
        z = off.group_commit(torch.cos(off.group_start(h2, "b")))
    torch.cuda.synchronize()
    h.mul_(2)                                                # saved by sin, already on host
    with pytest.raises(SavedTensorModifiedError):
        z.sum().backward()
    off.reset()
    with off:
        with pytest.raises(SavedTensorsError, match="do not nest"):
            with TensorSwapper().swap("x.*"):
                pass
    cpu = torch.randn(256, 256).requires_grad_()
    with off:
        with off.group("cpu"):
            torch.sin(cpu * 1).sum().backward()
    assert off.summary()["total"] == 0                       # CPU tensors are not offloaded
    assert sum(1 for _ in blocks.parameters()) > 0


@pytest.mark.parametrize("mode", ["offload-fn", "swap"])
def test_composes_with_graph_step(mode):
    graph = pytest.importorskip("graphstash.graph", reason="needs graphstash.graph (graph_step)")
    blocks = _blocks(n=4)
    control = copy.deepcopy(blocks)
    tool = _tool(mode)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-2)
    opt_control = torch.optim.SGD(control.parameters(), lr=1e-2)

    @graph.graph_step(optimizer=opt, warmup=2)
    def train_step(x):
        loss = _forward(blocks, x, mode, tool)
        loss.backward()
        return loss

    for i in range(6):                                       # eager, eager, capture, replays
        x = _input(200 + i)
        loss = train_step(x)
        opt_control.zero_grad(set_to_none=True)
        ref = _forward(control, x)
        ref.backward()
        opt_control.step()
        assert torch.equal(loss, ref.detach()), f"{mode} call {i}: loss differs"
        for p, q in zip(blocks.parameters(), control.parameters()):
            assert torch.equal(p, q), f"{mode} call {i}: parameters differ"
