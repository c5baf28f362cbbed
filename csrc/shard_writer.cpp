// The shard writer is implemented here.
#include "shard_writer.h"
