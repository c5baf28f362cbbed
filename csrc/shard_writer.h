// The store's shard writer (see store/FORMAT.md): receives rows from the hook path, fills
// chunks and appends them to shard files on one writer thread per store. Pure ATen, no
// Python.
//
// Data flow of one array:
//   ArrayWriter::append (hot path, no GIL)  -- cast + copy rows into the current chunk
//   full chunk -> StoreCore queue (bounded in bytes, shared by all arrays of the store;
//                 the producer blocks when it is full = backpressure)
//   [compressed arrays: chunk -> encode queue -> an encoder (Python thread, numcodecs,
//    GIL released while compressing) -> submit_encoded -> write queue]
//   writer thread: append the chunk to the shard's temporary file, crc32c it; when the shard
//   is complete (or at the final flush): append the shard index (+ its crc32c), fsync if
//   asked, rename to the shard's key. The rows of renamed shards are "durable".
// Writer-thread errors are kept and re-raised (StoreIOError) on the next append / flush /
// check; the thread never throws.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "row_consumer.h"

namespace acs {

// A store I/O failure (disk full, file too large, I/O error). py_errors.cpp maps it to
// activationscope.errors.StoreError.
class StoreIOError : public UserError {
 public:
  using UserError::UserError;
};

// CRC-32C (Castagnoli), as in the Zarr crc32c codec. `crc` is a previous value (0 to start).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

struct ArraySpec {
  std::string hook_point;
  std::string dir;                      // local directory of the array (holds c/...)
  std::string tmp_dir;                  // where shard temporaries live (same filesystem)
  // The store's folder (a remote store's: its staging folder), "" for none. `dir` and `tmp_dir`
  // lie below it, and every folder from it down is opened relative to it without following a
  // link (one swapped for a link during a capture is refused, never written through). The
  // root itself is opened once, when the array writer is made.
  std::string root;
  at::ScalarType dtype = at::kFloat;    // element type written (bfloat16 = its bit pattern)
  std::vector<int64_t> feature_shape;
  int64_t chunk_rows = 1;
  int64_t shard_chunks = 1;             // chunks per shard
  int64_t start_row = 0;                // first row written; a multiple of the shard rows
  bool encoded = false;                 // chunks go through the encoder (compression)
  // A shard whose file is renamed to "<key>.resumed.tmp" instead of its key (-1: none): the
  // committed partial last shard a resume rewrites keeps its key until the resume's commit
  // renames the new file over it (store/FORMAT.md section 7). A shard written early as a
  // partial shard (ArrayWriter::snapshot) is held the same way from then on.
  int64_t hold_shard = -1;
};

// One record per durable shard (renamed, complete).
struct ShardRecord {
  int64_t shard = 0;                    // shard index along rows
  int64_t rows_end = 0;                 // rows of the array covered up to the end of this shard
  int64_t file_bytes = 0;
  std::vector<int64_t> offsets;         // per chunk written (others are empty)
  std::vector<int64_t> nbytes;
  std::vector<uint32_t> crcs;           // crc32c of the encoded chunk bytes
};

class ArrayWriter;

struct WorkItem {
  std::shared_ptr<ArrayWriter> array;
  int64_t chunk = 0;                    // global chunk index along rows
  int64_t rows_end = 0;                 // array rows after this chunk's real rows
  bool final = false;                   // last chunk of the array: close the shard after it
  // a copy of the open shard made durable as a partial shard (ArrayWriter::snapshot): `raw`,
  // when defined, is a zero-padded copy of the partial chunk (`chunk` its index, else -1)
  bool snapshot = false;
  at::Tensor raw;                       // contiguous chunk (chunk_rows, *feature_shape)
  std::string encoded;                  // encoded bytes (compressed arrays)
  int64_t budget_bytes = 0;             // bytes held against the queue cap
  uint64_t id = 0;

  // The bytes this chunk stores in its shard: `encoded` for a compressed array, else `raw`.
  std::pair<const void*, size_t> bytes(bool is_encoded) const {
    if (is_encoded) return {encoded.data(), encoded.size()};
    return {raw.data_ptr(), static_cast<size_t>(raw.nbytes())};
  }
};

// One per store: the bounded queue and the writer thread.
class StoreCore : public std::enable_shared_from_this<StoreCore> {
 public:
  // The only way to make one. In a process forked after it was made, the last reference
  // dropped does not destroy it: the writer thread is the parent's, and so may be the
  // waiters on its condition variables and the holders of its locks at the fork
  // (pthread_cond_destroy would wait for those waiters forever); the memory is the child's to lose.
  static std::shared_ptr<StoreCore> make(int64_t max_pending_bytes, bool fsync);
  ~StoreCore();

  // Producer side (hot path).
  void push(WorkItem item);             // blocks while the queue is over its byte cap
  // Encoder side (exactly one encoder thread, so encoded chunks keep their order): next
  // chunk to encode (blocks); final markers pass straight to the write queue.
  // Returns false when there is nothing more to encode (closing).
  bool next_to_encode(WorkItem* out);
  void submit_encoded(uint64_t id, std::string bytes);
  void fail_encoded(uint64_t id, const std::string& why);

  void drain();                         // wait until every queued chunk is written (or dropped)
  void close();                         // drain, stop the writer thread and the encoders
  void check() const;                   // throw StoreIOError if the writer failed
  bool failed() const;
  std::string error() const;
  void set_error(const std::string& e);
  // Refuse every later append and drop the chunks still queued (none of them is written):
  // the store at the writer's path is no longer the one it locked. `why` is the whole
  // message of the error raised (StoreIOError), no advice added. An earlier error is kept.
  void refuse(const std::string& why);
  bool fsync_enabled() const { return fsync_; }
  // Whether this is the process that made the core (not a child forked after it).
  bool in_owner_process() const { return ::getpid() == owner_pid_; }
  int64_t pending_bytes() const;
  uint64_t durable_version() const { return durable_version_.load(); }
  void bump_durable() { durable_version_.fetch_add(1); }
  int64_t max_pending_bytes() const { return max_pending_bytes_; }

  // Chunk buffers written by the writer thread come back here and are handed out again by
  // ArrayWriter::append: no malloc, free or fresh page faults per chunk on the model's thread.
  // Returns an uninitialised contiguous tensor of ``shape`` and ``dtype``.
  at::Tensor take_buffer(c10::IntArrayRef shape, c10::ScalarType dtype, int64_t nbytes);

  // The folder `root` opened once per store (its path resolved then); every array writer of
  // the store opens its folders relative to it. Closed with the core.
  int root_fd(const std::string& root);

  // Bytes of rows, over all arrays, waiting in pinned host memory for their copies from a
  // device (ArrayWriter's deferred rows): past kDeferredTotal each array waits for its oldest.
  static constexpr int64_t kDeferredTotal = int64_t{256} << 20;
  int64_t add_deferred(int64_t bytes) { return deferred_bytes_.fetch_add(bytes) + bytes; }
  int64_t deferred_bytes() const { return deferred_bytes_.load(); }

 private:
  std::atomic<int64_t> deferred_bytes_{0};
  StoreCore(int64_t max_pending_bytes, bool fsync);  // (make)
  void run();
  void release(int64_t bytes);
  void give_buffer(at::Tensor buf);   // writer thread: a written chunk's buffer, if no one else holds it

  const int64_t max_pending_bytes_;
  const bool fsync_;
  mutable std::mutex mu_;
  std::condition_variable cv_space_;    // producers wait for budget
  std::condition_variable cv_work_;     // writer waits for work
  std::condition_variable cv_encode_;   // encoders wait for chunks to encode
  std::condition_variable cv_idle_;     // drain waits for an empty pipeline
  std::deque<WorkItem> write_q_;
  std::deque<WorkItem> encode_q_;       // waiting for an encoder
  std::vector<WorkItem> encoding_;      // taken by an encoder, in order of id
  int64_t pending_bytes_ = 0;
  int64_t in_flight_ = 0;               // items pushed and not yet written / dropped
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::string error_;
  std::atomic<bool> failed_{false};
  bool refused_ = false;                // failed_ by refuse(): error_ is the whole message
  std::atomic<uint64_t> durable_version_{0};
  std::mutex pool_mu_;
  std::vector<at::Tensor> pool_;         // free chunk buffers (uint8, flat), at most pool_cap_ bytes
  int64_t pool_bytes_ = 0;
  std::mutex roots_mu_;
  std::vector<std::pair<std::string, int>> roots_;  // (root, its fd) of root_fd
  const pid_t owner_pid_;               // the process that started the writer thread
  std::thread thread_;
};

class ArrayWriter : public RowConsumer, public std::enable_shared_from_this<ArrayWriter> {
 public:
  ArrayWriter(std::shared_ptr<StoreCore> core, ArraySpec spec);
  ~ArrayWriter() override;

  // rows: (n, *feature_shape), any dtype / strides; cast to the array dtype. No GIL.
  void append(const at::Tensor& rows, std::shared_ptr<c10::Event> ready) override;
  bool row_spec(at::ScalarType* dtype, std::vector<int64_t>* feature_shape) const override {
    *dtype = spec_.dtype;
    *feature_shape = spec_.feature_shape;
    return true;
  }
  // Push the partial chunk (zero-padded) as the array's final chunk. Idempotent.
  void flush();
  // Make the rows appended so far durable without closing the open shard: the writer thread
  // writes a copy of the open shard with a zero-padded copy of the partial chunk, as the
  // close would write a partial last shard, under the shard's key (its first such copy) or
  // held (every later file of that shard: install_held). Appends go on into the open shard.
  // Nothing when every row is in a complete shard. No GIL.
  void snapshot();
  // The held files of shards (a resume's rewrite, or a shard rewritten after a snapshot)
  // waiting for the commit that lists them, the latest of each shard: held_shards lists their
  // (shard, rows_end); install_held renames those of `shards` over their keys, in shard order,
  // and returns their records (a file of another shard, written since, waits for the next);
  // drop_held removes them.
  std::vector<std::pair<int64_t, int64_t>> held_shards();
  std::vector<ShardRecord> install_held(const std::vector<int64_t>& shards);
  void drop_held();

  int64_t n_rows() const { return n_rows_.load(); }            // rows appended (from row 0), deferred ones too
  int64_t durable_rows() const { return durable_rows_.load(); }
  std::vector<ShardRecord> take_durable();                     // records since the last call
  const ArraySpec& spec() const { return spec_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  int64_t row_bytes() const { return row_bytes_; }

  // Writer thread only.
  void write_chunk(WorkItem& item);
  void abandon_shard();

 private:
  void push_chunk(bool final);
  void append_now(const at::Tensor& rows);  // into chunks (mu_ held; rows on the host)
  void drain(bool all);                     // deferred rows into chunks, in order (mu_ held)
  std::string shard_path(int64_t shard) const;
  void finish_shard(int64_t rows_end);
  void write_snapshot(WorkItem& item);
  // Rename the finished shard file `tmp_path` (in tmp_dir) to the key of rec.shard, or to its
  // held name, and record it (writer thread).
  void publish(const std::string& tmp_path, ShardRecord rec);
  void write_index(int fd, const ShardRecord& rec, const std::string& path, int64_t* off) const;
  // The folder `path` (`dir`, `tmp_dir` or one below them), each component from the root
  // opened without following a link; `make`: the missing ones are made. Returns its fd.
  int open_dir(const std::string& path, bool make) const;
  void unlink_tmp() noexcept;           // the open shard's temporary file, found the same way
  void unlink_in_tmp_dir(const std::string& path) noexcept;

  std::shared_ptr<StoreCore> core_;
  ArraySpec spec_;
  int root_fd_ = -1;                    // spec_.root's (owned by core_), -1 without a root
  int64_t row_bytes_ = 0;
  int64_t chunk_bytes_ = 0;
  std::mutex mu_;                       // producers of this array
  at::Tensor chunk_;                    // current chunk buffer
  int64_t fill_ = 0;                    // rows in chunk_
  int64_t next_chunk_ = 0;              // global index of chunk_
  bool flushed_ = false;
  // Rows copied from a device asynchronously (pinned host memory and the copy's event),
  // waiting for their copies: taken into chunks, in order, once done, so that the forward is
  // not held up by each hook point's copy (see append).
  struct Deferred {
    at::Tensor rows;
    std::shared_ptr<c10::Event> ready;
    int64_t bytes;
  };
  std::deque<Deferred> deferred_;
  int64_t deferred_bytes_ = 0;
  int64_t chunked_rows_ = 0;            // rows in chunks (from row 0): n_rows_ less the deferred ones
  std::atomic<int64_t> n_rows_{0};
  std::atomic<int64_t> durable_rows_{0};
  std::mutex rec_mu_;
  std::vector<ShardRecord> records_;
  // writer-thread state of the open shard
  int fd_ = -1;
  int64_t open_shard_ = -1;
  std::string tmp_path_;
  std::string shard_dir_;               // folder of the open shard's key (made when it was opened)
  int64_t file_off_ = 0;
  ShardRecord cur_;
  // writer thread: shards whose key may hold committed rows (the resume's hold_shard, shards
  // written as a snapshot): their files are held, never renamed straight over the key
  std::vector<int64_t> held_shards_;
  // the latest held file of each shard waiting for install_held: (its path, its record),
  // in shard order (guarded by held_mu_)
  std::mutex held_mu_;
  std::vector<std::pair<std::string, ShardRecord>> held_pending_;
};

}  // namespace acs
