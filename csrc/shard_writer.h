// The store's shard writer (see store/FORMAT.md): receives rows from the hook path, fills
// chunks and appends them to shard files on a writer thread. Pure ATen, no Python.
#pragma once

#include "row_consumer.h"

namespace acs {}  // namespace acs
