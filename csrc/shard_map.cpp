#include "shard_map.h"

#include <Python.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"

namespace acs {

namespace {

// ---------------------------------------------------------------- SIGBUS guard
// Touching a page of a file mapping past the file's end (a shard truncated or rewritten in
// place -- `cp` over it -- while it is mapped) raises SIGBUS, which kills the process. Each
// mapping made here is registered; the SIGBUS handler maps a zero page over the faulting page
// of a registered mapping (so the access completes), and schedules a Python call
// (Py_AddPendingCall) that raises activationscope.errors.StoreCorruptError naming the file in
// the main thread at its next bytecode. A fault anywhere else goes to the handler that was
// there before (faulthandler, or the default action: the process dies as it would have).
// Native reads that copy from mappings (gather_rows) also check the faults taken during
// their copy (check_mapped_faults) and raise in their own thread -- which may not be the
// main one -- claiming the faults, so that the main thread does not raise them again.

constexpr int kMaxGuarded = 4096;

struct Guarded {
  std::atomic<uintptr_t> base{0};
  std::atomic<uintptr_t> end{0};
};

Guarded g_guarded[kMaxGuarded];
std::mutex g_guard_mu;  // registration, and the paths below (never taken in the handler)
// A fork while another thread holds g_guard_mu (mapping or letting go of a shard: a read-ahead,
// a DataLoader's prefetch thread) waits for it, so that the child (a DataLoader worker) starts
// with it free and the slots whole: the thread that held it does not exist in the child, whose
// first mapping would wait for it forever. Nothing done under it waits for the GIL (which the
// forking thread holds) or for another lock.
void guard_lock_for_fork() { g_guard_mu.lock(); }
void guard_unlock_after_fork() { g_guard_mu.unlock(); }
[[maybe_unused]] const int g_guard_at_fork =
    pthread_atfork(guard_lock_for_fork, guard_unlock_after_fork, guard_unlock_after_fork);
std::vector<std::string> g_paths[kMaxGuarded];
int64_t g_stride[kMaxGuarded];
std::atomic<uintptr_t> g_fault_addr{0};
std::atomic<int> g_fault_slot{-1};
std::atomic<bool> g_pending{false};
// Faults taken on guarded mappings: a count, the last kRing addresses, and how many are
// neither raised in the main thread nor claimed by a native read (check_mapped_faults).
constexpr uint64_t kRing = 64;
std::atomic<uint64_t> g_fault_count{0};
std::atomic<uint64_t> g_fault_reserved{0};  // ring slots taken (a fault counts once its address is in)
std::atomic<uintptr_t> g_fault_ring[kRing];
std::atomic<int64_t> g_unclaimed{0};
struct sigaction g_prev {};
long g_page = 4096;

std::string truncated_message(const std::string& path) {
  return "shard " + path + " was truncated or rewritten in place while it was memory-mapped "
      "(e.g. `cp` over a store that is being read): rows read from it since then are zeros, not the stored "
      "values; reopen the store (open_store) once the copy is complete, and check it with `activationscope "
      "verify`. Replace store files atomically (copy elsewhere, then rename) while readers have them open";
}

// The file a faulting address of guarded slot `slot` lies in, quoted ("a shard file" when unknown).
std::string path_at(int slot, uintptr_t addr) {
  std::lock_guard<std::mutex> lock(g_guard_mu);
  if (slot < 0 || g_paths[slot].empty()) return "a shard file";
  const uintptr_t base = g_guarded[slot].base.load();
  size_t i = base && addr >= base && g_stride[slot] > 0 ? (addr - base) / static_cast<size_t>(g_stride[slot]) : 0;
  if (i >= g_paths[slot].size()) i = g_paths[slot].size() - 1;
  return "'" + g_paths[slot][i] + "'";
}

int slot_of(uintptr_t addr) {
  for (int i = 0; i < kMaxGuarded; ++i) {
    const uintptr_t b = g_guarded[i].base.load(std::memory_order_acquire);
    if (b != 0 && addr >= b && addr < g_guarded[i].end.load(std::memory_order_acquire)) return i;
  }
  return -1;
}

int raise_truncated(void*) {
  const int slot = g_fault_slot.exchange(-1);
  const uintptr_t addr = g_fault_addr.load();
  g_pending.store(false);
  if (g_unclaimed.exchange(0) <= 0) return 0;  // every fault was raised by the read that took it
  const std::string msg = truncated_message(path_at(slot, addr));
  PyObject* mod = PyImport_ImportModule("activationscope.errors");
  PyObject* cls = mod != nullptr ? PyObject_GetAttrString(mod, "StoreCorruptError") : nullptr;
  Py_XDECREF(mod);
  PyErr_Clear();
  PyErr_SetString(cls != nullptr ? cls : PyExc_OSError, msg.c_str());
  Py_XDECREF(cls);
  return -1;
}

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  for (int i = 0; i < kMaxGuarded; ++i) {
    const uintptr_t b = g_guarded[i].base.load(std::memory_order_acquire);
    if (b == 0 || a < b || a >= g_guarded[i].end.load(std::memory_order_acquire)) continue;
    void* page = reinterpret_cast<void*>(a & ~static_cast<uintptr_t>(g_page - 1));
    if (mmap(page, static_cast<size_t>(g_page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
             -1, 0) == MAP_FAILED) {
      break;
    }
    g_fault_addr.store(a);
    g_fault_slot.store(i);
    g_fault_ring[g_fault_reserved.fetch_add(1) % kRing].store(a, std::memory_order_relaxed);
    g_unclaimed.fetch_add(1);
    g_fault_count.fetch_add(1, std::memory_order_release);
    if (!g_pending.exchange(true) && Py_AddPendingCall(raise_truncated, nullptr) != 0) g_pending.store(false);
    return;
  }
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction != nullptr) {
      g_prev.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
    g_prev.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);  // the access runs again and takes the default action
}

// Install the handler (again, when something -- faulthandler.enable() -- replaced it).
void install_guard() {
  struct sigaction cur {};
  sigaction(SIGBUS, nullptr, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  g_page = sysconf(_SC_PAGESIZE);
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_prev);
}

int guard(void* base, size_t bytes, const std::vector<std::string>& paths, int64_t stride) {
  std::lock_guard<std::mutex> lock(g_guard_mu);
  install_guard();
  for (int i = 0; i < kMaxGuarded; ++i) {
    if (g_guarded[i].base.load() != 0) continue;
    g_paths[i] = paths;
    g_stride[i] = stride;
    g_guarded[i].end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_release);
    g_guarded[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return -1;  // more live mappings than slots: this one is unguarded
}

void unguard(int slot) {
  if (slot < 0) return;
  std::lock_guard<std::mutex> lock(g_guard_mu);
  g_guarded[slot].base.store(0, std::memory_order_release);
  g_guarded[slot].end.store(0, std::memory_order_release);
  g_paths[slot].clear();
}

struct Region {
  void* base;
  size_t bytes;
  int slot = -1;
};

void unmap_region(void* ctx) {
  auto* r = static_cast<Region*>(ctx);
  unguard(r->slot);
  munmap(r->base, r->bytes);
  delete r;
}

}  // namespace

void hold_map_guard_for_tests(int ready_fd, int release_fd, double then_s) {
  std::lock_guard<std::mutex> lock(g_guard_mu);
  const char one = 1;
  while (write(ready_fd, &one, 1) < 0 && errno == EINTR) {
  }
  char got = 0;
  while (read(release_fd, &got, 1) < 0 && errno == EINTR) {
  }
  if (then_s > 0) usleep(static_cast<useconds_t>(then_s * 1e6));
}

uint64_t mapped_fault_count() { return g_fault_count.load(std::memory_order_acquire); }

void check_mapped_faults(uint64_t since, const std::vector<std::pair<const void*, size_t>>& ranges) {
  const uint64_t now = g_fault_count.load(std::memory_order_acquire);
  if (now == since) return;
  // The faults since `since` within `ranges` (all of them when more than the ring holds).
  uintptr_t hit = 0;
  uint64_t mine = 0;
  for (uint64_t k = now > since + kRing ? now - kRing : since; k < now; ++k) {
    const uintptr_t a = g_fault_ring[k % kRing].load(std::memory_order_relaxed);
    for (const auto& r : ranges) {
      const uintptr_t lo = reinterpret_cast<uintptr_t>(r.first);
      if (a >= lo && a < lo + r.second) {
        if (!hit) hit = a;
        ++mine;
        break;
      }
    }
  }
  if (!hit) return;
  // Claimed: the main thread's pending call raises only faults nobody raised.
  int64_t left = g_unclaimed.load();
  while (left > 0 && !g_unclaimed.compare_exchange_weak(left, std::max<int64_t>(0, left - static_cast<int64_t>(mine)))) {
  }
  throw StoreCorruptNativeError(truncated_message(path_at(slot_of(hit), hit)));
}

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
      const int fd = ::open(paths[i].c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
      ACS_CHECK(fd >= 0, "opening shard '", paths[i], "' failed: ", std::strerror(errno));
      struct stat st {};
      const bool ok = fstat(fd, &st) == 0;
      if (ok && !S_ISREG(st.st_mode)) {
        ::close(fd);
        ACS_CHECK(false, "shard '", paths[i], "' must be a regular file");
      }
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
  region->slot = guard(base, reserved, paths, stride_bytes);
  return at::from_blob(
      base, {total_bytes}, [region](void*) { unmap_region(region); }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace acs
