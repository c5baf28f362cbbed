// Map several files back to back into one contiguous range of virtual memory, so that the
// rows of an array split over many shard files read as one zero-copy tensor.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace acs {

// A uint8 CPU tensor of `total_bytes` whose bytes [i*stride_bytes, (i+1)*stride_bytes) are
// the first bytes of paths[i], mapped copy-on-write (writing into it never changes a file).
// stride_bytes must be a multiple of the page size; every file must hold the bytes it
// contributes. The mapping lives as long as the tensor's storage. Throws acs::UserError
// naming the file on a missing / short file or a failed mapping.
at::Tensor map_files_contiguous(const std::vector<std::string>& paths, int64_t stride_bytes,
                                int64_t total_bytes);

}  // namespace acs
