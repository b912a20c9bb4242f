"""Triton sources of the grouped GEMM over device offsets (imported only when Triton is used).

Plain functions, compiled by :mod:`graphstash.moe._triton_grouped` (``triton.jit`` on a GPU,
Triton's interpreter on the CPU), so that one source serves both. They use only Triton
builtins (no ``tl.sum``, ``tl.cdiv``, ``tl.zeros``: those are themselves jitted and bind to
one mode when Triton is imported). NOTE [triton grouped GEMM] in ``_triton_grouped.py`` says
how the tiles find their rows.

NOTE [interpreted bf16 products]: Triton's interpreter multiplies bfloat16 operands of
``tl.dot`` as their raw 16-bit patterns (it keeps bfloat16 as uint16 in numpy), so when
interpreted, bfloat16 tiles are widened to float32 first (``DOT_F32``). The products are
the same (a product of two bfloat16 values is exact in float32, as on tensor cores); the
flag is a compile-time constant, off on a GPU.
"""
from __future__ import annotations

import triton.language as tl


def grouped_rows(a_ptr, b_ptr, c_ptr, tile_expert_ptr, starts_ptr, ends_ptr, first_tile_ptr,
                 M, N, K, num_tiles, num_experts,
                 stride_am, stride_be, stride_bk, stride_bn, stride_cm,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 PREC: tl.constexpr, DOT_F32: tl.constexpr):
    # One program per (row tile, column tile) of C; a 1-D grid of num_tiles * cdiv(N, BN),
    # swizzled GROUP_M row tiles at a time. A row tile belongs to one expert (tile_expert,
    # num_experts for a slot no expert uses: the program returns at once). Writes
    # C[rows, cols] = A[rows, :] @ B[e] for its rows (inside the expert's range and below M)
    # and nothing else; no atomics.
    pid = tl.program_id(0)
    num_pid_n = (N + BN - 1) // BN
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= num_experts:
        return
    row_start = tl.load(starts_ptr + e) + (pid_m - tl.load(first_tile_ptr + e)) * BM
    row_end = tl.minimum(tl.load(ends_ptr + e), M)
    rows = row_start + tl.arange(0, BM).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < row_end
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + e * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k in range(0, K, BK):
        k_ok = ks < K - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:     # NOTE [interpreted bf16 products]
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_weight_grad(p_ptr, q_ptr, c_ptr, starts_ptr, ends_ptr, M, I, J,
                        stride_pm, stride_qm, stride_ce, stride_ci,
                        BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr,
                        PREC: tl.constexpr, DOT_F32: tl.constexpr):
    # One program per (expert, BI x BJ tile of C[e]); grid (cdiv(I, BI) * cdiv(J, BJ),
    # num_experts). Writes C[e][i, j] = sum over the expert's rows r (below M) of
    # P[r, i] * Q[r, j], every element of its tile, zeros for an expert without rows; no
    # atomics (the rows of one expert are summed by one program, in order).
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_pid_j = (J + BJ - 1) // BJ
    i = (pid // num_pid_j) * BI + tl.arange(0, BI)
    j = (pid % num_pid_j) * BJ + tl.arange(0, BJ)
    i_ok = i < I
    j_ok = j < J
    start = tl.load(starts_ptr + e)
    end = tl.minimum(tl.load(ends_ptr + e), M)
    rs = tl.arange(0, BR).to(tl.int64)
    acc = tl.full((BI, BJ), 0.0, tl.float32)
    for r in range(start, end, BR):
        rows = r + rs
        r_ok = rows < end
        p = tl.load(p_ptr + rows[None, :] * stride_pm + i[:, None],
                    mask=i_ok[:, None] & r_ok[None, :], other=0.0)
        q = tl.load(q_ptr + rows[:, None] * stride_qm + j[None, :],
                    mask=r_ok[:, None] & j_ok[None, :], other=0.0)
        if DOT_F32:     # NOTE [interpreted bf16 products]
            p = p.to(tl.float32)
            q = q.to(tl.float32)
        acc = tl.dot(p, q, acc, input_precision=PREC)
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + i[:, None] * stride_ci + j[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=i_ok[:, None] & j_ok[None, :])
