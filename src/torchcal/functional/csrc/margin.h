// The per-row arithmetic of torchcal's fused margin losses (torchcal/functional/margin.py): cross entropy
// plus a row-wise penalty on the logits, value and gradient. Plain C++17 (no torch), included by
// fused_losses.cpp after true_class.h (whose vectorised max and exp it uses for float32 rows).
//
// A row's forward reads it twice (max, then exp(x − max) with the penalty) and keeps per-row statistics
// (N_STAT float64); the backward reads it again, writes exp(x − max) into the gradient row and turns it into
// the gradient in a second pass over that row (in cache). No (N, K) array is kept between the two, except
// the confidence penalty's f'(p) on the eager path (keep_df: its logs and division are not repeated).

#pragma once

#include "true_class.h"

#include <type_traits>

namespace torchcal {

// the losses (the `kind` argument of the operator); CALS and Poly-1 take per-class numbers (class_params)
enum MarginKind { M_MBLS = 0, M_MAXSUP = 1, M_ACLS = 2, M_CP = 3, M_CALS = 4, M_POLY1 = 5 };
// columns of the per-row statistics (M, N_STAT) float64: cross entropy, penalty, row max, 1 / Σ exp(x − max),
// the first index of the max, and the penalty's own number (MbLS: active hinges; ACLS: tied maxima; the
// confidence penalty: Σ_k p_k f'(p_k), see margin_forward_row; CALS: Σ_k r_k; Poly-1: p_y)
enum MarginStat { S_CE, S_PEN, S_MAX, S_INV, S_ARG, S_AUX, N_STAT };

// params of the operator: [coef, then per kind] MbLS [margin]; MaxSup []; ACLS [margin, λ_pos, λ_neg];
// confidence penalty [eps, form (0 sample, 1 the MbLS repository's)]; CALS [s, λ_min, λ_max, margin]; Poly-1 []
// (coef = ε). class_params (the logits' dtype): CALS (4, K) rows a, b, w, c (see cals_row); Poly-1 the
// class weights (K) or none.
struct MarginSpec {
  int64_t kind;
  double coef, margin, lam_pos, lam_neg, eps;
  bool mbls_form;
  const void* cls = nullptr;  // class_params' data, or null
  double scale = 1.0, lo = 0.0, hi = 0.0, offset = 0.0;  // CALS: s, the statistics' clamp, Σ_k c_k
};

inline float max_of(const float* x, int64_t k) { return row_max(x, k); }
inline double max_of(const double* x, int64_t k) {
  double m = x[0];
  for (int64_t j = 1; j < k; ++j) m = m < x[j] ? x[j] : m;
  return m;
}

// e_j = exp(x_j − m) into e (unless null), returns Σ e_j (float64); float32 rows: exp_row below
inline double exp_row(const double* x, int64_t k, double m, double* e) {
  double s = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const double v = std::exp(x[j] - m);
    if (e != nullptr) e[j] = v;
    s += v;
  }
  return s;
}

// the first index holding v (the max: torch's max(dim) returns the first on CPU); k − 1 when none equals it
template <typename T>
inline int64_t first_index_of(const T* x, int64_t k, T v) {
  constexpr int WW = Vec<T, kWideBytes>::width, WN = Vec<T, 16>::width;
  int64_t j = first_vector_with<T, kWideBytes>(x, 0, k - k % WW, v);
  if (j == k - k % WW) j = first_vector_with<T, 16>(x, j, j + (k - j) / WN * WN, v);
  j = std::min(j, k - 1);  // (the vector searches end at k when the row's width is theirs and none matched)
  while (j < k - 1 && !(x[j] == v)) ++j;
  return j;
}

// log x for positive normal float32 lanes (Cephes' logf: x = 2^e·f with f in [√½, √2), a degree-8
// polynomial in f − 1, ~1 ulp). The confidence penalty takes logs of p + eps >= 1e-6 and of p clamped to
// >= 1e-10 only: never zero, negative or subnormal.
template <int Bytes>
inline typename Vec<float, Bytes>::type log_positive(typename Vec<float, Bytes>::type x) {
  using V = typename Vec<float, Bytes>::type;
  using I = typename Vec<float, Bytes>::int32;
  I bits;
  std::memcpy(&bits, &x, sizeof(bits));
  I e = ((bits >> 23) & 0xff) - 126;
  bits = (bits & 0x007fffff) | 0x3f000000;
  V f;
  std::memcpy(&f, &bits, sizeof(f));  // in [0.5, 1)
  const I small = f < 0.707106781186547524f;
  e = small ? e - 1 : e;
  f = small ? f + f - 1.0f : f - 1.0f;
  const V z = f * f;
  V y = broadcast<V>(7.0376836292e-2f);
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  const V ef = __builtin_convertvector(e, V);
  y = y + ef * -2.12194440e-4f;
  y = y - 0.5f * z;
  return (f + y) + ef * 0.693359375f;
}

// lanes of a row: float32 vectors of Bytes bytes, or one scalar (Bytes 0)
template <typename T, int Bytes>
struct Lanes {
  using type = typename Vec<T, Bytes>::type;
};
template <typename T>
struct Lanes<T, 0> {
  using type = T;
};

template <typename V>
inline V lanes_log(V x) {
  if constexpr (std::is_floating_point<V>::value) {
    return std::log(x);
  } else {
    return log_positive<sizeof(V)>(x);
  }
}

template <typename V, typename T>
inline V lanes_load(const T* p) {
  if constexpr (std::is_floating_point<V>::value) {
    return *p;
  } else {
    return load<V>(p);
  }
}

template <typename V, typename T>
inline void lanes_store(T* p, V v) {
  if constexpr (std::is_floating_point<V>::value) {
    *p = v;
  } else {
    store(p, v);
  }
}

// Σ of the lanes in fold's order (halves added down to 4 lanes, those in float64), from lane subscripts:
// fold's memcpy of halves made the caller's accumulator addressable, kept on the stack through its loop
template <typename V>
__attribute__((always_inline)) inline double lanes_sum(V v) {
  if constexpr (std::is_floating_point<V>::value) {
    return static_cast<double>(v);
  } else {
    constexpr int n = sizeof(V) / sizeof(float);
    static_assert(n == 4 || n == 8 || n == 16, "float32 lanes of 16, 32 or 64 bytes");
    float a[4];
    for (int i = 0; i < 4; ++i) {
      if constexpr (n == 16) {
        a[i] = (v[i] + v[i + 8]) + (v[i + 4] + v[i + 12]);
      } else if constexpr (n == 8) {
        a[i] = v[i] + v[i + 4];
      } else {
        a[i] = v[i];
      }
    }
    return (static_cast<double>(a[0]) + a[1]) + (static_cast<double>(a[2]) + a[3]);
  }
}

// fn(j, lanes tag) over a row of k entries: float32 rows on wide vectors (rows of >= 4 of them), 16-byte
// vectors, then scalars; float64 rows on scalars (the tag's value is the lanes' byte count, 0 for a scalar)
template <typename T, typename Fn>
__attribute__((always_inline)) inline void walk_row(int64_t k, const Fn& fn) {
  int64_t j = 0;
  if constexpr (std::is_same<T, float>::value) {
    constexpr int WW = Vec<float, kWideBytes>::width, WN = Vec<float, 16>::width;
    const int64_t wide = k >= 4 * WW ? k - k % WW : 0;
    const int64_t narrow = wide + (k - wide) / WN * WN;
    for (; j < wide; j += WW) fn(j, std::integral_constant<int, kWideBytes>{});
    for (; j < narrow; j += WN) fn(j, std::integral_constant<int, 16>{});
  }
  for (; j < k; ++j) fn(j, std::integral_constant<int, 0>{});
}

// Σ over a row of two per-entry terms: fn(j, lanes tag, a, b) sets the lanes a and b of entries j, ...;
// float32 rows add them in float32 lanes over blocks of 256 entries and the blocks in float64 (as
// exp_sum_row's Σ exp: no float64 conversion chain per vector), float64 rows entry by entry.
template <typename T, typename Fn>
__attribute__((always_inline)) inline void sum2_row(int64_t k, const Fn& fn, double& sa, double& sb) {
  int64_t j = 0;
  if constexpr (std::is_same<T, float>::value) {
    constexpr int WW = Vec<float, kWideBytes>::width, WN = Vec<float, 16>::width;
    const int64_t wide = k >= 4 * WW ? k - k % WW : 0;
    const int64_t narrow = wide + (k - wide) / WN * WN;
    while (j < wide) {
      using V = typename Vec<float, kWideBytes>::type;
      V a = {}, b = {};
      for (const int64_t stop = std::min<int64_t>(wide, j + 256); j < stop; j += WW) {
        V fa, fb;
        fn(j, std::integral_constant<int, kWideBytes>{}, fa, fb);
        a += fa;
        b += fb;
      }
      sa += lanes_sum(a);
      sb += lanes_sum(b);
    }
    if (j < narrow) {  // (at most 3 vectors: one block)
      using V = typename Vec<float, 16>::type;
      V a = {}, b = {};
      for (; j < narrow; j += WN) {
        V fa, fb;
        fn(j, std::integral_constant<int, 16>{}, fa, fb);
        a += fa;
        b += fb;
      }
      sa += lanes_sum(a);
      sb += lanes_sum(b);
    }
  }
  for (; j < k; ++j) {
    T fa, fb;
    fn(j, std::integral_constant<int, 0>{}, fa, fb);
    sa += static_cast<double>(fa);
    sb += static_cast<double>(fb);
  }
}

// e_j = exp(x_j − m) into e (unless null), returns Σ e_j: the lanes, blocks and sums of the focal family's
// exp_sum_row (the same numbers), with the lane accumulators held in registers (exp_sum_row's, inlined
// here, lived on the stack: a store and a load per vector on the sum's dependency chain)
template <bool Store>
inline double exp_row_lanes(const float* x, int64_t k, float m, float* e) {
  double sum = 0.0, unused = 0.0;
  sum2_row<float>(k, [&](int64_t j, auto tag, auto& v, auto& zero) {
    using V = typename Lanes<float, decltype(tag)::value>::type;
    if constexpr (std::is_floating_point<V>::value) {
      v = std::exp(x[j] - m);
    } else {
      v = exp_nonpositive<sizeof(V)>(lanes_load<V>(x + j) - m);
    }
    zero = V{};
    if constexpr (Store) lanes_store(e + j, v);
  }, sum, unused);
  return sum;
}

inline double exp_row(const float* x, int64_t k, float m, float* e) {
  return e == nullptr ? exp_row_lanes<false>(x, k, m, e) : exp_row_lanes<true>(x, k, m, e);
}

// The confidence penalty's forms (template arguments of its row loops: no per-vector branch on the form)
enum CpForm { CP_EPS = 0, CP_EXACT = 1, CP_MBLS = 2 };

inline int cp_form(const MarginSpec& s) { return s.mbls_form ? CP_MBLS : s.eps == 0 ? CP_EXACT : CP_EPS; }

// Calls run(std::integral_constant<int, form>) for the spec's form
template <typename Run>
inline void with_cp_form(const MarginSpec& s, const Run& run) {
  switch (cp_form(s)) {
    case CP_MBLS:
      run(std::integral_constant<int, CP_MBLS>{});
      break;
    case CP_EXACT:
      run(std::integral_constant<int, CP_EXACT>{});
      break;
    default:
      run(std::integral_constant<int, CP_EPS>{});
  }
}

// The confidence penalty's per-entry terms of probability p: f(p) (its contribution to the penalty's sum)
// and f'(p), in the input dtype as the torch path. Sample form f(p) = p log(p + eps) (p log p, from log p,
// when eps = 0: log_p is read only then); the MbLS form f(p) = p̃ log p̃ with p̃ = clamp(p, 1e-10, 1 − 1e-10)
// (the bounds rounded to the dtype: 1 in float32), f' = log p̃ + 1 inside the clamp's range and 0 outside.
template <typename T, int Form, typename V>
inline void cp_lanes(V p, V log_p, double eps, V& f, V& df) {
  const V one = broadcast<V>(T(1));
  if constexpr (Form == CP_MBLS) {
    const V lo = broadcast<V>(static_cast<T>(1e-10)), hi = broadcast<V>(static_cast<T>(1 - 1e-10));
    V pc = p < lo ? lo : p;
    pc = pc > hi ? hi : pc;
    const V l = lanes_log(pc);
    const V zero = {};
    f = pc * l;
    df = ((p >= lo) & (p <= hi)) ? l + one : zero;
  } else if constexpr (Form == CP_EXACT) {
    f = p * log_p;
    df = log_p + one;
  } else {
    const V q = p + static_cast<T>(eps);
    const V l = lanes_log(q);
    f = p * l;
    df = l + p / q;
  }
}

// CALS's PHR penalty on one row of max m: r_k = relu(a_k (m − x_k) + b_k) in the dtype (a = ρ/s, b = λ − ρm/s,
// as _TopGapPenalty), pen = Σ_k w_k r_k² − Σ_k c_k (w = 1/(2ρK), c = λ²w: s.offset) and aux = Σ_k r_k (the
// arg-max entry's gradient), sums in float64. With sums (a kept row): sums[k'] += clamp(r_k, λ_min, λ_max)
// (clamped in the dtype) and sums[K + k'] += m − x_k, both in the dtype: the training statistics of
// cals_statistics, which the caller adds over a group of rows in the dtype and the groups in float64
// (margin_forward's CalsGroups).
template <typename T, bool WithSums>
inline void cals_lanes(const T* x, int64_t k, T m, const MarginSpec& s, T* sums, double& acc, double& total) {
  const T* a = static_cast<const T*>(s.cls);
  const T* b = a + k;
  const T* w = b + k;
  const T lo = static_cast<T>(s.lo), hi = static_cast<T>(s.hi);
  sum2_row<T>(k, [&](int64_t j, auto tag, auto& sq, auto& rr) {
    using V = typename Lanes<T, decltype(tag)::value>::type;
    const V zero = {};
    const V v = lanes_load<V>(x + j);
    V r = (m - v) * lanes_load<V>(a + j) + lanes_load<V>(b + j);
    r = r > zero ? r : zero;
    sq = r * r * lanes_load<V>(w + j);
    rr = r;
    if constexpr (WithSums) {
      V c = r < lo ? broadcast<V>(lo) : r;
      c = c > hi ? broadcast<V>(hi) : c;
      lanes_store(sums + j, lanes_load<V>(sums + j) + c);
      lanes_store(sums + k + j, lanes_load<V>(sums + k + j) + (m - v));
    }
  }, acc, total);
}

template <typename T>
inline void cals_row(const T* x, int64_t k, T m, const MarginSpec& s, T* sums, double& pen, double& aux) {
  double acc = 0.0, total = 0.0;
  if (sums == nullptr) {
    cals_lanes<T, false>(x, k, m, s, sums, acc, total);
  } else {
    cals_lanes<T, true>(x, k, m, s, sums, acc, total);
  }
  pen = acc - s.offset;
  aux = total;
}

// One row's statistics o[0..N_STAT): y is the label, or −1 for a row without one (ignored: no cross
// entropy). The penalty is computed in the input dtype where the torch path does (the hinge's threshold
// max − m, the distances, the clamp), its sums in float64. sums: CALS's per-class statistics of a kept row
// (cals_row), or null.
// keep_e: where the row's exps are written for the backward (the whole-loss node, decision 220; then also the
// confidence penalty's scratch) or null.
template <typename T>
inline void margin_forward_row(const T* x, int64_t k, int64_t y, const MarginSpec& s, T* scratch, double* o,
                               T* sums = nullptr, T* keep_df = nullptr, T* keep_e = nullptr) {
  const T m = max_of(x, k);
  const bool cp = s.kind == M_CP;
  if (keep_e != nullptr) scratch = keep_e;
  const double sum = exp_row(x, k, m, cp || keep_e != nullptr ? scratch : nullptr);
  const double log_sum = std::log(sum);
  o[S_CE] = y >= 0 ? (static_cast<double>(m) - static_cast<double>(x[y])) + log_sum : 0.0;
  o[S_MAX] = static_cast<double>(m);
  o[S_INV] = 1.0 / sum;
  const int64_t arg = first_index_of(x, k, m);
  o[S_ARG] = static_cast<double>(arg);
  double pen = 0.0, aux = 0.0;
  // (the hinges are branch-free lane selects: a branch on a random sign mispredicts every other entry)
  if (s.kind == M_MBLS) {
    const T thr = m + static_cast<T>(-s.margin);
    double acc = 0.0, active = 0.0;  // (sum2_row: lanes added over blocks, one horizontal sum per block)
    sum2_row<T>(k, [&](int64_t j, auto tag, auto& a, auto& b) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V zero = {}, one = broadcast<V>(T(1));
      const V r = thr - lanes_load<V>(x + j);
      a = r > zero ? r : zero;
      b = r > zero ? one : zero;
    }, acc, active);
    pen = acc / static_cast<double>(k);
    aux = active;
  } else if (s.kind == M_MAXSUP) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < k; ++j) acc += static_cast<double>(x[j]);
    pen = static_cast<double>(m) - acc / static_cast<double>(k);
  } else if (s.kind == M_ACLS) {
    const T thr = m + static_cast<T>(-s.margin);
    double acc = 0.0, ties = 0.0;
    sum2_row<T>(k, [&](int64_t j, auto tag, auto& a, auto& b) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V zero = {}, one = broadcast<V>(T(1));
      const V v = lanes_load<V>(x + j);
      const V r = thr - v;
      const V h = r > zero ? r : zero;
      a = h * h;
      b = v == m ? one : zero;
    }, acc, ties);
    const T h = m + static_cast<T>(-s.margin);
    const double hd = h > 0 ? static_cast<double>(h) : 0.0;
    pen = s.lam_pos * ties * hd * hd + s.lam_neg * acc / static_cast<double>(k - 1);
    aux = ties;
  } else if (s.kind == M_CALS) {
    cals_row(x, k, m, s, sums, pen, aux);
  } else if (s.kind == M_POLY1) {  // ε(1 − p_y) (coef = ε): 1 − p_y = −expm1(log p_y), as the torch path
    pen = y >= 0 ? -std::expm1(-o[S_CE]) : 0.0;
    aux = y >= 0 ? std::exp(-o[S_CE]) : 0.0;
  } else {  // M_CP: p = exp(x − m) / Σ (scratch holds exp(x − m)), log p = (x − m) − log Σ
    const T lse = static_cast<T>(log_sum), inv = static_cast<T>(1.0 / sum);
    double acc = 0.0, acc_d = 0.0;
    with_cp_form(s, [&](auto form) {
      sum2_row<T>(k, [&](int64_t j, auto tag, auto& f, auto& pdf) {
        using V = typename Lanes<T, decltype(tag)::value>::type;
        const V p = lanes_load<V>(scratch + j) * inv;
        V log_p = {};
        if constexpr (decltype(form)::value == CP_EXACT) log_p = (lanes_load<V>(x + j) - m) - lse;
        V df;
        cp_lanes<T, decltype(form)::value>(p, log_p, s.eps, f, df);
        pdf = p * df;
        if (keep_df != nullptr) lanes_store(keep_df + j, df);
      }, acc, acc_d);
    });
    pen = s.mbls_form ? acc / static_cast<double>(k) : std::log(static_cast<double>(k)) + acc;
    aux = s.mbls_form ? acc_d / static_cast<double>(k) : acc_d;
  }
  o[S_PEN] = pen;
  o[S_AUX] = aux;
}

// The penalty's gradient on entry j, float64, without the max's own share (added at the arg-max entry)
template <typename T>
inline double penalty_entry(const T* x, int64_t k, int64_t j, const MarginSpec& s, const double* o, double gpen) {
  const T m = static_cast<T>(o[S_MAX]);
  if (s.kind == M_MBLS) {
    const T r = (m + static_cast<T>(-s.margin)) - x[j];
    return r > 0 ? -gpen / static_cast<double>(k) : 0.0;
  }
  if (s.kind == M_MAXSUP) return -gpen / static_cast<double>(k);
  if (s.kind == M_ACLS) {
    const T r = (m + static_cast<T>(-s.margin)) - x[j];
    return r > 0 ? -gpen * s.lam_neg * 2.0 * static_cast<double>(r) / static_cast<double>(k - 1) : 0.0;
  }
  if (s.kind == M_CALS) {
    const T* a = static_cast<const T*>(s.cls);
    T r = (m - x[j]) * a[j] + a[k + j];
    r = r > T(0) ? r : T(0);
    return -gpen * static_cast<double>(r) / (static_cast<double>(k) * s.scale);
  }
  return 0.0;
}

// The max's share of the penalty's gradient (on the arg-max entry)
inline double penalty_top(int64_t k, const MarginSpec& s, const double* o, double gpen) {
  if (s.kind == M_MBLS) return gpen * o[S_AUX] / static_cast<double>(k);
  if (s.kind == M_MAXSUP) return gpen;
  if (s.kind == M_ACLS) {
    const double h = o[S_MAX] - s.margin;
    return h > 0 ? gpen * s.lam_pos * o[S_AUX] * 2.0 * h : 0.0;
  }
  if (s.kind == M_CALS) return gpen * o[S_AUX] / (static_cast<double>(k) * s.scale);
  return 0.0;
}

// One row's gradient into g: gce·(p − onehot(y)) + the penalty's, with gce and gpen the row's incoming
// gradients of the cross entropy and of the penalty (the latter times coef). The (K,) pass runs in the input
// dtype (vectorised); the label and arg-max entries are recomputed in float64.
// kept_e: the forward's exps of the row (keep_e; then no exp is taken here) or null
template <typename T>
inline void margin_backward_row(const T* x, int64_t k, int64_t y, const MarginSpec& s, const double* o, double gce,
                                double gpen, T* g, const T* kept_df = nullptr, const T* kept_e = nullptr) {
  const T m = static_cast<T>(o[S_MAX]);
  const double inv = o[S_INV];
  const int64_t arg = static_cast<int64_t>(o[S_ARG]);
  if (kept_e == nullptr) exp_row(x, k, m, g);
  const T* ev = kept_e != nullptr ? kept_e : g;  // exp(x − m)
  if (s.kind == M_CP) {
    // p_j (gce + gpen (f'(p_j) − Σ_k p_k f'(p_k))) (MbLS form: f'/K); the sample form's +1 in f' cancels
    // against Σ p_k = 1. g holds exp(x − m): p = g / Σ.
    const T lse = static_cast<T>(std::log(1.0 / inv)), pinv = static_cast<T>(inv);
    const T scale = static_cast<T>(s.mbls_form ? gpen / static_cast<double>(k) : gpen);
    const T base = static_cast<T>(gce - gpen * o[S_AUX]);
    with_cp_form(s, [&](auto form) {
      constexpr int F = decltype(form)::value;
      walk_row<T>(k, [&](int64_t j, auto tag) {
        using V = typename Lanes<T, decltype(tag)::value>::type;
        const V p = lanes_load<V>(ev + j) * pinv;
        V f, df;
        if (kept_df != nullptr) {  // f'(p) kept by the forward: no log or division here
          df = lanes_load<V>(kept_df + j);
        } else {
          V log_p = {};
          if constexpr (F == CP_EXACT) log_p = (lanes_load<V>(x + j) - m) - lse;
          cp_lanes<T, F>(p, log_p, s.eps, f, df);
        }
        lanes_store(g + j, p * (base + scale * df));
      });
      if (y >= 0) {  // the label entry in float64: p_y (gce + ...) − gce cancels
        const T py = static_cast<T>(std::exp(static_cast<double>(x[y]) - static_cast<double>(m)) * inv);
        T f, df;
        cp_lanes<T, F>(py, static_cast<T>((x[y] - m) - lse), s.eps, f, df);
        g[y] = static_cast<T>(static_cast<double>(py) * (gce - gpen * o[S_AUX] + static_cast<double>(scale) * df) -
                              gce);
      }
    });
    return;
  }
  if (s.kind == M_POLY1) {
    // ε(1 − p_y)'s gradient is −ε p_y (onehot − p): the row's is (gce + gpen p_y)(p − onehot(y)), gpen = ε·g
    const double c = gce + gpen * o[S_AUX];
    const T a = static_cast<T>(c * inv);
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) g[j] = a * ev[j];
    if (y >= 0) g[y] = static_cast<T>(c * (std::exp(static_cast<double>(x[y]) - static_cast<double>(m)) * inv - 1.0));
    return;
  }
  const T a = static_cast<T>(gce * inv);
  if (s.kind == M_MBLS) {
    const T thr = m + static_cast<T>(-s.margin), c = static_cast<T>(gpen / static_cast<double>(k));
    walk_row<T>(k, [&](int64_t j, auto tag) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V zero = {}, cv = broadcast<V>(c);
      const V r = thr - lanes_load<V>(x + j);
      lanes_store(g + j, a * lanes_load<V>(ev + j) - (r > zero ? cv : zero));
    });
  } else if (s.kind == M_MAXSUP) {
    const T c = static_cast<T>(gpen / static_cast<double>(k));
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) g[j] = a * ev[j] - c;
  } else if (s.kind == M_CALS) {
    const T* ca = static_cast<const T*>(s.cls);
    const T* cb = ca + k;
    const T c = static_cast<T>(gpen / (static_cast<double>(k) * s.scale));
    walk_row<T>(k, [&](int64_t j, auto tag) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V zero = {};
      V r = (m - lanes_load<V>(x + j)) * lanes_load<V>(ca + j) + lanes_load<V>(cb + j);
      r = r > zero ? r : zero;
      lanes_store(g + j, a * lanes_load<V>(ev + j) - c * r);
    });
  } else {  // M_ACLS
    const T thr = m + static_cast<T>(-s.margin);
    const T c = static_cast<T>(gpen * s.lam_neg * 2.0 / static_cast<double>(k - 1));
    walk_row<T>(k, [&](int64_t j, auto tag) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V zero = {};
      const V r = thr - lanes_load<V>(x + j);
      lanes_store(g + j, a * lanes_load<V>(ev + j) - c * (r > zero ? r : zero));
    });
  }
  const auto entry = [&](int64_t j) {
    const double p = std::exp(static_cast<double>(x[j]) - static_cast<double>(m)) * inv;
    double v = gce * (p - (j == y ? 1.0 : 0.0)) + penalty_entry(x, k, j, s, o, gpen);
    if (j == arg) v += penalty_top(k, s, o, gpen);
    return static_cast<T>(v);
  };
  if (y >= 0) g[y] = entry(y);
  if (arg != y) g[arg] = entry(arg);
}

}  // namespace torchcal
