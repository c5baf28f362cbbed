// Bulk copies on the hot path (staging snapshots, chunk filling).
#pragma once

#include <cstddef>

namespace acs {

// memcpy, with non-temporal (streaming) stores for large copies on CPUs with AVX2: the
// source (an activation the model just wrote) is hot in cache, the destination (staging,
// chunk buffers) is cold and not read again soon.
void copy_bytes(void* dst, const void* src, size_t n);

}  // namespace acs
