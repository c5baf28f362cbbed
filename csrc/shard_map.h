// Map several files back to back into one contiguous range of virtual memory, so that the
// rows of an array split over many shard files read as one zero-copy tensor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace acs {

// A uint8 CPU tensor of `total_bytes` whose bytes [i*stride_bytes, (i+1)*stride_bytes) are
// the first bytes of paths[i], mapped copy-on-write (writing into it never changes a file).
// stride_bytes must be a multiple of the page size; every file must hold the bytes it
// contributes. The mapping lives as long as the tensor's storage. Throws acs::UserError
// naming the file on a missing / short file or a failed mapping.
at::Tensor map_files_contiguous(const std::vector<std::string>& paths, int64_t stride_bytes,
                                int64_t total_bytes);

// Faults taken so far on pages of these mappings past their file's end (a shard truncated or
// rewritten in place while mapped: each such page reads as zeros). A native read that copies
// from mappings takes the count before its copy and calls check_mapped_faults after it.
uint64_t mapped_fault_count();

// Throws StoreCorruptNativeError (Python: StoreCorruptError) naming the file when a fault since
// `since` hit one of `ranges` ((start, bytes) of the memory the read copied from), and claims
// those faults so that the main thread does not raise them a second time. Any thread.
void check_mapped_faults(uint64_t since, const std::vector<std::pair<const void*, size_t>>& ranges);

// (tests) Hold the lock of the mapping registry: write one byte to `ready_fd` once it is
// held, read one byte from `release_fd`, wait `then_s` seconds more, and let it go. Call
// without the GIL. What a thread mapping or letting go of a shard does, for longer.
void hold_map_guard_for_tests(int ready_fd, int release_fd, double then_s);

}  // namespace acs
