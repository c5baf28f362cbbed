// Rows of an array at arbitrary positions, gathered from its mapped segments in one pass:
// the per-batch path of ActivationDataset for shuffled and chunk-shuffled batch samplers.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace acs {

// Gather the rows at dataset positions `index` (a list or tuple of Python ints, or a 1-D
// int64 CPU tensor) of an array whose store rows are split into segments:
// segments[k] (a contiguous CPU tensor, or None when not mapped yet) holds store rows
// [bounds[k], bounds[k + 1]). Dataset position p (-n <= p < n) is store row start + p mod n.
//
// Returns, in this order of preference:
//   None                 the index is not something this path takes (a non-int element, a
//                        bool, an empty batch, a position out of range, a non-contiguous
//                        segment): the caller takes its general path, which raises the
//                        right error;
//   int k                segment k is needed and not mapped: map it and call again;
//   (rows, a, b, ids)    rows: (k, *feature) tensor, a view of one segment when the positions
//                        are consecutive store rows [a, b) within it (else a = b = -1 and rows
//                        is a new tensor); ids: the store rows as an int64 (k,) tensor when
//                        want_ids, else None.
// With `out` (a contiguous CPU tensor of the rows' dtype and shape (k, *feature)), the rows
// are copied into it, consecutive ones too, and rows is `out` (a = b = -1); an `out` of
// another dtype, shape or layout gives None. (A DataLoader worker gathers straight into
// shared memory this way.)
// Cold rows of file mappings are asked of the kernel before they are copied (madvise
// WILLNEED, see advise_cold_rows), by `hint`: None no hint; an int, the block: < 0 no hint,
// 0 each row's own pages, > 0 the aligned blocks of that many bytes (rounded up to a power of
// two) around each row; a 1-D int64 CPU tensor of 3, [block, skip, streak], the block and the
// caller's state of that array (zeros at first), which lets a warm array be checked in one
// batch of up to 64 (updated here; any other tensor: no hint).
// The row copies run without the GIL.
pybind11::object gather_rows(const pybind11::handle& index, int64_t n, int64_t start,
                             const std::vector<int64_t>& bounds, const pybind11::list& segments,
                             bool want_ids, const pybind11::object& out, const pybind11::object& hint);

}  // namespace acs
