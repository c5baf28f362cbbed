#include "staging_pool.h"

#include <c10/core/Allocator.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace acs {

namespace {

struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<void*> free_slabs;
  int64_t cap = -1;
  bool prefault = true;
  int want = 0;  // slabs the background thread should prepare
  bool thread_started = false;
  pid_t owner = 0;
};

// $ACS_STAGING_POOL_BYTES: a whole number of bytes, at least 0 (the Python side refuses any
// other value when an ActivationScope is made, naming the variable); unset or not such a number: 1 GiB.
int64_t cap_from_env() {
  const int64_t fallback = int64_t(1) << 30;
  const char* env = std::getenv("ACS_STAGING_POOL_BYTES");
  if (!env || !*env) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  if (errno != 0 || end == env || *end != '\0' || v < 0) return fallback;
  return int64_t(v);
}

Pool& pool() {
  static Pool* p = new Pool();  // leaked on purpose: outlives every storage
  if (p->owner != getpid()) {
    // First use, or a child after fork: the parent's thread and lock state are gone. A child
    // keeps the parent's settings (a cap set with set_pool_cap_bytes, not the environment's).
    const bool child = p->owner != 0;
    const int64_t cap = child ? p->cap : cap_from_env();
    const bool prefault = child ? p->prefault : true;
    new (p) Pool();
    p->owner = getpid();
    p->cap = cap;
    p->prefault = prefault;
  }
  return *p;
}

void* map_slab(bool populate) {
  void* ptr = mmap(nullptr, kSlabBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0), -1, 0);
  if (ptr == MAP_FAILED) throw std::bad_alloc();
  return ptr;
}

void release_slab(void* ptr) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (int64_t(p.free_slabs.size() + 1) * kSlabBytes <= p.cap) {
      p.free_slabs.push_back(ptr);
      return;
    }
  }
  munmap(ptr, kSlabBytes);
}

void background_loop() {
  Pool& p = pool();
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(p.mu);
      p.cv.wait(lock, [&] { return p.want > 0; });
      --p.want;
      if (int64_t(p.free_slabs.size() + 1) * kSlabBytes > p.cap) continue;
    }
    void* ptr = nullptr;
    try {
      ptr = map_slab(/*populate=*/true);
    } catch (...) {
      continue;
    }
    release_slab(ptr);
  }
}

}  // namespace

c10::Storage acquire_slab(bool expect_more) {
  Pool& p = pool();
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    if (!p.free_slabs.empty()) {
      ptr = p.free_slabs.back();
      p.free_slabs.pop_back();
    }
    if (expect_more && p.prefault && p.cap >= kSlabBytes && p.free_slabs.empty()) {
      if (!p.thread_started) {
        std::thread(background_loop).detach();
        p.thread_started = true;
      }
      p.want = 1;
      p.cv.notify_one();
    }
  }
  // Not populated here: a small capture only pays (and holds) the pages it touches.
  if (!ptr) ptr = map_slab(/*populate=*/false);
  c10::DataPtr data(ptr, ptr, &release_slab, c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), kSlabBytes, std::move(data),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

void set_pool_cap_bytes(int64_t cap) {
  Pool& p = pool();
  std::vector<void*> over;  // slabs pooled past the new cap: unmapped now, not kept
  {
    std::lock_guard<std::mutex> lock(p.mu);
    p.cap = cap;
    while (!p.free_slabs.empty() && int64_t(p.free_slabs.size()) * kSlabBytes > cap) {
      over.push_back(p.free_slabs.back());
      p.free_slabs.pop_back();
    }
  }
  for (void* s : over) munmap(s, kSlabBytes);
}

int64_t pool_cap_bytes() { return pool().cap; }

int64_t pooled_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  return int64_t(p.free_slabs.size()) * kSlabBytes;
}

void trim_pool() {
  Pool& p = pool();
  std::vector<void*> slabs;
  {
    std::lock_guard<std::mutex> lock(p.mu);
    slabs.swap(p.free_slabs);
  }
  for (void* s : slabs) munmap(s, kSlabBytes);
}

void set_prefault(bool enabled) {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  p.prefault = enabled;
}

}  // namespace acs
