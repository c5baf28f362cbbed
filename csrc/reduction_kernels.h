// Fast path kernels of the built-in reductions: plain loops over a contiguous CPU batch seen
// as an (n, d) matrix that fold the rows into float64 / int64 per-column state in place, with
// no ATen op and no allocation per call (see reduction_kernels.cpp for the drivers). Every
// kernel accumulates into what the caller passes, so a batch can be fed in row chunks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace acs::kernels {

// A contiguous CPU batch seen as an (n, d) matrix of `dtype` (one of fast_dtype()).
struct RowsView {
  const void* data;
  at::ScalarType dtype;
  int64_t n, d;
};

// float32, float64, float16 and bfloat16: the dtypes the kernels read.
inline bool fast_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

enum class Ext { kMin, kMax, kAbsMax };

// out[j] += column sum (out zeroed by the caller: the batch sums, as x.sum(0)).
void add_column_sums(const RowsView& r, double* out);
// out[j] += sum of squared deviations from mean[j] (out zeroed by the caller).
void add_centred_squares(const RowsView& r, const double* mean, double* out);
// acc[j] += sum of squares of the batch column, summed apart first as acc + batch.
void add_sum_squares(const RowsView& r, double* acc);
// acc[j] += number of values != 0 (NaN != 0 is true: counted, as torch.count_nonzero).
void add_nonzero_counts(const RowsView& r, int64_t* acc);
// acc[j] = min / max / max-abs of acc[j] and the column; NaN sticks (a NaN value replaces the
// accumulator and nothing replaces a NaN accumulator), as torch.amin / amax.
void fold_extremum(Ext e, const RowsView& r, double* acc);
// The same fold of d values v[j] (a batch's extrema) into acc[j]; kAbsMax folds v as given.
void fold_extremum_values(Ext e, const double* v, int64_t d, double* acc);
// Column sums, minima and maxima in one sweep (sum[] zeroed, mn[] = +inf, mx[] = -inf by the
// caller); each column is summed in row order from 0, as add_column_sums.
void add_sums_fold_min_max(const RowsView& r, double* sum, double* mn, double* mx);

// Chan et al.'s merge of a batch of nb rows into a running state of na rows, per column:
// mean[j] += (mb[j] - mean[j]) * wb where both means and their difference are finite, else
// mean[j] * wa + mb[j] * wb (an infinite part stays infinite, +inf with -inf or NaN gives NaN;
// finite means of opposite signs whose difference overflows, as +-1e308, merge to their
// finite weighted sum); with m2 (else null),
// m2[j] += m2b[j] + delta^2 * wm. wa = na / n, wb = nb / n, wm = na * nb / n, n = na + nb.
void chan_fold(double* mean, double* m2, const double* mb, const double* m2b, int64_t d, double wa, double wb,
               double wm);

// Whether the float32 kernels may use AVX-512 where the CPU has it (default on; the results
// are the AVX2 kernels' bit for bit, tested by switching). Returns whether the CPU has it.
bool set_avx512_kernels(bool on);

}  // namespace acs::kernels
