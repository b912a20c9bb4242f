// Layout of the expert-parallel exchange's shared regions, peer table and private state.
// graphstash/moe/exchange/layout.py mirrors these numbers; tests/test_exchange.py checks that
// they agree.
#pragma once

// ---- peer table: int64 [GS_XF_FIELDS][W], table[f * W + p] = address of field f of rank p --
#define GS_XF_SIGNALS 0         // int64 [W]: slot s holds the last barrier epoch rank s raised
#define GS_XF_FLAGS 1           // int32 [2][W][GS_X_MAX_FLAGS + GS_X_MAX_PEAKS]: flags, peaks
#define GS_XF_COUNTS 2          // int32 [W][GS_X_HEADER + max_experts]: header + counts of rank s
#define GS_XF_WEIGHTS 3         // [capacity] x 8 bytes: router weight of each received row
#define GS_XF_ROWS 4            // [capacity] x row bytes: the received rows
#define GS_XF_FIELDS 5

// ---- private state of a rank: int64 [GS_XS_SIZE] ------------------------------------------
#define GS_XS_EPOCH 0           // barriers this rank has entered (monotonic, never reset)
#define GS_XS_ERROR 1           // first failure: one of GS_XE_* (0 = none); sticky
#define GS_XS_ERROR_PEER 2      // the peer that failed (did not signal, or disagreed)
#define GS_XS_ERROR_EPOCH 3     // the barrier epoch of the failure
#define GS_XS_ROW_BYTES_REMOTE 4   // row and weight bytes written into other ranks' regions
#define GS_XS_ROW_BYTES_LOCAL 5    // row and weight bytes written into this rank's own region
#define GS_XS_META_BYTES 6      // count, flag and signal bytes written into any region
#define GS_XS_ROWS_SENT 7       // rows (and weights) pushed, this rank's own region included
#define GS_XS_SIZE 16

// ---- failure codes (GS_XS_ERROR) ------------------------------------------------------------
#define GS_XE_TIMEOUT 1         // a peer did not raise its signal within the timeout
#define GS_XE_MISMATCH 2        // a peer's count header disagreed (experts, budget, pad, row bytes)

// ---- count rows ---------------------------------------------------------------------------
#define GS_X_HEADER 4           // num_experts, budget (clamped to int32), pad_multiple, row bytes
#define GS_X_MAX_FLAGS 16       // most flags one all_reduce_flags_ call sums
#define GS_X_MAX_PEAKS 1024     // most peaks it takes the maximum of in the same exchange

// ---- plan workspace of one dispatch: int64 [GS_XW_SIZE(E)] ----------------------------------
// offs[g]: first row of global expert g in its receiver's permuted layout; total[g]: rows all
// ranks send to g; dst[g]: first row of this rank's rows for g there; slot[g]: first slot of g
// in this rank's send order (slot[E] = its live pairs); recv[s][e] / src[s][e]: where source
// s's rows for local expert e start in this rank's layout / in s's send order.
// Array k starts at k * E; slot, the last, has E + 1 entries: GS_XW_ARRAYS * E + 1 in all.
#define GS_XW_OFFS 0
#define GS_XW_TOTAL 1
#define GS_XW_DST 2
#define GS_XW_RECV 3
#define GS_XW_SRC 4
#define GS_XW_SLOT 5
#define GS_XW_ARRAYS 6
