#include "shard_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "errors.h"

namespace acs {

namespace {

struct Region {
  void* base;
  size_t bytes;
};

void unmap_region(void* ctx) {
  auto* r = static_cast<Region*>(ctx);
  munmap(r->base, r->bytes);
  delete r;
}

}  // namespace

at::Tensor map_files_contiguous(const std::vector<std::string>& paths, int64_t stride_bytes,
                                int64_t total_bytes) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  ACS_CHECK(stride_bytes > 0 && stride_bytes % page == 0, "stride_bytes must be a positive multiple of ",
            page, ", got ", stride_bytes);
  ACS_CHECK(total_bytes >= 0 && total_bytes <= stride_bytes * static_cast<int64_t>(paths.size()),
            "total_bytes ", total_bytes, " does not fit in ", paths.size(), " files of ", stride_bytes, " bytes");
  if (total_bytes == 0) return at::empty({0}, at::kByte);
  const size_t reserved = static_cast<size_t>((total_bytes + page - 1) / page * page);
  void* base = mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ACS_CHECK(base != MAP_FAILED, "reserving ", reserved, " bytes of address space failed: ", std::strerror(errno));
  auto* region = new Region{base, reserved};
  try {
    for (size_t i = 0; i < paths.size(); ++i) {
      const int64_t offset = static_cast<int64_t>(i) * stride_bytes;
      if (offset >= total_bytes) break;
      const int64_t need = std::min(stride_bytes, total_bytes - offset);
      const int fd = ::open(paths[i].c_str(), O_RDONLY | O_CLOEXEC);
      ACS_CHECK(fd >= 0, "opening shard '", paths[i], "' failed: ", std::strerror(errno));
      struct stat st {};
      const bool ok = fstat(fd, &st) == 0;
      if (!ok || st.st_size < need) {
        ::close(fd);
        ACS_CHECK(false, "shard '", paths[i], "' holds ", ok ? st.st_size : -1, " bytes, fewer than the ", need,
                  " its committed rows need");
      }
      const size_t len = static_cast<size_t>((need + page - 1) / page * page);
      void* at = mmap(static_cast<char*>(base) + offset, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED,
                      fd, 0);
      const int err = errno;
      ::close(fd);
      ACS_CHECK(at != MAP_FAILED, "mapping shard '", paths[i], "' failed: ", std::strerror(err));
    }
  } catch (...) {
    unmap_region(region);
    throw;
  }
  return at::from_blob(
      base, {total_bytes}, [region](void*) { unmap_region(region); }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace acs
