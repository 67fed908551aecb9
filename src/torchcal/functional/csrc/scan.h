// The metrics' top-label scan: plain C++17 (no torch), included by fused_losses.cpp. The conventions of the
// torch path (torchcal/functional/_binning.py torch_scan, classwise_sums): one
// read of each row gives the validation statistics, the top-label confidence and correctness, the
// equal-width top-label bin sums and the classwise bin sums.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "true_class.h"  // the vector helpers

namespace torchcal {

// Rows up to this long get a pass compiled for their length (scan_rows' Fixed)
constexpr int kFixedRows = 16;

// Rows up to this long are handled through a bit mask of their entries (no branch per entry: in short
// rows the outcome of a test per entry is unpredictable, and mispredictions cost more than the mask)
constexpr int64_t kMaskedRow = 32;

// The largest T not above the float64 value e: for x of type T, x > e exactly when x > below_or_at(e)
template <typename T>
inline T below_or_at(double e) {
  T f = static_cast<T>(e);
  if (static_cast<double>(f) > e) f = std::nextafter(f, -std::numeric_limits<T>::infinity());
  return f;
}

// bit j set where row[j] > value (Equal: == value), for a row of at most kMaskedRow entries: 16-byte
// vectors, then the tail entry by entry
template <bool Equal, typename T>
inline uint64_t row_mask(const T* row, int64_t k, T value) {
  using V = typename Vec<T, 16>::type;
  constexpr int W = Vec<T, 16>::width;
  const V b = broadcast<V>(value);
  uint64_t mask = 0;
  int64_t j = 0;
  for (; j + W <= k; j += W) mask |= compare_mask<T, 16, Equal>(load<V>(row + j), b) << j;
  for (; j < k; ++j) mask |= static_cast<uint64_t>(Equal ? row[j] == value : row[j] > value) << j;
  return mask;
}

// Σ v and Σ v² in float64 lanes, and the largest and smallest entry, over [j, stop) (a multiple of the
// width) of a row with Bytes-wide vectors. With Classwise (long rows), the same float64 lanes are added to
// the column totals and add(j) is called for each entry above ``edge``, found a vector at a time: at most
// M − 1 entries of a row are above the first edge 1/M, so nearly every vector of a long row is skipped
// after one test (50k x 1000 with classwise sums, one core: 97 -> 47 ms). Two vectors a step, each with its
// own accumulators: one chain of dependent sums, maxima and minima had bound the loop by their latency
// (50k x 1000 without classwise sums, one core: 25 -> 8.5 ms, the time of an amax over the rows).
template <typename T, int Bytes, bool Classwise = false, typename AddEntry = int>
inline void stats_span(const T* row, int64_t j, int64_t stop, double& s, double& sq, T& hi, T& lo,
                       double* col_total = nullptr, T edge = T(0), AddEntry add = 0) {
  if (j >= stop) return;
  using V = typename Vec<T, Bytes>::type;
  constexpr int W = Vec<T, Bytes>::width;
  constexpr int DB = W * 8;  // the same lanes in float64
  using D = typename Vec<double, DB>::type;
  V vhi[2] = {broadcast<V>(hi), broadcast<V>(hi)}, vlo[2] = {broadcast<V>(lo), broadcast<V>(lo)};
  D ds[2] = {}, dsq[2] = {};
  const auto step = [&](int64_t at, int a) __attribute__((always_inline)) {
    const V v = load<V>(row + at);
    const D d = __builtin_convertvector(v, D);
    ds[a] += d;
    dsq[a] += d * d;
    vhi[a] = Max{}(vhi[a], v);
    vlo[a] = Min{}(vlo[a], v);
    if constexpr (Classwise) {
      D total = load<D>(col_total + at);
      total += d;
      std::memcpy(col_total + at, &total, sizeof(D));
      for (uint64_t above = compare_mask<T, Bytes>(v, broadcast<V>(edge)); above != 0; above &= above - 1) {
        add(at + __builtin_ctzll(above));
      }
    }
  };
  for (; j + 2 * W <= stop; j += 2 * W) {
    step(j, 0);
    step(j + W, 1);
  }
  if (j < stop) step(j, 0);
  const auto fs = fold<double, DB>(ds[0] + ds[1], Add{}), fsq = fold<double, DB>(dsq[0] + dsq[1], Add{});
  s += fs[0] + fs[1];
  sq += fsq[0] + fsq[1];
  const auto fh = fold<T, Bytes>(Max{}(vhi[0], vhi[1]), Max{});
  const auto fl = fold<T, Bytes>(Min{}(vlo[0], vlo[1]), Min{});
  for (int l = 0; l < Vec<T, 16>::width; ++l) {
    hi = Max{}(hi, fh[l]);
    lo = Min{}(lo, fl[l]);
  }
}

// Bin of a float64 value among the float64 edges b/M: (e_b, e_{b+1}], 0 in bin 0 (as _binning); the
// product v·M gives the bin up to rounding, the exact edges settle it.
__attribute__((always_inline)) inline int64_t bin_index(double v, int64_t m, const double* edges) {
  // (clamped before the conversion: NaN and ±inf have no int64_t value; NaN lands in bin 0)
  const double u = v * static_cast<double>(m);
  int64_t b = u > 0.0 ? static_cast<int64_t>(std::min(u, static_cast<double>(m - 1))) : 0;
  while (b > 0 && v <= edges[b]) --b;
  while (b < m - 1 && v > edges[b + 1]) ++b;
  return b;
}

// Adds entry j of a row, above the first classwise edge, to its class's bin: count and p sum. Always
// inlined: a call inside the statistics' loop would keep its float64 accumulators in memory.
template <typename T>
struct ClasswiseAdd {
  const T* row;
  int64_t mc;
  const double* edges;
  double* count;
  double* psum;

  __attribute__((always_inline)) void operator()(int64_t j) const {
    const double v = static_cast<double>(row[j]);
    const int64_t b = j * mc + bin_index(v, mc, edges);
    count[b] += 1.0;
    psum[b] += v;
  }
};

// The decompositions' per-bin sums of probability vectors, float64: rows of up to kMaskedRow entries are
// added to their bin's vector one by one; longer rows are held back in blocks of kVectorBlock rows, and each
// bin's rows of a block are summed in registers a vector of columns at a time before one addition to the
// bin's vector (a row added on its own cost a read and a write of K float64 sums for K inputs: 50k x 1000,
// one core, 14 -> 8 ms). Either way each sum takes the rows in their order, float64 throughout.
constexpr int kVectorBlock = 32;

template <typename T>
struct BinVectors {
  double* vec = nullptr;  // (m, K) sums of the bins' rows, then (m, K) label counts
  int64_t k = 0, m = 0;
  int n = 0;
  const T* rows[kVectorBlock];
  int64_t bins[kVectorBlock];

  void add(const T* row, int64_t bin, int64_t y) {
    vec[(m + bin) * k + y] += 1.0;
    if (k <= kMaskedRow) {
      double* dst = vec + bin * k;
      for (int64_t j = 0; j < k; ++j) dst[j] += static_cast<double>(row[j]);
      return;
    }
    rows[n] = row;
    bins[n] = bin;
    if (++n == kVectorBlock) flush();
  }

  void flush() {
    constexpr int kBytes = std::max(16, kWideBytes * static_cast<int>(sizeof(T)) / 8);
    using V = typename Vec<T, kBytes>::type;
    constexpr int W = Vec<T, kBytes>::width;
    using D = typename Vec<double, W * 8>::type;
    const T* group[kVectorBlock];
    bool done[kVectorBlock] = {};
    for (int a = 0; a < n; ++a) {
      if (done[a]) continue;
      int g = 0;
      for (int b = a; b < n; ++b) {
        if (!done[b] && bins[b] == bins[a]) {
          group[g++] = rows[b];
          done[b] = true;
        }
      }
      double* dst = vec + bins[a] * k;
      int64_t j = 0;
      for (; j + W <= k; j += W) {
        D d = __builtin_convertvector(load<V>(group[0] + j), D);
        for (int r = 1; r < g; ++r) d += __builtin_convertvector(load<V>(group[r] + j), D);
        d += load<D>(dst + j);
        std::memcpy(dst + j, &d, sizeof(D));
      }
      for (; j < k; ++j) {
        double d = static_cast<double>(group[0][j]);
        for (int r = 1; r < g; ++r) d += static_cast<double>(group[r][j]);
        dst[j] += d;
      }
    }
    n = 0;
  }
};

// validation statistics of a part of the rows
struct ScanStats {
  double worst = 0.0;   // largest |Σ_j p_ij − 1|
  double lowest = 0.0;  // most negative entry, 0 if none
  bool nonfinite = false;
  double sum_sq = 0.0;  // Σ_ij p_ij²
  int64_t n_bad = 0;    // labels outside [0, K)
  // the per-sample sums of the streaming metrics (scan_rows' sums): Σ −log max(p_y, tiny) and Σ p_y in
  // float64, the correct predictions, the confidences at or above the threshold and those among them correct
  double nll = 0.0, p_true = 0.0;
  int64_t n_correct = 0, n_confident = 0, n_confident_correct = 0;

  void add(const ScanStats& o) {
    worst = std::max(worst, o.worst);
    lowest = std::min(lowest, o.lowest);
    nonfinite = nonfinite || o.nonfinite;
    sum_sq += o.sum_sq;
    n_bad += o.n_bad;
    nll += o.nll;
    p_true += o.p_true;
    n_correct += o.n_correct;
    n_confident += o.n_confident;
    n_confident_correct += o.n_confident_correct;
  }
};

// Rows [begin, end) of p (N, K). Writes conf[i] (the row maximum) and correct[i] (the first index of the
// maximum is the label); with m > 0 adds (count, conf sum, correct sum) of the equal-width bins to top
// (3·m); with mc > 0 adds the classwise sums to cw (3·K·mc: count, p sum, label count per class and bin)
// and the column totals to col_total (K): entries above the first edge are binned one by one, bin 0 is
// finished by the caller from the totals (most entries of a long row are in bin 0). With ``sums`` the
// ScanStats also get the per-sample sums, the confidence compared with ``threshold`` in the input dtype (as
// torch compares a tensor with a Python number) and −log p_y computed in float64 from p_y clamped below at
// the dtype's smallest normal number (the torch path's clamp; its log is taken in the input dtype). With
// ``row_bin`` (and m > 0) each row's equal-width bin is written to row_bin[i]. With ``vec`` (and m > 0) the
// row is added to its bin's K-vector of probability sums vec[bin·K + j] and 1 to its bin's label count
// vec[(m + bin)·K + y] (the decompositions' 2·m·K per-bin vector sums, float64).
// Fixed > 0: the caller guarantees k == Fixed, and every loop over a row has a compile-time length (rows of
// up to kFixedRows classes: fully unrolled, no loop overhead or tail handling per row).
template <typename scalar_t, int Fixed = 0>
ScanStats scan_rows(const scalar_t* p, const int64_t* t, int64_t begin, int64_t end, int64_t k_runtime,
                    int64_t m, const double* edges, int64_t mc, const double* cw_edges, scalar_t* conf,
                    bool* correct, double* top, double* cw, double* col_total, bool sums = false,
                    scalar_t threshold = scalar_t(1), int64_t* row_bin = nullptr, double* vec = nullptr) {
  const int64_t k = Fixed > 0 ? Fixed : k_runtime;
  ScanStats st;
  const scalar_t first_edge = below_or_at<scalar_t>(mc > 0 ? cw_edges[1] : 0.0);
  BinVectors<scalar_t> bin_vectors{vec, k, m};
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* row = p + i * k;
    int64_t y = t[i];
    st.n_bad += (y < 0) | (y >= k);
    y = std::min(std::max<int64_t>(y, 0), k - 1);
    const ClasswiseAdd<scalar_t> add{row, mc, cw_edges, cw, cw + k * mc};
    double s = 0.0, sq = 0.0;
    scalar_t hi = row[0], lo = row[0];
    {
      // wide spans of as many lanes as one float64 vector of the ISA holds (the sums are float64); long
      // rows find their classwise entries in the same pass
      constexpr int kBytes = std::max(16, kWideBytes * static_cast<int>(sizeof(scalar_t)) / 8);
      constexpr int WW = Vec<scalar_t, kBytes>::width, WN = Vec<scalar_t, 16>::width;
      const int64_t wide = k >= 2 * WW ? k - k % WW : 0;
      const int64_t narrow = wide + (k - wide) / WN * WN;
      const bool long_cw = mc > 0 && k > kMaskedRow;
      if (long_cw) {
        stats_span<scalar_t, kBytes, true>(row, 0, wide, s, sq, hi, lo, col_total, first_edge, add);
        stats_span<scalar_t, 16, true>(row, wide, narrow, s, sq, hi, lo, col_total, first_edge, add);
      } else {
        stats_span<scalar_t, kBytes>(row, 0, wide, s, sq, hi, lo);
        stats_span<scalar_t, 16>(row, wide, narrow, s, sq, hi, lo);
      }
      for (int64_t j = narrow; j < k; ++j) {
        const scalar_t x = row[j];
        const double v = static_cast<double>(x);
        s += v;
        sq += v * v;
        hi = hi < x ? x : hi;
        lo = x < lo ? x : lo;
        if (long_cw) {
          col_total[j] += v;
          if (x > first_edge) add(j);
        }
      }
    }
    st.sum_sq += sq;
    if (!std::isfinite(s)) st.nonfinite = true;
    st.worst = std::max(st.worst, std::abs(s - 1.0));
    if (lo < 0) st.lowest = std::min(st.lowest, static_cast<double>(lo));
    // the prediction is the first index of the maximum: in a short row the lowest set bit of the entries
    // equal to it (p_y is the maximum in about half the rows); in a long row the label is predicted when
    // p_y is the maximum and no earlier entry holds it (a vectorised search of [0, y))
    bool hit;
    if (k <= kMaskedRow) {
      const uint64_t at_max = row_mask<true>(row, k, hi);
      hit = __builtin_ctzll(at_max | (uint64_t{1} << k)) == y;  // (no entry equal to a NaN maximum: k)
    } else if ((hit = row[y] == hi) && y > 0) {
      constexpr int WN = Vec<scalar_t, 16>::width;
      const int64_t whole = y - y % WN;
      int64_t j = first_vector_with<scalar_t, 16>(row, 0, whole, hi);
      while (j < y && row[j] != hi) ++j;
      hit = j == y;
    }
    conf[i] = hi;
    correct[i] = hit;
    if (sums) {
      const double pt = static_cast<double>(row[y]);
      constexpr double kTiny = static_cast<double>(std::numeric_limits<scalar_t>::min());
      st.nll -= std::log(pt > kTiny ? pt : kTiny);  // (NaN: the input is rejected)
      st.p_true += pt;
      st.n_correct += hit;
      const bool confident = hi >= threshold;
      st.n_confident += confident;
      st.n_confident_correct += confident && hit;
    }
    if (m > 0) {
      const double c = static_cast<double>(hi);
      const int64_t bin = bin_index(c, m, edges);
      if (row_bin != nullptr) row_bin[i] = bin;
      if (vec != nullptr) bin_vectors.add(row, bin, y);
      double* b = top + bin;
      b[0] += 1.0;
      b[m] += c;
      b[2 * m] += hit;
    }
    if (mc > 0) {
      double* labels = cw + 2 * k * mc;
      if (k <= kMaskedRow) {  // about a fifth of a 10-class row is above the edge (1M x 10: 80 -> 67 ms)
#pragma omp simd
        for (int64_t j = 0; j < k; ++j) col_total[j] += static_cast<double>(row[j]);
        for (uint64_t above = row_mask<false>(row, k, first_edge); above != 0; above &= above - 1) {
          add(__builtin_ctzll(above));
        }
      }  // (long rows: in the statistics' pass)
      labels[y * mc + bin_index(static_cast<double>(row[y]), mc, cw_edges)] += 1.0;
    }
  }
  if (vec != nullptr) bin_vectors.flush();
  return st;
}

}  // namespace torchcal
