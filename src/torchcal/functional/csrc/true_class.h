// The per-row arithmetic of torchcal's fused focal-family losses: plain C++17 (no torch), included by
// fused_losses.cpp. It computes exactly what the numba kernels true_class_forward / true_class_backward of
// _numba_kernels.py compute (same conventions, same float64 arithmetic per sample).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace torchcal {

enum Flag { F_UPPER, F_DUAL, F_MARGIN, F_NLL, F_CAL, F_CAL_LAMBDA, F_BRIER, N_FLAGS };
// columns of the per-sample output (N, 5) float64
enum Out { O_LOSS, O_CT, O_CJ, O_J, O_SQ, N_OUT };

// rows per parallel task: enough entries that a thread hand-off pays for itself
int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(k, 1)); }

struct Spec {
  const double* gammas;
  int64_t n_gammas;
  const double* thresholds;
  int64_t n_thresholds;
  const double* sample;  // nullptr: γ from the schedule
  bool upper, dual, margin, nll, cal;
  double cal_lambda, brier;
};

// 16-byte SIMD vectors through the GCC/Clang vector extensions (SSE2 on x86-64, NEON on arm64): the masked
// maximum below is a reduction that compilers leave scalar without -ffast-math.
template <typename T>
struct Simd;
template <>
struct Simd<float> {
  typedef float type __attribute__((vector_size(16)));
  static constexpr int width = 4;
};
template <>
struct Simd<double> {
  typedef double type __attribute__((vector_size(16)));
  static constexpr int width = 2;
};

template <typename T>
inline typename Simd<T>::type load(const T* p) {
  typename Simd<T>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline typename Simd<T>::type broadcast(T x) {
  typename Simd<T>::type v = {};
  return v + x;
}

// The runner-up of the dual focal loss: the first index of the largest entry strictly below ``below`` (ties
// with p_t excluded), −1 when there is none; no sort. A vectorised masked maximum, then a vectorised search
// for its first occurrence.
template <typename T>
int64_t runner_up(const T* row, int64_t k, T below, T floor) {
  using V = typename Simd<T>::type;
  constexpr int W = Simd<T>::width;
  const V lim = broadcast(below), low = broadcast(floor);
  V a0 = low, a1 = low;  // two accumulators: the max latency is hidden
  int64_t j = 0;
  for (; j + 2 * W <= k; j += 2 * W) {
    const V v0 = load(row + j), v1 = load(row + j + W);
    const V c0 = v0 < lim ? v0 : low;
    const V c1 = v1 < lim ? v1 : low;
    a0 = a0 < c0 ? c0 : a0;
    a1 = a1 < c1 ? c1 : a1;
  }
  a0 = a0 < a1 ? a1 : a0;
  T best = floor;
  for (int l = 0; l < W; ++l) best = best < a0[l] ? a0[l] : best;
  for (; j < k; ++j) {
    const T c = row[j] < below ? row[j] : floor;
    best = best < c ? c : best;
  }
  if (!(best > floor)) return -1;  // no entry below p_t (entries at or below the floor never count)
  const V b = broadcast(best);
  j = 0;
  for (; j + W <= k; j += W) {
    const auto hit = load(row + j) == b;
    bool any = false;
    for (int l = 0; l < W; ++l) any |= hit[l] != 0;
    if (any) break;
  }
  while (row[j] != best) ++j;  // best is an entry of the row: this stops
  return j;
}

// Per-sample loss and coefficients c = p·∂loss/∂p for rows [begin, end). Returns the number of labels
// outside [0, K) (those rows are computed on a clamped label and the caller raises).
template <typename scalar_t>
int64_t forward_rows(const scalar_t* log_p, const scalar_t* p, const int64_t* t, int64_t begin, int64_t end,
                     int64_t k, const Spec& s, double* out) {
  constexpr bool round32 = std::is_same<scalar_t, float>::value;
  const double tiny = static_cast<double>(std::numeric_limits<scalar_t>::min());
  // below every finite log-probability that log_softmax of representable logits produces
  const scalar_t floor = round32 ? static_cast<scalar_t>(-3.0e38) : static_cast<scalar_t>(-1.0e308);
  int64_t n_bad = 0;
  for (int64_t i = begin; i < end; ++i) {
    int64_t y = t[i];
    n_bad += (y < 0) | (y >= k);
    y = std::min(std::max<int64_t>(y, 0), k - 1);
    const scalar_t* row = log_p + i * k;
    const scalar_t lpt = row[y];
    const double lp = static_cast<double>(lpt);
    const double p_t = std::exp(lp);
    double p_j = 0.0;
    int64_t jj = 0;
    if (s.dual) {
      const int64_t j = runner_up(row, k, lpt, floor);
      if (j >= 0) {  // else no entry below p_t: p_j = 0
        jj = j;
        p_j = std::exp(static_cast<double>(row[j]));
      }
    }
    double g;
    if (s.sample != nullptr) {
      g = s.sample[i];
    } else {
      double sel;
      if (round32) {
        sel = s.margin ? static_cast<double>(static_cast<float>(p_t) - static_cast<float>(p_j))
                       : static_cast<double>(static_cast<float>(p_t));
      } else {
        sel = s.margin ? p_t - p_j : p_t;
      }
      int64_t b = 0;
      for (int64_t m = 0; m < s.n_thresholds; ++m) b += s.upper ? (s.thresholds[m] <= sel) : (s.thresholds[m] < sel);
      g = s.gammas[b];
      if (s.cal) g = std::exp(s.cal_lambda * (sel - g));
    }
    double loss = 0.0, c_t = 0.0, c_j = 0.0;
    if (s.nll) {
      if (g >= 0 && s.dual) {
        const double base = std::max(-std::expm1(lp) + p_j, tiny);
        const double w = std::pow(base, g);
        const double g_log = g * w * lp / base;
        loss = -w * lp;
        c_t = g_log * p_t - w;
        c_j = -g_log * p_j;
      } else if (g >= 0) {
        const double q = std::max(-std::expm1(lp), tiny);
        const double w = std::pow(q, g);
        loss = -w * lp;
        // p log p / (1 − p) → −1 as p → 1; where q is clamped (log p rounds to 0) it is 0
        c_t = w * (g * (p_t * lp / q) - 1.0);
      } else {
        const double a = -g;
        const double base = 1.0 + p_t;
        const double w = std::pow(base, a);
        loss = -w * lp;
        c_t = -a * p_t * std::pow(base, a - 1.0) * lp - w;
      }
    }
    double sq = 0.0;
    if (s.brier != 0) {
      const scalar_t* prow = p + i * k;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < k; ++j) {
        const double v = static_cast<double>(prow[j]);
        sq += v * v;
      }
      loss += s.brier * (sq - 2.0 * p_t + 1.0);
    }
    double* o = out + i * N_OUT;
    o[O_LOSS] = loss;
    o[O_CT] = c_t;
    o[O_CJ] = c_j;
    o[O_J] = static_cast<double>(jj);
    o[O_SQ] = sq;
  }
  return n_bad;
}

// grad = −(c_t + c_j)·p + c_t e_t + c_j e_j, plus λ·(2p⊙(p − Σp² + p_t) − 2p_t e_t) for the Brier term,
// each row scaled by scale[i] (or by the single scale when scale_stride is 0).
template <typename scalar_t>
void backward_rows(const scalar_t* p, const int64_t* t, const double* out, const double* scale,
                   int64_t scale_stride, double lam, int64_t begin, int64_t end, int64_t k, scalar_t* grad) {
  for (int64_t i = begin; i < end; ++i) {
    const double sc = scale[i * scale_stride];
    const double* o = out + i * N_OUT;
    const double c_t = o[O_CT] * sc;
    const double c_j = o[O_CJ] * sc;
    const int64_t j = static_cast<int64_t>(o[O_J]);
    const int64_t y = t[i];
    const scalar_t* prow = p + i * k;
    scalar_t* grow = grad + i * k;
    const double row = c_t + c_j;
    // the (N, K) pass in the input dtype (vectorised); the entries at the label and at the runner-up,
    // which get the corrections c_t e_t + c_j e_j, are recomputed in float64 (no float32 cancellation)
    const double w = 2.0 * lam * sc;
    const double a = lam != 0 ? w * (static_cast<double>(prow[y]) - o[O_SQ]) - row : -row;
    if (lam != 0) {
      const scalar_t as = static_cast<scalar_t>(a);
      const scalar_t ws = static_cast<scalar_t>(w);
#pragma omp simd
      for (int64_t m = 0; m < k; ++m) {
        const scalar_t v = prow[m];
        grow[m] = v * (as + ws * v);
      }
    } else {
      const scalar_t as = static_cast<scalar_t>(a);
#pragma omp simd
      for (int64_t m = 0; m < k; ++m) grow[m] = as * prow[m];
    }
    // entry m of the pass in float64: p_m (a + w p_m) (w = 0 without the Brier term)
    const double p_t = static_cast<double>(prow[y]);
    grow[y] = static_cast<scalar_t>(p_t * (a + w * p_t) + c_t - w * p_t);
    if (c_j != 0 && j != y) {
      const double p_j = static_cast<double>(prow[j]);
      grow[j] = static_cast<scalar_t>(p_j * (a + w * p_j) + c_j);
    }
  }
}


}  // namespace torchcal
