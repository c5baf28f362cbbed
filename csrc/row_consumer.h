// Where captured rows go when they leave the hook: the store's array writer implements
// this (shard_writer.h). Pure ATen, no Python.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <memory>
#include <vector>

namespace acs {

class RowConsumer {
 public:
  virtual ~RowConsumer() = default;
  // rows: (n_rows, *feature_shape), any dtype / strides / device. Called without the GIL.
  // If `ready` is given, rows live in pinned host memory filled by an asynchronous copy
  // and must not be read before ready->synchronize(). May block (backpressure). Throws
  // c10::Error on a writer failure, with the path and the cause.
  virtual void append(const at::Tensor& rows, std::shared_ptr<c10::Event> ready) = 0;
  // The dtype and feature shape of the rows it holds (an array opened at a hook point's first
  // call, which may have been an empty batch), when it has them; false otherwise.
  virtual bool row_spec(at::ScalarType* /*dtype*/, std::vector<int64_t>* /*feature_shape*/) const { return false; }
};

}  // namespace acs
