// Layout of the small device tensors shared by graphstash's kernels and its Python code.
// graphstash/_layout.py mirrors these numbers; tests/test_layout.py checks they agree.
#pragma once

// ---- per-buffer ring state: int64 [GS_STATE_SIZE] ---------------------------------------
// Ring counters grow monotonically between resets; slot = counter % ring_size.
#define GS_ST_DEV_HEAD 0        // next device ring slot to hand out
#define GS_ST_DEV_TAIL 1        // next device ring slot to return a page into
#define GS_ST_HOST_HEAD 2
#define GS_ST_HOST_TAIL 3
#define GS_ST_DEV_PEAK 4        // high-water mark of device pages in use
#define GS_ST_HOST_PEAK 5       // high-water mark of host pages in use
#define GS_ST_DEMAND 6          // pages the live handles asked for (stored or not)
#define GS_ST_DEMAND_PEAK 7     // high-water mark of GS_ST_DEMAND: what the pool should hold
#define GS_ST_TOKENS_PEAK 8     // most live rows one stash carried
#define GS_ST_STASH_TICKET 9    // last-block ticket of the stash kernel (0 between launches)
#define GS_ST_RELOAD_TICKET 10  // last-block ticket of the reload kernel
#define GS_ST_STASH_WORK 11     // next work unit a stash block takes (0 between launches)
#define GS_ST_RELOAD_WORK 12    // next work unit a reload block takes
#define GS_STATE_SIZE 16

// ---- status: int32 [GS_STATUS_SIZE], sticky, shared by every buffer of a manager --------
#define GS_SS_OVERFLOW 0        // bit mask of GS_OVERFLOW_* reasons; non-zero = step untrusted
#define GS_SS_HOST_SPILL 1      // 1 once any page went to the pinned-host tier
#define GS_SS_OVER_BUDGET 2     // 1 once a static MoE budget dropped rows
#define GS_SS_TOKENS_PEAK 3     // most live rows seen by one stash or dispatch
#define GS_STATUS_SIZE 8

#define GS_OVERFLOW_POOL 1      // both tiers together had too few free pages
#define GS_OVERFLOW_COUNT 2     // a num_tokens entry was < 0 or > the rows of its segment
#define GS_OVERFLOW_EXCHANGE 4  // an expert-parallel exchange failed (a peer did not signal in time)

// ---- handle record in the page-table arena: int32 -----------------------------------------
// [valid, num_pages, dev_pages, host_pages, counts[S], page_ids[max_pages]]
#define GS_H_VALID 0            // 1 = stored; 0 = not stored (overflow), nothing to reload
#define GS_H_PAGES 1            // pages the tensor needs (= dev + host when stored)
#define GS_H_DEV_PAGES 2        // its first dev_pages page ids are device pages
#define GS_H_HOST_PAGES 3       // the rest are host pages (ids >= num_device_pages)
#define GS_H_COUNTS 4           // S live-row counts copied at stash time
#define GS_H_HEADER 4
