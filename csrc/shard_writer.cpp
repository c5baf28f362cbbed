// The shard writer: chunk filling on the hot path, one writer thread per store that appends
// chunks to shard files (Zarr v3 sharding_indexed, index at the end). See shard_writer.h.
#include "shard_writer.h"

#include <c10/core/InferenceMode.h>

#include "fast_copy.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

namespace acs {

// ------------------------------------------------------------------ crc32c
namespace {

struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    const uint32_t poly = 0x82F63B78u;  // reflected Castagnoli polynomial
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Crc32cTable& crc_table() {
  static const Crc32cTable table;
  return table;
}

}  // namespace

namespace {

#if defined(__x86_64__)
// The SSE4.2 crc32 instruction computes exactly CRC-32C (Castagnoli), 8 bytes per
// instruction, ~10x the table. It has a latency of 3 cycles and a throughput of 1 per cycle,
// so one dependent stream runs at a third of the instruction's speed: long inputs run as
// three independent streams over three adjacent blocks, whose CRCs are then combined by
// "appending zeros" with precomputed GF(2) operators (the method of Mark Adler's crc32c.c,
// zlib licence; also in Intel's white paper "Fast CRC Computation for iSCSI Polynomial Using
// CRC32 Instruction", 2011). Chosen at run time; the table below is the fallback.
constexpr size_t kCrcLong = 8192;  // bytes per stream of a long block (3 streams)
constexpr size_t kCrcShort = 256;  // bytes per stream of a short block

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (; vec; vec >>= 1, ++mat)
    if (vec & 1) sum ^= *mat;
  return sum;
}

void gf2_square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

// Tables applying `len` (a power of two) zero bytes to a CRC register, a byte at a time.
struct CrcShift {
  uint32_t t[4][256];
  explicit CrcShift(size_t len) {
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u;  // one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    gf2_square(even, odd);  // two zero bits
    gf2_square(odd, even);  // four zero bits
    const uint32_t* op = nullptr;
    for (;;) {  // eight zero bits in even, then doubling until len bytes
      gf2_square(even, odd);
      len >>= 1;
      if (len == 0) {
        op = even;
        break;
      }
      gf2_square(odd, even);
      len >>= 1;
      if (len == 0) {
        op = odd;
        break;
      }
    }
    for (uint32_t n = 0; n < 256; ++n) {
      t[0][n] = gf2_times(op, n);
      t[1][n] = gf2_times(op, n << 8);
      t[2][n] = gf2_times(op, n << 16);
      t[3][n] = gf2_times(op, n << 24);
    }
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

__attribute__((target("sse4.2"))) uint64_t crc_blocks(uint64_t c0, const uint8_t*& p, size_t& n, size_t block,
                                                       const CrcShift& shift) {
  while (n >= 3 * block) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + block;
    do {
      uint64_t a, b, c;
      std::memcpy(&a, p, 8);
      std::memcpy(&b, p + block, 8);
      std::memcpy(&c, p + 2 * block, 8);
      c0 = __builtin_ia32_crc32di(c0, a);
      c1 = __builtin_ia32_crc32di(c1, b);
      c2 = __builtin_ia32_crc32di(c2, c);
      p += 8;
    } while (p < end);
    c0 = shift(static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift(static_cast<uint32_t>(c0)) ^ c2;
    p += 2 * block;
    n -= 3 * block;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const void* data, size_t n) {
  static const CrcShift shift_long(kCrcLong), shift_short(kCrcShort);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
    --n;
  }
  c = crc_blocks(c, p, n, kCrcLong, shift_long);
  c = crc_blocks(c, p, n, kCrcShort, shift_short);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  while (n--) c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}
#endif

uint32_t crc32c_table(uint32_t crc, const void* data, size_t n);

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return crc32c_hw(crc, data, n);
#endif
  return crc32c_table(crc, data, n);
}

namespace {

uint32_t crc32c_table(uint32_t crc, const void* data, size_t n) {
  // Slicing-by-8 over a table: ~1-2 GB/s, no CPU feature dispatch needed.
  const auto& T = crc_table().t;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = (c >> 8) ^ T[0][(c ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = T[7][lo & 0xFF] ^ T[6][(lo >> 8) & 0xFF] ^ T[5][(lo >> 16) & 0xFF] ^ T[4][lo >> 24] ^
        T[3][hi & 0xFF] ^ T[2][(hi >> 8) & 0xFF] ^ T[1][(hi >> 16) & 0xFF] ^ T[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ T[0][(c ^ *p++) & 0xFF];
  return ~c;
}

}  // namespace

// ------------------------------------------------------------------ I/O helpers
namespace {

std::string errno_text(int e) {
  const char* name = "";
  switch (e) {
    case ENOSPC: name = "ENOSPC"; break;
    case EFBIG: name = "EFBIG"; break;
    case EIO: name = "EIO"; break;
    case EDQUOT: name = "EDQUOT"; break;
    case EACCES: name = "EACCES"; break;
    case ENOENT: name = "ENOENT"; break;
    case EROFS: name = "EROFS"; break;
    default: break;
  }
  std::string s = std::strerror(e);
  if (*name) s += std::string(" (") + name + ")";
  return s;
}

// What a write that ran out of room says: the cause, and the way out (the file named is the
// shard's: in the store's folder, or for a remote store in its local staging folder).
const char* no_room_hint(int e) {
  if (e == ENOSPC || e == EDQUOT || e == EFBIG)
    return ": the disk holding it is full, or a disk quota or file size limit was reached; free space there (or "
           "write elsewhere; a remote store's shards are staged in the local temporary folder, TMPDIR)";
  return "";
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path, int e) {
  throw StoreIOError(c10::str(what, " '", path, "' failed: ", errno_text(e), no_room_hint(e)));
}

// Said after the writer thread's error where it reaches the caller (a forward's append, a
// flush, check()): what the failure leaves, and how to go on.
constexpr const char* kAfterFailure =
    "; rows committed before the failure stay readable (open_store), and resume=True continues from them once "
    "the cause is fixed";

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      io_fail("writing shard", path, errno);
    }
    if (w == 0) io_fail("writing shard", path, EIO);
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// mkdir -p: the deepest folder first (one call when its parent exists, the common case:
// creating a folder is a new inode, the slow part on many file systems), its parents only
// when it cannot be made for want of them.
void mkdirs(const std::string& path) {
  if (path.empty() || path == "/" || path == ".") return;
  if (::mkdir(path.c_str(), 0777) == 0 || errno == EEXIST) return;
  if (errno != ENOENT) io_fail("creating directory", path, errno);
  const auto pos = path.find_last_not_of('/', path.rfind('/'));
  if (path.rfind('/') == std::string::npos || pos == std::string::npos) io_fail("creating directory", path, ENOENT);
  mkdirs(path.substr(0, pos + 1));
  if (::mkdir(path.c_str(), 0777) != 0 && errno != EEXIST) io_fail("creating directory", path, errno);
}

std::string dirname_of(const std::string& p) {
  auto pos = p.rfind('/');
  return pos == std::string::npos ? std::string(".") : p.substr(0, pos);
}

std::string basename_of(const std::string& p) {
  auto pos = p.rfind('/');
  return pos == std::string::npos ? p : p.substr(pos + 1);
}

// A folder the writer writes into is never reached through a symbolic link (a link planted
// in a store, or swapped in for a folder while a shard is open, could point outside it):
// every folder from the store's root down (acts/, the array's folder, c/, ...) is opened
// with O_NOFOLLOW, one component at a time, relative to the root's folder opened once, and
// the shard created, renamed and removed relative to the folders so opened.
[[noreturn]] void not_a_folder(const std::string& path) {
  struct stat st;
  const bool link = ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
  throw StoreIOError(c10::str(
      "'", path, "' is ", link ? "a symbolic link" : "not a folder", " where the store writer writes shards ",
      "(it writes no file through a link, nor anywhere but in the store's own folders): ",
      link ? "remove the link (not what it points to)" : "move it away", ", then resume the capture (resume=True)"));
}

// Opens the folder `path` itself, never through a link at its last component.
int open_folder(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ELOOP || e == ENOTDIR) not_a_folder(path);
    io_fail("opening directory", path, e);
  }
  return fd;
}

// Opens the folder `rel` ('/'-separated components) below the open folder `base_fd` (named
// `base`), each component with O_NOFOLLOW, making the missing ones (with `make`). Returns its fd.
int open_folder_below(int base_fd, const std::string& base, const std::string& rel, bool make = true) {
  int fd = ::dup(base_fd);
  if (fd < 0) io_fail("opening directory", base, errno);
  std::string shown = base;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string::npos) end = rel.size();
    const std::string part = rel.substr(start, end - start);
    start = end + 1;
    if (part.empty()) continue;
    shown += "/" + part;
    int next = ::openat(fd, part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0 && errno == ENOENT && make) {
      if (::mkdirat(fd, part.c_str(), 0777) != 0 && errno != EEXIST) {
        const int e = errno;
        ::close(fd);
        io_fail("creating directory", shown, e);
      }
      next = ::openat(fd, part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    const int e = errno;
    ::close(fd);
    if (next < 0) {
      if (e == ELOOP || e == ENOTDIR) not_a_folder(shown);
      io_fail("opening directory", shown, e);
    }
    fd = next;
  }
  return fd;
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// ------------------------------------------------------------------ StoreCore
namespace {
// Set by ~StoreCore when the writer thread itself dropped the last reference (its last
// queued chunk held the last ArrayWriter of a store nobody closed): run() must not touch
// the freed core after that.
thread_local const StoreCore* t_destroyed_core = nullptr;
}  // namespace

StoreCore::StoreCore(int64_t max_pending_bytes, bool fsync)
    : max_pending_bytes_(max_pending_bytes), fsync_(fsync), owner_pid_(::getpid()) {
  thread_ = std::thread([this] { run(); });
}

std::shared_ptr<StoreCore> StoreCore::make(int64_t max_pending_bytes, bool fsync) {
  return std::shared_ptr<StoreCore>(new StoreCore(max_pending_bytes, fsync), [](StoreCore* c) {
    if (::getpid() == c->owner_pid_) delete c;  // (a forked child's copy: never destroyed, see make)
  });
}

StoreCore::~StoreCore() {
  // Only in the process that made it (make). Every path leaves thread_ not joinable: a
  // joinable std::thread destroyed here would std::terminate the process.
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  cv_encode_.notify_all();
  cv_space_.notify_all();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference was dropped by the writer thread itself
      t_destroyed_core = this;
    } else {
      thread_.join();
    }
  }
  for (auto& root : roots_) ::close(root.second);
}

int StoreCore::root_fd(const std::string& root) {
  std::lock_guard<std::mutex> lock(roots_mu_);
  for (const auto& r : roots_) {
    if (r.first == root) return r.second;
  }
  // (the root's own path is the caller's: resolved now, links included, and never again)
  const int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_fail("opening the store folder", root, errno);
  roots_.emplace_back(root, fd);
  return fd;
}

void StoreCore::push(WorkItem item) {
  // A forked child's copy: no writer thread would ever take the item (and a full queue would
  // wait forever); the store is the parent's.
  ACS_CHECK(::getpid() == owner_pid_, "this store writer belongs to process ", owner_pid_,
            " (the process was forked after it was made): a forked child cannot write rows into it; capture "
            "into a store of the child's own");
  std::unique_lock<std::mutex> lock(mu_);
  cv_space_.wait(lock, [&] {
    return stop_ || failed_.load() || pending_bytes_ == 0 ||
           pending_bytes_ + item.budget_bytes <= max_pending_bytes_;
  });
  if (failed_.load()) throw StoreIOError(refused_ ? error_ : error_ + kAfterFailure);
  ACS_CHECK(!stop_, "the store writer is closed; rows of hook point '", item.array->spec().hook_point,
            "' cannot be appended after close()");
  pending_bytes_ += item.budget_bytes;
  ++in_flight_;
  item.id = next_id_++;
  if (item.array->spec().encoded) {
    encode_q_.push_back(std::move(item));
    cv_encode_.notify_one();
  } else {
    write_q_.push_back(std::move(item));
    cv_work_.notify_one();
  }
}

bool StoreCore::next_to_encode(WorkItem* out) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_encode_.wait(lock, [&] { return stop_ || !encode_q_.empty(); });
    if (encode_q_.empty()) return false;  // stopping
    WorkItem item = std::move(encode_q_.front());
    encode_q_.pop_front();
    if (item.chunk < 0) {  // the final marker: nothing to encode; FIFO keeps it after the
      write_q_.push_back(std::move(item));  // array's chunks (one encoder submits in order)
      cv_work_.notify_one();
      continue;
    }
    if (failed_.load()) {  // drop: the store already failed
      pending_bytes_ -= item.budget_bytes;
      --in_flight_;
      cv_space_.notify_all();
      cv_idle_.notify_all();
      continue;
    }
    *out = item;  // shares the raw tensor
    item.raw = at::Tensor();
    encoding_.push_back(std::move(item));
    return true;
  }
}

void StoreCore::submit_encoded(uint64_t id, std::string bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = encoding_.begin(); it != encoding_.end(); ++it) {
    if (it->id == id) {
      it->encoded = std::move(bytes);
      write_q_.push_back(std::move(*it));
      encoding_.erase(it);
      cv_work_.notify_one();
      return;
    }
  }
}

void StoreCore::fail_encoded(uint64_t id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = encoding_.begin(); it != encoding_.end(); ++it) {
    if (it->id == id) {
      if (!failed_.load()) {
        error_ = c10::str("encoding a chunk of hook point '", it->array->spec().hook_point, "' failed: ", why);
        failed_.store(true);
      }
      pending_bytes_ -= it->budget_bytes;
      --in_flight_;
      encoding_.erase(it);
      break;
    }
  }
  cv_space_.notify_all();
  cv_idle_.notify_all();
}

at::Tensor StoreCore::take_buffer(c10::IntArrayRef shape, c10::ScalarType dtype, int64_t nbytes) {
  // A normal tensor, also when the forward runs under torch.inference_mode(): the chunk is
  // filled and padded in place later, maybe outside it (an inference tensor refuses that),
  // and pooled buffers serve both.
  c10::InferenceMode not_inference(/*enabled=*/false);
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    for (auto it = pool_.rbegin(); it != pool_.rend(); ++it) {
      if (it->numel() == nbytes) {
        at::Tensor buf = std::move(*it);
        pool_.erase(std::next(it).base());
        pool_bytes_ -= nbytes;
        return buf.view(dtype).view(shape);
      }
    }
  }
  return at::empty(shape, at::TensorOptions().dtype(dtype));
}

void StoreCore::give_buffer(at::Tensor buf) {
  // Only a buffer nobody else sees (no view, no other tensor on its storage) is reused; the
  // pool holds at most the queue's byte cap (what the pipeline had in flight anyway).
  if (!buf.defined() || buf.use_count() != 1 || buf.storage().use_count() != 1 || !buf.is_contiguous() ||
      buf.storage_offset() != 0 || !buf.device().is_cpu())
    return;
  const int64_t nbytes = static_cast<int64_t>(buf.storage().nbytes());
  if (nbytes == 0 || nbytes != static_cast<int64_t>(buf.nbytes())) return;
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (pool_bytes_ + nbytes > max_pending_bytes_) return;
  pool_.push_back(buf.view({-1}).view(at::kByte));
  pool_bytes_ += nbytes;
}

void StoreCore::release(int64_t bytes) {
  pending_bytes_ -= bytes;
  --in_flight_;
  cv_space_.notify_all();
  cv_idle_.notify_all();
}

void StoreCore::run() {
  // Nothing escapes this thread (an exception leaving it would std::terminate the process):
  // every failure becomes the store's error, re-raised as StoreIOError on the caller's side.
  for (;;) {
    WorkItem item;
    try {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || !write_q_.empty(); });
      if (write_q_.empty()) return;  // stop_ and nothing left
      item = std::move(write_q_.front());
      write_q_.pop_front();
    } catch (...) {
      set_error("the store writer thread could not take the next chunk");
      return;
    }
    if (!failed_.load()) {
      try {
        item.array->write_chunk(item);
      } catch (const std::exception& e) {
        item.array->abandon_shard();
        set_error(e.what());
      } catch (...) {
        item.array->abandon_shard();
        set_error("unknown error in the store writer thread");
      }
    }
    const int64_t bytes = item.budget_bytes;
    // Free the chunk (back to the pool) before releasing its budget; keep the array (and
    // through it this core) alive until the budget is released.
    std::shared_ptr<ArrayWriter> array = std::move(item.array);
    at::Tensor raw = std::move(item.raw);
    item = WorkItem();
    give_buffer(std::move(raw));
    {
      std::lock_guard<std::mutex> lock(mu_);
      release(bytes);
    }
    array.reset();  // may run ~StoreCore on this thread (nobody closed the store)
    if (t_destroyed_core == this) {  // compares the address only: *this is gone
      t_destroyed_core = nullptr;
      return;
    }
  }
}

void StoreCore::set_error(const std::string& e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.load()) {
    error_ = e;
    failed_.store(true);
  }
  cv_space_.notify_all();
  cv_encode_.notify_all();
}

void StoreCore::refuse(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_.load()) {
    error_ = why;
    refused_ = true;
    failed_.store(true);
  }
  cv_space_.notify_all();
  cv_encode_.notify_all();
}

void StoreCore::drain() {
  // A forked child's copy has no writer thread (and its locks may be held by the parent's):
  // waiting would never end.
  ACS_CHECK(::getpid() == owner_pid_, "this store writer belongs to process ", owner_pid_,
            " (the process was forked after it was made): a forked child cannot wait for its writes; open a "
            "writer of the child's own");
  std::unique_lock<std::mutex> lock(mu_);
  cv_idle_.wait(lock, [&] { return in_flight_ == 0; });
}

void StoreCore::close() {
  if (::getpid() != owner_pid_) return;  // a forked child's copy: the writer thread is the parent's (~StoreCore)
  drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  cv_encode_.notify_all();
  cv_space_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StoreCore::check() const {
  if (failed_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    throw StoreIOError(refused_ ? error_ : error_ + kAfterFailure);
  }
}

bool StoreCore::failed() const { return failed_.load(); }

std::string StoreCore::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

int64_t StoreCore::pending_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_bytes_;
}

// ------------------------------------------------------------------ ArrayWriter
ArrayWriter::ArrayWriter(std::shared_ptr<StoreCore> core, ArraySpec spec)
    : core_(std::move(core)), spec_(std::move(spec)) {
  ACS_CHECK(spec_.chunk_rows > 0, "chunk_rows must be positive, got ", spec_.chunk_rows);
  ACS_CHECK(spec_.shard_chunks > 0, "shard_chunks must be positive, got ", spec_.shard_chunks);
  const int64_t shard_rows = spec_.chunk_rows * spec_.shard_chunks;
  ACS_CHECK(spec_.start_row % shard_rows == 0, "start_row must be a multiple of the shard rows ",
            shard_rows, ", got ", spec_.start_row);
  int64_t elems = 1;
  for (int64_t d : spec_.feature_shape) {
    ACS_CHECK(d >= 0, "feature shape of hook point '", spec_.hook_point, "' must be non-negative");
    elems *= d;
  }
  row_bytes_ = elems * static_cast<int64_t>(c10::elementSize(spec_.dtype));
  chunk_bytes_ = row_bytes_ * spec_.chunk_rows;
  n_rows_.store(spec_.start_row);
  chunked_rows_ = spec_.start_row;
  durable_rows_.store(spec_.start_row);
  next_chunk_ = spec_.start_row / spec_.chunk_rows;
  if (spec_.hold_shard >= 0) held_shards_.push_back(spec_.hold_shard);
  if (!spec_.root.empty()) {
    const auto below = [&](const std::string& p) {
      return p == spec_.root || (p.size() > spec_.root.size() && p.compare(0, spec_.root.size(), spec_.root) == 0 &&
                                 p[spec_.root.size()] == '/');
    };
    ACS_CHECK(below(spec_.dir) && below(spec_.tmp_dir), "the folders of hook point '", spec_.hook_point,
              "' must lie below the store folder '", spec_.root, "', got '", spec_.dir, "' and '", spec_.tmp_dir, "'");
    root_fd_ = core_->root_fd(spec_.root);
  }
}

ArrayWriter::~ArrayWriter() {
  if (deferred_bytes_) core_->add_deferred(-deferred_bytes_);  // (rows never taken: the store failed)
  if (fd_ >= 0) {
    ::close(fd_);
    // (a forked child's copy, dropped at its exit: the open shard's temporary file is its
    // parent's, still being written there)
    if (core_->in_owner_process()) unlink_tmp();
  }
}

int ArrayWriter::open_dir(const std::string& path, bool make) const {
  if (root_fd_ < 0) {  // (no root given: the folder's own path, its last component not a link)
    if (make) mkdirs(path);
    return open_folder(path);
  }
  return open_folder_below(root_fd_, spec_.root, path.substr(spec_.root.size()), make);
}

void ArrayWriter::unlink_tmp() noexcept { unlink_in_tmp_dir(tmp_path_); }

void ArrayWriter::unlink_in_tmp_dir(const std::string& path) noexcept {
  if (root_fd_ < 0) {
    ::unlink(path.c_str());
    return;
  }
  try {  // (a folder on the way swapped for a link: the file stays, never removed through it)
    FdCloser tmp_dir{open_dir(spec_.tmp_dir, false)};
    ::unlinkat(tmp_dir.fd, basename_of(path).c_str(), 0);
  } catch (...) {
  }
}

void ArrayWriter::append(const at::Tensor& rows_in, std::shared_ptr<c10::Event> ready) {
  core_->check();
  at::Tensor rows = rows_in;
  if (rows.dim() == 0) rows = rows.reshape({1});
  auto feat = rows.sizes().slice(1);
  ACS_CHECK(feat == at::IntArrayRef(spec_.feature_shape), "hook point '", spec_.hook_point,
            "' changed its feature shape: the store array has rows of shape ",
            c10::IntArrayRef(spec_.feature_shape), ", got rows of shape ", feat,
            "; a store array needs one feature shape per hook point (pass attention_mask= to "
            "tracker.set_batch() for sequences of varying length; feed images of one size; or "
            "exclude this hook point)");
  std::lock_guard<std::mutex> lock(mu_);
  ACS_CHECK(!flushed_, "hook point '", spec_.hook_point, "': rows appended after the array was flushed");
  if (ready) {
    // Rows on their way from a device (an asynchronous copy into pinned host memory, queued
    // behind the model's kernels): waiting for the copy here would stall the forward at every
    // hook point until the device caught up. They are kept, and taken into chunks in order
    // once their copies are done (at a later append, or at the flush); past a bound the
    // oldest are waited for (memory held in pinned buffers stays bounded).
    const int64_t bytes = rows.numel() * static_cast<int64_t>(rows.element_size());
    deferred_.push_back({rows, std::move(ready), bytes});
    deferred_bytes_ += bytes;
    core_->add_deferred(bytes);
    n_rows_.fetch_add(rows.size(0));
    drain(false);
    return;
  }
  drain(true);  // (rows before these first)
  if (!rows.device().is_cpu()) rows = rows.to(at::kCPU);
  append_now(rows);
  n_rows_.fetch_add(rows.size(0));
}

void ArrayWriter::drain(bool all) {
  // bounds on the pinned memory held: this array's (4 chunks, at least 16 MiB) and the store's
  const int64_t bound = std::max<int64_t>(4 * chunk_bytes_, int64_t{16} << 20);
  while (!deferred_.empty()) {
    Deferred& d = deferred_.front();
    if (!all && deferred_bytes_ <= bound && core_->deferred_bytes() <= StoreCore::kDeferredTotal &&
        !d.ready->query())
      return;
    d.ready->synchronize();
    const at::Tensor rows = std::move(d.rows);
    deferred_bytes_ -= d.bytes;
    core_->add_deferred(-d.bytes);
    deferred_.pop_front();
    append_now(rows);
  }
}

void ArrayWriter::append_now(const at::Tensor& rows) {
  int64_t off = 0;
  const int64_t n = rows.size(0);
  // Contiguous rows of the storage dtype: plain byte copies, no dispatcher per chunk.
  const bool fast = rows.scalar_type() == spec_.dtype && rows.is_contiguous() && rows.layout() == at::kStrided &&
                    !rows.is_conj() && !rows.is_neg();
  while (off < n) {
    if (!chunk_.defined()) {
      std::vector<int64_t> shape{spec_.chunk_rows};
      shape.insert(shape.end(), spec_.feature_shape.begin(), spec_.feature_shape.end());
      chunk_ = core_->take_buffer(shape, spec_.dtype, chunk_bytes_);
      fill_ = 0;
    }
    const int64_t k = std::min(n - off, spec_.chunk_rows - fill_);
    if (fast) {
      copy_bytes(static_cast<char*>(chunk_.data_ptr()) + fill_ * row_bytes_,
                 static_cast<const char*>(rows.const_data_ptr()) + off * row_bytes_, k * row_bytes_);
    } else {
      chunk_.narrow(0, fill_, k).copy_(rows.narrow(0, off, k));
    }
    fill_ += k;
    off += k;
    chunked_rows_ += k;
    if (fill_ == spec_.chunk_rows) push_chunk(false);
  }
}

void ArrayWriter::push_chunk(bool final) {
  WorkItem item;
  item.array = shared_from_this();
  item.chunk = next_chunk_++;
  item.rows_end = chunked_rows_;
  item.final = final;
  item.raw = std::move(chunk_);
  item.budget_bytes = chunk_bytes_;
  chunk_ = at::Tensor();
  fill_ = 0;
  core_->push(std::move(item));
}

void ArrayWriter::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (flushed_) return;
  core_->check();
  drain(true);  // rows still on their way from a device
  flushed_ = true;
  if (chunk_.defined() && fill_ > 0) {
    chunk_.narrow(0, fill_, spec_.chunk_rows - fill_).zero_();  // fill value 0
    push_chunk(true);
  } else {
    // Nothing partial: close the open shard (if any rows in it) with an empty final item.
    WorkItem item;
    item.array = shared_from_this();
    item.chunk = -1;
    item.rows_end = chunked_rows_;
    item.final = true;
    chunk_ = at::Tensor();
    core_->push(std::move(item));
  }
}

void ArrayWriter::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  if (flushed_) return;
  core_->check();
  drain(true);  // rows still on their way from a device
  const int64_t shard_rows = spec_.chunk_rows * spec_.shard_chunks;
  if (chunked_rows_ % shard_rows == 0) return;  // every row in a complete shard (durable soon)
  WorkItem item;
  item.array = shared_from_this();
  item.snapshot = true;
  item.rows_end = chunked_rows_;
  item.chunk = -1;
  if (chunk_.defined() && fill_ > 0) {
    std::vector<int64_t> shape{spec_.chunk_rows};
    shape.insert(shape.end(), spec_.feature_shape.begin(), spec_.feature_shape.end());
    at::Tensor copy = core_->take_buffer(shape, spec_.dtype, chunk_bytes_);
    char* dst = static_cast<char*>(copy.data_ptr());
    copy_bytes(dst, chunk_.const_data_ptr(), fill_ * row_bytes_);
    std::memset(dst + fill_ * row_bytes_, 0, (spec_.chunk_rows - fill_) * row_bytes_);  // fill value 0
    item.chunk = next_chunk_;
    item.raw = std::move(copy);
    item.budget_bytes = chunk_bytes_;
  }
  core_->push(std::move(item));
}

void ArrayWriter::write_index(int fd, const ShardRecord& rec, const std::string& path, int64_t* off) const {
  // Index: (offset, nbytes) uint64 little-endian per inner chunk (C order), 2^64-1 for an
  // empty chunk, then crc32c of those bytes (uint32 little-endian). Index at the end.
  const uint64_t empty = std::numeric_limits<uint64_t>::max();
  std::vector<uint64_t> index(2 * spec_.shard_chunks);
  for (int64_t j = 0; j < spec_.shard_chunks; ++j) {
    const bool has = rec.offsets[j] >= 0;
    index[2 * j] = has ? static_cast<uint64_t>(rec.offsets[j]) : empty;
    index[2 * j + 1] = has ? static_cast<uint64_t>(rec.nbytes[j]) : empty;
  }
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian host expected");
  const size_t index_bytes = index.size() * sizeof(uint64_t);
  const uint32_t crc = crc32c(0, index.data(), index_bytes);
  write_all(fd, index.data(), index_bytes, path);
  write_all(fd, &crc, sizeof(crc), path);
  *off += static_cast<int64_t>(index_bytes + sizeof(crc));
}

void ArrayWriter::write_snapshot(WorkItem& item) {
  const int64_t shard_rows = spec_.chunk_rows * spec_.shard_chunks;
  const int64_t shard = (item.rows_end - 1) / shard_rows;
  if (item.rows_end <= durable_rows_.load()) return;  // (durable already)
  ShardRecord rec;
  if (fd_ >= 0) {
    ACS_CHECK(open_shard_ == shard, "hook point '", spec_.hook_point, "': a partial shard ", shard,
              " was asked for while shard ", open_shard_, " is open");
    rec = cur_;
  } else {
    if (item.chunk < 0) return;  // (no row past the complete shards)
    rec.shard = shard;
    rec.offsets.assign(spec_.shard_chunks, -1);
    rec.nbytes.assign(spec_.shard_chunks, -1);
    rec.crcs.assign(spec_.shard_chunks, 0);
  }
  FdCloser tmp_dir{open_dir(spec_.tmp_dir, true)};
  const std::string name = c10::str("shard-", reinterpret_cast<uintptr_t>(this), "-", shard, "-",
                                    static_cast<long>(::getpid()), ".snap.tmp");
  const std::string path = spec_.tmp_dir + "/" + name;
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
  int fd = ::openat(tmp_dir.fd, name.c_str(), flags, 0644);
  if (fd < 0 && errno == EEXIST && ::unlinkat(tmp_dir.fd, name.c_str(), 0) == 0) {
    fd = ::openat(tmp_dir.fd, name.c_str(), flags, 0644);
  }
  if (fd < 0) {
    if (errno == ELOOP) not_a_folder(path);
    io_fail("creating shard", path, errno);
  }
  int64_t off = 0;
  try {
    // the chunks the open shard holds so far, as written (the same bytes at the same offsets)
    if (fd_ >= 0 && file_off_ > 0) {
      std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(file_off_, int64_t{8} << 20)));
      while (off < file_off_) {
        const size_t want = static_cast<size_t>(std::min<int64_t>(file_off_ - off, static_cast<int64_t>(buf.size())));
        const ssize_t got = ::pread(fd_, buf.data(), want, off);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) io_fail("reading back shard", tmp_path_, got < 0 ? errno : EIO);
        write_all(fd, buf.data(), static_cast<size_t>(got), path);
        off += got;
      }
    }
    if (item.chunk >= 0) {
      const auto [data, n] = item.bytes(spec_.encoded);
      const int64_t local = item.chunk % spec_.shard_chunks;
      rec.crcs[local] = crc32c(0, data, n);
      write_all(fd, data, n, path);
      rec.offsets[local] = off;
      rec.nbytes[local] = static_cast<int64_t>(n);
      off += static_cast<int64_t>(n);
    }
    write_index(fd, rec, path, &off);
    if (core_->fsync_enabled() && ::fsync(fd) != 0) io_fail("fsync of shard", path, errno);
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) io_fail("closing shard", path, errno);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    unlink_in_tmp_dir(path);
    throw;
  }
  rec.rows_end = item.rows_end;
  rec.file_bytes = off;
  publish(path, std::move(rec));
  // its key may hold committed rows from now on: every later file of this shard is held
  if (std::find(held_shards_.begin(), held_shards_.end(), shard) == held_shards_.end()) held_shards_.push_back(shard);
}

void ArrayWriter::publish(const std::string& tmp_path, ShardRecord rec) {
  std::string final_path = shard_path(rec.shard);
  const bool held = std::find(held_shards_.begin(), held_shards_.end(), rec.shard) != held_shards_.end();
  if (held) final_path += ".resumed.tmp";
  // (a held file is renamed and noted as one step against install_held: the file it renames
  // over the key is the one whose record it returns)
  std::unique_lock<std::mutex> hold_lock(held_mu_, std::defer_lock);
  if (held) hold_lock.lock();
  // the folders opened again, none through a link (made again where one went since the
  // shard was opened), and the shard renamed relative to them
  int shard_dir = -1;
  try {
    FdCloser tmp_dir{open_dir(spec_.tmp_dir, false)};
    FdCloser array_dir{spec_.dir == spec_.tmp_dir ? ::dup(tmp_dir.fd) : open_dir(spec_.dir, false)};
    if (array_dir.fd < 0) io_fail("opening directory", spec_.dir, errno);
    shard_dir = open_folder_below(array_dir.fd, spec_.dir, dirname_of(final_path).substr(spec_.dir.size()));
    if (::renameat(tmp_dir.fd, basename_of(tmp_path).c_str(), shard_dir, basename_of(final_path).c_str()) != 0) {
      io_fail("renaming shard to", final_path, errno);
    }
  } catch (...) {
    if (shard_dir >= 0) ::close(shard_dir);
    unlink_in_tmp_dir(tmp_path);
    throw;
  }
  FdCloser renamed_in{shard_dir};
  if (core_->fsync_enabled()) ::fsync(shard_dir);
  const int64_t rows_end = rec.rows_end;
  if (held) {
    auto it = held_pending_.begin();
    while (it != held_pending_.end() && it->second.shard < rec.shard) ++it;
    if (it != held_pending_.end() && it->second.shard == rec.shard) {
      it->second = std::move(rec);  // (renamed over the same held name: the latest file)
    } else {
      held_pending_.insert(it, {final_path, std::move(rec)});
    }
    hold_lock.unlock();
  } else {
    std::lock_guard<std::mutex> lock(rec_mu_);
    records_.push_back(std::move(rec));
  }
  if (rows_end > durable_rows_.load()) durable_rows_.store(rows_end);
  core_->bump_durable();
}

std::vector<std::pair<int64_t, int64_t>> ArrayWriter::held_shards() {
  std::lock_guard<std::mutex> lock(held_mu_);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& h : held_pending_) out.emplace_back(h.second.shard, h.second.rows_end);
  return out;
}

std::vector<ShardRecord> ArrayWriter::install_held(const std::vector<int64_t>& shards) {
  std::lock_guard<std::mutex> lock(held_mu_);
  std::vector<ShardRecord> out;
  const std::string suffix = ".resumed.tmp";
  for (auto it = held_pending_.begin(); it != held_pending_.end();) {
    if (std::find(shards.begin(), shards.end(), it->second.shard) == shards.end()) {
      ++it;
      continue;
    }
    auto& h = *it;
    const std::string key = h.first.substr(0, h.first.size() - suffix.size());
    if (::rename(h.first.c_str(), key.c_str()) != 0) io_fail("renaming the rewritten shard to", key, errno);
    if (core_->fsync_enabled()) {
      FdCloser dir{open_folder(dirname_of(key))};
      ::fsync(dir.fd);
    }
    out.push_back(std::move(h.second));
    it = held_pending_.erase(it);
  }
  return out;
}

void ArrayWriter::drop_held() {
  std::lock_guard<std::mutex> lock(held_mu_);
  for (const auto& h : held_pending_) ::unlink(h.first.c_str());
  held_pending_.clear();
}

std::string ArrayWriter::shard_path(int64_t shard) const {
  // Zarr v3 default chunk key encoding, separator "/": c/<shard>/0/0...
  std::string p = spec_.dir + "/c/" + std::to_string(shard);
  for (size_t i = 0; i < spec_.feature_shape.size(); ++i) p += "/0";
  return p;
}

void ArrayWriter::abandon_shard() {
  if (fd_ >= 0) {
    ::close(fd_);
    unlink_tmp();
    fd_ = -1;
  }
  open_shard_ = -1;
}

void ArrayWriter::write_chunk(WorkItem& item) {
  if (item.snapshot) {
    write_snapshot(item);
    return;
  }
  if (item.chunk < 0) {  // empty final marker
    if (fd_ >= 0) finish_shard(item.rows_end);
    return;
  }
  const int64_t shard = item.chunk / spec_.shard_chunks;
  const int64_t local = item.chunk % spec_.shard_chunks;
  if (fd_ >= 0 && open_shard_ != shard) finish_shard(durable_rows_.load());  // defensive
  if (fd_ < 0) {
    FdCloser tmp_dir{open_dir(spec_.tmp_dir, true)};
    const std::string tmp_name = c10::str("shard-", reinterpret_cast<uintptr_t>(this), "-", shard, "-",
                                          static_cast<long>(::getpid()), ".tmp");
    tmp_path_ = spec_.tmp_dir + "/" + tmp_name;
    // a file of its own (O_EXCL): never one already at that name (the names are known once one
    // is seen: a hard link to a file elsewhere planted there would be truncated and written into);
    // one found there (a planted one, or left by a killed process of the same pid) loses its name
    // (read back too, by write_snapshot)
    const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
    fd_ = ::openat(tmp_dir.fd, tmp_name.c_str(), flags, 0644);
    if (fd_ < 0 && errno == EEXIST && ::unlinkat(tmp_dir.fd, tmp_name.c_str(), 0) == 0) {
      fd_ = ::openat(tmp_dir.fd, tmp_name.c_str(), flags, 0644);
    }
    if (fd_ < 0) {
      if (errno == ELOOP) not_a_folder(tmp_path_);
      io_fail("creating shard", tmp_path_, errno);
    }
    open_shard_ = shard;
    // the shard's folder now, while the model runs, not when the shard is finished (at the
    // close, that is on the capture's critical path, every array at once)
    std::string final_path = shard_path(shard);
    shard_dir_ = dirname_of(final_path);
    FdCloser array_dir{spec_.dir == spec_.tmp_dir ? ::dup(tmp_dir.fd) : open_dir(spec_.dir, true)};
    if (array_dir.fd < 0) io_fail("opening directory", spec_.dir, errno);
    FdCloser made{open_folder_below(array_dir.fd, spec_.dir, shard_dir_.substr(spec_.dir.size()))};
    file_off_ = 0;
    cur_ = ShardRecord();
    cur_.shard = shard;
    cur_.offsets.assign(spec_.shard_chunks, -1);
    cur_.nbytes.assign(spec_.shard_chunks, -1);
    cur_.crcs.assign(spec_.shard_chunks, 0);
  }
  const auto [data, n] = item.bytes(spec_.encoded);
  const uint32_t crc = crc32c(0, data, n);
  write_all(fd_, data, n, tmp_path_);
  cur_.offsets[local] = file_off_;
  cur_.nbytes[local] = static_cast<int64_t>(n);
  cur_.crcs[local] = crc;
  file_off_ += static_cast<int64_t>(n);
  if (local == spec_.shard_chunks - 1 || item.final) finish_shard(item.rows_end);
}

void ArrayWriter::finish_shard(int64_t rows_end) {
  write_index(fd_, cur_, tmp_path_, &file_off_);
  if (core_->fsync_enabled() && ::fsync(fd_) != 0) io_fail("fsync of shard", tmp_path_, errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    io_fail("closing shard", tmp_path_, errno);
  }
  fd_ = -1;
  open_shard_ = -1;
  cur_.rows_end = rows_end;
  cur_.file_bytes = file_off_;
  publish(tmp_path_, cur_);
}

std::vector<ShardRecord> ArrayWriter::take_durable() {
  std::lock_guard<std::mutex> lock(rec_mu_);
  std::vector<ShardRecord> out;
  out.swap(records_);
  return out;
}

}  // namespace acs
