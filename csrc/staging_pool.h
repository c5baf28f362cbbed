// Process-wide pool of staging slabs for in-memory snapshots.
//
// Fresh anonymous memory costs a page fault per 4 KiB page on first touch (about 2 us
// each on a virtual machine: more than the copy itself). Slabs are therefore recycled
// when every record viewing them is gone, up to a cap, and a background thread prepares
// (maps and populates) the next slab while the current one fills, off the hot path.
#pragma once

#include <c10/core/Storage.h>

#include <cstdint>

namespace acs {

// Size of one staging slab in bytes (64 MiB).
constexpr int64_t kSlabBytes = int64_t(64) << 20;

// A CPU storage of kSlabBytes, from the pool when one is free. Thread-safe.
// expect_more: the caller already filled a slab (a large capture), so the background thread
// prepares (maps and populates) the next one now.
c10::Storage acquire_slab(bool expect_more);

// Bytes the pool may keep for reuse (default 1 GiB or $ACS_STAGING_POOL_BYTES); a lower cap
// frees the pooled slabs past it now (0: all of them, and disables recycling).
void set_pool_cap_bytes(int64_t cap);
int64_t pool_cap_bytes();
int64_t pooled_bytes();
void trim_pool();

// Whether the background thread prepares the next slab ahead of time (default on).
void set_prefault(bool enabled);

}  // namespace acs
