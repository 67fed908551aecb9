// The per-row arithmetic of torchcal's fused batch-term losses (torchcal/functional/margin.py: MDCA with its
// three bases, DCA, SB-ECE, AvUC, S-AvUC, ESD). Plain C++17 (no torch), included by fused_losses.cpp after
// margin.h, whose vectorised row helpers (max, exp, first index, log, lanes) it uses.
//
// Each of these losses is a per-row base loss plus a term of the batch that depends on the rows only through
// a few per-row numbers: the top-label confidence r = max_k p_k = 1 / Σ exp(x − max), the correctness a
// (arg-max == label, a constant), an entropy H of p and, for MDCA, the column sums Σ_i kept_i p_i (K). The
// forward computes those per row (the batch term itself is left to torch, on (M,) vectors); the backward
// takes their gradients and writes the logits' gradient in one read of the row (exp into the gradient row,
// then a second pass over it in cache), from the logits and O(1) saved numbers per row.
//
// With p = softmax(x) and l_y = log p_y, the gradient of row i is
//   g_base ∂base/∂x + g_r r (e_arg − p) + g_H p ⊙ (S − f') + p ⊙ (c − <c, p>)
// where −f'_j = ∂H/∂p_j, S = Σ_j p_j f'_j, c the (K) gradient of the column sums (kept rows only), and
// ∂base/∂x = d(base)/d(l_y)·(e_y − p) (NLL: −1, focal: see batch_forward_row), or p − q for the MDCA
// repository's label smoothing (q: 1 − α on the label, α/(K − 1) elsewhere).

#pragma once

#include "margin.h"
#include "sort.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace torchcal {

// the base loss (the `base` argument of the operator) and the entropy asked for (`entropy`)
enum BatchBase { BB_NLL = 0, BB_FOCAL = 1, BB_LS = 2 };
enum BatchEntropy { BE_NONE = 0, BE_AVUC = 1, BE_SMOOTH = 2 };
// columns of the saved per-row statistics (M, N_BSTAT) float64: the row max, 1 / Σ exp(x − max), the first
// index of the max, d(base)/d(log p_y) (focal), S = Σ_j p_j f'_j (entropy)
enum BatchStat { BS_MAX, BS_INV, BS_ARG, BS_DBASE, BS_DENT, N_BSTAT };
// columns of the per-row outputs, before they are written to the (M,) tensors: base, r, a, H
enum BatchOut { BO_BASE, BO_R, BO_CORRECT, BO_H, N_BOUT };

struct BatchSpec {
  int64_t base;
  double gamma, alpha;
  int64_t entropy;
};

// The entropy's per-entry terms of probability p, in the input dtype as the torch path: f, with H = −Σ f, and
// f' = −∂H/∂p. AvUC (the released AvULoss): f = p log(p + 1e-10), f' = log(p + 1e-10) + p / (p + 1e-10).
// S-AvUC: s = (1 − 1e-5) p + 1e-5/K, f = s log s (so H is the entropy of s, each term counted once per
// class), f' = (1 − 1e-5) log s (its constant (1 − 1e-5) dropped: Σ_j p_j (S − f'_j) leaves it out exactly).
// The logs take arguments >= 1e-10 (AvUC) and >= 1e-5/K (S-AvUC): positive and normal in float32.
// float32 AvUC takes no log per entry (decision 221): from lp = log p = x − max − lse (the row's log-sum-exp),
// f = p·max(lp, log 1e-10) and f' = max(lp, log 1e-10) + 1. Against the released form each differs by at most
// 2e-10 once multiplied by p (as f' always is: S = Σ p f', the gradient p (… − g_H f')), over the row at most
// K·2e-10: below float32's resolution of every sum and gradient entry it enters. (log(p + 1e-10) − log p <=
// 1e-10/p, 1 − p/(p + 1e-10) <= 1e-10/p, and below p = 1e-10 both forms are within 2 of each other.)
// (flattened: margin.h's log_positive is otherwise called out of line, spilling the vector registers)
constexpr float kAvucLogFloor = -23.025850929940457f;  // log 1e-10

template <typename T, typename V>
__attribute__((flatten)) inline void entropy_lanes(V p, V lp, int64_t entropy, T smooth_a, T smooth_b, V& f, V& df) {
  if (std::is_same<T, float>::value && entropy == BE_AVUC) {
    const V floor = V{} + kAvucLogFloor;
    const V l = lp > floor ? lp : floor;
    f = p * l;
    df = l + static_cast<T>(1);
  } else if (entropy == BE_AVUC) {
    const V q = p + static_cast<T>(1e-10);
    const V l = lanes_log(q);
    f = p * l;
    df = l + p / q;
  } else {
    const V s = p * smooth_a + smooth_b;
    const V l = lanes_log(s);
    f = s * l;
    df = l * smooth_a;
  }
}

// float32 AvUC's exp pass: the exps into e and Σ e_j as exp_row (the same numbers), with e1 = Σ e_j (x_j − m)
// and lo = min_j (x_j − m) from the same pass. Where lo − lse stays above AvUC's log floor no entry is
// clamped, and then H = lse − e1/Σ and S = Σ_j p_j f'_j = 1 − H, with no second pass over the row.
inline double exp_row_moment(const float* x, int64_t k, float m, float* e, double& e1, float& lo) {
  using VW = Vec<float, kWideBytes>::type;
  using VN = Vec<float, 16>::type;
  VW low = {};  // (x − m <= 0 everywhere: 0 is above every entry but the max's)
  VN low_n = {};
  float low_s = 0.0f;
  double sum = 0.0;
  e1 = 0.0;
  sum2_row<float>(k, [&](int64_t j, auto tag, auto& v, auto& w) {
    using V = typename Lanes<float, decltype(tag)::value>::type;
    if constexpr (std::is_floating_point<V>::value) {
      const float d = x[j] - m;
      v = std::exp(d);
      w = v * d;
      low_s = d < low_s ? d : low_s;
    } else {
      const V d = lanes_load<V>(x + j) - m;
      v = exp_nonpositive<sizeof(V)>(d);
      w = v * d;
      if constexpr (sizeof(V) == kWideBytes) {
        low = d < low ? d : low;
      } else {
        low_n = d < low_n ? d : low_n;
      }
    }
    lanes_store(e + j, v);
  }, sum, e1);
  lo = low_s;
  for (int t = 0; t < static_cast<int>(sizeof(VW) / sizeof(float)); ++t) lo = low[t] < lo ? low[t] : lo;
  for (int t = 0; t < static_cast<int>(sizeof(VN) / sizeof(float)); ++t) lo = low_n[t] < lo ? low_n[t] : lo;
  return sum;
}

// The focal base −u^γ l (u = 1 − p_y >= 0, l = log p_y) and d/dl = γ u^(γ−1) p_y l − u^γ (no first term at
// γ = 0). Where u = 0 (p_y = 1 to the dtype) the first term is its limit, 0 (−γ u^γ as l ~ −u), not
// pow_g(0, γ − 1) = inf times l = 0 (0 < γ < 1).
inline void focal_base(double u, double p_y, double l, double gamma, double& base, double& dbase) {
  const double w = pow_g(u, gamma);
  base = -w * l;
  dbase = (gamma == 0.0 || u == 0.0 ? 0.0 : gamma * pow_g(u, gamma - 1.0) * p_y * l) - w;
}

// The smoothing's constants in the input dtype (the torch path multiplies a float32 tensor by Python floats)
template <typename T>
inline void smoothing_constants(int64_t k, T& a, T& b) {
  a = static_cast<T>(1 - 1e-5);
  b = static_cast<T>(1e-5 / static_cast<double>(k));
}

// One row: y is the label, −1 for an ignored row (no base loss, no column sums); y0 the label the
// correctness compares with (0 for an ignored row, as the torch path, whose masked label is 0). e: scratch
// of K entries. col: the block's column sums (K, float64) when asked. o: the saved statistics; out: base, r,
// a, H. The base loss and r in float64 from the float64 log-sum-exp; the entropy in the input dtype per
// entry (summed in float64).
// df: the row's f' (K entries, kept for the backward: the whole-loss node) or null. keep_e: e is the row of the
// kept exps (the whole-loss node's, which its backward reads in place of taking the exps again), always written.
template <typename T>
inline void batch_forward_row(const T* x, int64_t k, int64_t y, int64_t y0, const BatchSpec& s, T* e, double* col,
                              double* o, double* out, T* df_row = nullptr, bool keep_e = false) {
  const T m = max_of(x, k);
  const int64_t arg = first_index_of(x, k, m);
  const bool need_e = keep_e || s.entropy != BE_NONE || (col != nullptr && y >= 0);
  // (float32 AvUC: its entropy from the exp pass's moments where no entry meets the log floor)
  constexpr bool is_float = std::is_same<T, float>::value;
  const bool moments = is_float && s.entropy == BE_AVUC && df_row == nullptr;
  double e1 = 0.0;
  float lo = 0.0f;
  double sum;
  if constexpr (is_float) {
    sum = moments ? exp_row_moment(x, k, m, e, e1, lo) : exp_row(x, k, m, need_e ? e : nullptr);
  } else {
    sum = exp_row(x, k, m, need_e ? e : nullptr);
  }
  const double inv = 1.0 / sum, lse = std::log(sum);
  o[BS_MAX] = static_cast<double>(m);
  o[BS_INV] = inv;
  o[BS_ARG] = static_cast<double>(arg);
  double base = 0.0, dbase = 0.0;
  if (y >= 0) {
    const double l = (static_cast<double>(x[y]) - static_cast<double>(m)) - lse;
    if (s.base == BB_NLL) {
      base = -l;
      dbase = -1.0;
    } else if (s.base == BB_FOCAL) {
      // (u = 1 − p_y = (Σ − e_y)/Σ in float64, as exact as −expm1(l) from the same Σ, whose rounding bounds
      // both; glibc's expm1 cost a quarter of the forward)
      const double ey = std::exp(static_cast<double>(x[y]) - static_cast<double>(m));
      focal_base(std::max(0.0, (sum - ey) * inv), ey * inv, l, s.gamma, base, dbase);
    } else {  // BB_LS: −(1 − α) l_y − α/(K − 1) Σ_{j≠y} l_j, Σ_j l_j = Σ_j (x_j − m) − K lse
      double total = 0.0, unused = 0.0;  // (in the input dtype's lanes: a float64 chain per row was slower)
      sum2_row<T>(k, [&](int64_t j, auto tag, auto& v, auto& zero) {
        using V = typename Lanes<T, decltype(tag)::value>::type;
        v = lanes_load<V>(x + j) - m;
        zero = V{};
      }, total, unused);
      const double all = total - static_cast<double>(k) * lse;
      base = -(1 - s.alpha) * l - s.alpha / static_cast<double>(k - 1) * (all - l);
    }
  }
  o[BS_DBASE] = dbase;
  double h = 0.0, dent = 0.0;
  if (moments && lo - static_cast<float>(lse) > kAvucLogFloor) {
    h = lse - e1 * inv;
    dent = 1.0 - h;
  } else if (s.entropy != BE_NONE) {
    const T pinv = static_cast<T>(inv), lse_t = static_cast<T>(lse);
    T sa, sb;
    smoothing_constants<T>(k, sa, sb);
    double hs = 0.0, ds = 0.0;
    sum2_row<T>(k, [&](int64_t j, auto tag, auto& f, auto& pdf) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      const V p = lanes_load<V>(e + j) * pinv;
      V df;
      entropy_lanes<T>(p, (lanes_load<V>(x + j) - m) - lse_t, s.entropy, sa, sb, f, df);
      pdf = p * df;
      if (df_row != nullptr) lanes_store(df_row + j, df);
    }, hs, ds);
    h = -hs;
    dent = ds;
  }
  o[BS_DENT] = dent;
  if (col != nullptr && y >= 0) {
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) col[j] += static_cast<double>(e[j]) * inv;
  }
  out[BO_BASE] = base;
  out[BO_R] = inv;  // p at the max: exp(0) / Σ
  out[BO_CORRECT] = arg == y0 ? 1.0 : 0.0;
  out[BO_H] = h;
}

// One row's gradient into g. gb, gr, gh: the row's incoming gradients of the base loss, r and H (gb = 0 for
// an ignored row); c, ct: the column sums' gradient (float64 and in the input dtype), null when there is
// none or the row is ignored. The (K) pass runs in the input dtype (vectorised for float32); the label and
// arg-max entries are recomputed in float64 (p_y − 1 cancels there).
// df_row: the forward's f' of the row (then no log is taken here) or null; e_row: the forward's exps of the row
// (batch_forward_row's keep_e; then no exp is taken here) or null.
template <typename T>
inline void batch_backward_row(const T* x, int64_t k, int64_t y, const BatchSpec& s, const double* o, double gb,
                               double gr, double gh, const double* c, const T* ct, T* g, const T* df_row = nullptr,
                               const T* e_row = nullptr) {
  const T m = static_cast<T>(o[BS_MAX]);
  const double inv = o[BS_INV];
  const int64_t arg = static_cast<int64_t>(o[BS_ARG]);
  const double r = inv;
  if (e_row == nullptr) exp_row(x, k, m, g);
  const T* ev = e_row != nullptr ? e_row : g;
  double cp = 0.0;  // <c, p>, in the input dtype's lanes (a float64 chain per row cost as much as the exps)
  if (c != nullptr) {
    double unused = 0.0;
    sum2_row<T>(k, [&](int64_t j, auto tag, auto& v, auto& zero) {
      using V = typename Lanes<T, decltype(tag)::value>::type;
      v = lanes_load<V>(ct + j) * lanes_load<V>(ev + j);
      zero = V{};
    }, cp, unused);
    cp *= inv;
  }
  // grad_j = p_j (coef − gh f'_j + c_j) + off, plus y_extra on the label and gr·r on the arg-max entry
  double coef = -gr * r + gh * o[BS_DENT] - cp, off = 0.0, y_extra = 0.0;
  if (y >= 0) {
    if (s.base == BB_LS) {
      const double other = s.alpha / static_cast<double>(k - 1);
      coef += gb;
      off = -gb * other;
      y_extra = -gb * (1 - s.alpha) + gb * other;
    } else {
      coef -= gb * o[BS_DBASE];
      y_extra = gb * o[BS_DBASE];
    }
  }
  const bool ent = s.entropy != BE_NONE && gh != 0.0;
  T sa, sb;
  smoothing_constants<T>(k, sa, sb);
  const double lse = ent && df_row == nullptr ? -std::log(inv) : 0.0;  // (log p for float32 AvUC's f')
  const T lse_t = static_cast<T>(lse);
  const T pinv = static_cast<T>(inv), coef_t = static_cast<T>(coef), off_t = static_cast<T>(off);
  const T gh_t = static_cast<T>(gh);
  walk_row<T>(k, [&](int64_t j, auto tag) {
    using V = typename Lanes<T, decltype(tag)::value>::type;
    const V p = lanes_load<V>(ev + j) * pinv;
    V a = broadcast<V>(coef_t);
    if (ent && df_row != nullptr) {
      a = a - gh_t * lanes_load<V>(df_row + j);
    } else if (ent) {
      V f, df;
      entropy_lanes<T>(p, (lanes_load<V>(x + j) - m) - lse_t, s.entropy, sa, sb, f, df);
      a = a - gh_t * df;
    }
    if (ct != nullptr) a = a + lanes_load<V>(ct + j);
    lanes_store(g + j, p * a + off_t);
  });
  const auto entry = [&](int64_t j) {
    const double p = std::exp(static_cast<double>(x[j]) - static_cast<double>(m)) * inv;
    double a = coef;
    if (ent && df_row != nullptr) {
      a -= gh * static_cast<double>(df_row[j]);
    } else if (ent) {
      T f, df;
      entropy_lanes<T>(static_cast<T>(p), static_cast<T>((static_cast<double>(x[j]) - static_cast<double>(m)) - lse),
                       s.entropy, sa, sb, f, df);
      a -= gh * static_cast<double>(df);
    }
    if (c != nullptr) a += c[j];
    double v = p * a + off;
    if (j == y) v += y_extra;
    if (j == arg) v += gr * r;
    return static_cast<T>(v);
  };
  if (y >= 0) g[y] = entry(y);
  if (arg != y) g[arg] = entry(arg);
}

}  // namespace torchcal

namespace torchcal {

// -- positions as lanes ------------------------------------------------------------------------------------
// A (N, K, S) float32 tensor (segmentation: K = 19, S = H·W) keeps each position's K logits S apart: a row
// gathered entry by entry and walked horizontally costs more than the arithmetic at such K. Here W positions
// are the W lanes of one vector, class j of lane t at x[j·stride + t]: the max, exp, entropy and gradient are
// vertical over the classes, with the per-lane results (base loss, r, a, H and the saved statistics) finished
// lane by lane. Sums over the classes are float32 lanes (the lanes path takes K <= kLaneClasses).

constexpr int64_t kLaneClasses = 256;

template <int Bytes>
struct PosLanes {
  using V = typename Vec<float, Bytes>::type;
  static constexpr int W = Vec<float, Bytes>::width;
};

// W positions: y[t] the label (−1 ignored), e scratch of K·W floats, col the block's column sums (K, float64)
// or null, o the saved statistics of lane 0 (lanes N_BSTAT apart), out[t·N_BOUT + c] the outputs. Lanes t >= w
// are padding (their results are not written).
// dfo: where f' is kept (class j of lane t at dfo[j·stride + t]) or null.
template <int Bytes>
inline void batch_forward_lanes(const float* x, int64_t stride, int64_t k, const int64_t* y, int w,
                                const BatchSpec& s, float* e, double* col, double* o, double* out,
                                float* dfo = nullptr) {
  using V = typename PosLanes<Bytes>::V;
  constexpr int W = PosLanes<Bytes>::W;
  V m = load<V>(x), arg = {};
  for (int64_t j = 1; j < k; ++j) {
    const V v = load<V>(x + j * stride);
    const auto gt = v > m;
    m = gt ? v : m;
    arg = gt ? broadcast<V>(static_cast<float>(j)) : arg;
  }
  // sd: Σ_j (x_j − m) for label smoothing, summed after the subtraction (a sum of the raw logits less K·m
  // cancels: logits sharing an offset of 1e4 lost 3 digits of the base)
  const bool ls = s.base == BB_LS;
  V sum = {}, e1 = {}, lo = {}, sd = {};
  // (AvUC: its entropy from the exp pass's moments where no lane's entry meets the log floor, as
  // exp_row_moment's rows)
  const bool moments = s.entropy == BE_AVUC && dfo == nullptr;
  if (moments) {
    for (int64_t j = 0; j < k; ++j) {
      const V d = load<V>(x + j * stride) - m;
      const V ev = exp_nonpositive<Bytes>(d);
      store(e + j * W, ev);
      sum += ev;
      e1 += ev * d;
      lo = d < lo ? d : lo;
      if (ls) sd += d;
    }
  } else {
    for (int64_t j = 0; j < k; ++j) {
      const V d = load<V>(x + j * stride) - m;
      const V ev = exp_nonpositive<Bytes>(d);
      store(e + j * W, ev);
      sum += ev;
      if (ls) sd += d;
    }
  }
  const V inv = broadcast<V>(1.0f) / sum;
  // (sum >= 1, or NaN where a lane holds a NaN or +inf logit: log_positive reads NaN's bits as a number, about
  // 89, so NaN is passed on as it is, as the row path's std::log does)
  const V lse_lanes = log_positive<Bytes>(sum);
  const V lse = sum == sum ? lse_lanes : sum;
  V hs = {}, ds = {};
  bool unclamped = moments;
  if (moments) {
    const V margin = (lo - lse) - kAvucLogFloor;
    for (int t = 0; t < W; ++t) unclamped = unclamped && margin[t] > 0.0f;
  }
  if (unclamped) {
    hs = e1 * inv - lse;  // Σ_j p_j log p_j
    ds = hs + 1.0f;
  } else if (s.entropy != BE_NONE) {
    float sa, sb;
    smoothing_constants<float>(k, sa, sb);
    for (int64_t j = 0; j < k; ++j) {
      const V p = load<V>(e + j * W) * inv;
      V f, df;
      entropy_lanes<float>(p, (load<V>(x + j * stride) - m) - lse, s.entropy, sa, sb, f, df);
      hs += f;
      ds += p * df;
      if (dfo != nullptr) store(dfo + j * stride, df);
    }
  }
  if (col != nullptr) {
    V kept = {};
    for (int t = 0; t < w; ++t) kept[t] = y[t] >= 0 ? 1.0f : 0.0f;
    const V scale = inv * kept;
    for (int64_t j = 0; j < k; ++j) col[j] += lanes_sum(load<V>(e + j * W) * scale);
  }
  for (int t = 0; t < w; ++t) {
    double* ot = o + t * N_BSTAT;
    double* rt = out + t * N_BOUT;
    const int64_t a = static_cast<int64_t>(arg[t]);
    ot[BS_MAX] = static_cast<double>(m[t]);
    ot[BS_INV] = static_cast<double>(inv[t]);
    ot[BS_ARG] = static_cast<double>(a);
    ot[BS_DENT] = static_cast<double>(ds[t]);
    double base = 0.0, dbase = 0.0;
    const int64_t yt = y[t];
    if (yt >= 0) {
      const double l = static_cast<double>(x[yt * stride + t] - m[t]) - static_cast<double>(lse[t]);
      if (s.base == BB_NLL) {
        base = -l;
        dbase = -1.0;
      } else if (s.base == BB_FOCAL) {
        // (u = (Σ − e_y)/Σ from the lane's own exps, as batch_forward_row: no expm1 and exp per lane)
        const double ey = static_cast<double>(e[yt * W + t]), total = static_cast<double>(sum[t]);
        focal_base(std::max(0.0, (total - ey) / total), ey / total, l, s.gamma, base, dbase);
      } else {
        const double all = static_cast<double>(sd[t]) - static_cast<double>(k) * static_cast<double>(lse[t]);
        base = -(1 - s.alpha) * l - s.alpha / static_cast<double>(k - 1) * (all - l);
      }
    }
    ot[BS_DBASE] = dbase;
    rt[BO_BASE] = base;
    rt[BO_R] = static_cast<double>(inv[t]);
    rt[BO_CORRECT] = a == (yt < 0 ? 0 : yt) ? 1.0 : 0.0;
    rt[BO_H] = -static_cast<double>(hs[t]);
  }
}

// The gradient of W positions into g (class j of lane t at g[j·stride + t]); gb, gr, gh the lanes' incoming
// gradients (gb = 0 on ignored lanes) and ct the column sums' gradient in float32 (null: none; it applies
// to the kept lanes); e scratch of K·W floats; dfi the forward's f' in g's layout (then no log is taken) or null.
template <int Bytes>
inline void batch_backward_lanes(const float* x, int64_t stride, int64_t k, const int64_t* y, int w,
                                 const BatchSpec& s, const double* o, const double* gb, const double* gr,
                                 const double* gh, const float* ct, float* e, float* g, const float* dfi = nullptr) {
  using V = typename PosLanes<Bytes>::V;
  constexpr int W = PosLanes<Bytes>::W;
  // the lanes' numbers gathered in arrays, then loaded as vectors (lane-by-lane vector inserts are slow)
  alignas(64) float a_m[W] = {}, a_inv[W] = {}, a_arg[W], a_y[W], a_coef[W] = {}, a_off[W] = {}, a_ye[W] = {};
  alignas(64) float a_top[W] = {}, a_gh[W] = {}, a_ck[W] = {};
  bool ent = false;
  for (int t = 0; t < W; ++t) {
    a_arg[t] = -1.0f;
    a_y[t] = -1.0f;
    if (t >= w) continue;
    const double* ot = o + t * N_BSTAT;
    a_m[t] = static_cast<float>(ot[BS_MAX]);
    a_inv[t] = static_cast<float>(ot[BS_INV]);
    a_arg[t] = static_cast<float>(ot[BS_ARG]);
    const double r = ot[BS_INV];
    double cf = -gr[t] * r + gh[t] * ot[BS_DENT], of = 0.0, ye = 0.0;
    if (y[t] >= 0) {
      a_y[t] = static_cast<float>(y[t]);
      if (s.base == BB_LS) {
        const double other = s.alpha / static_cast<double>(k - 1);
        cf += gb[t];
        of = -gb[t] * other;
        ye = -gb[t] * (1 - s.alpha) + gb[t] * other;
      } else {
        cf -= gb[t] * ot[BS_DBASE];
        ye = gb[t] * ot[BS_DBASE];
      }
      a_ck[t] = ct != nullptr ? 1.0f : 0.0f;
    }
    a_coef[t] = static_cast<float>(cf);
    a_off[t] = static_cast<float>(of);
    a_ye[t] = static_cast<float>(ye);
    a_top[t] = static_cast<float>(gr[t] * r);
    a_gh[t] = static_cast<float>(gh[t]);
    ent = ent || gh[t] != 0.0;
  }
  const V m = load<V>(a_m), inv = load<V>(a_inv), argv = load<V>(a_arg), yv = load<V>(a_y), off = load<V>(a_off);
  const V y_extra = load<V>(a_ye), top = load<V>(a_top), ghv = load<V>(a_gh), ck = load<V>(a_ck);
  V coef = load<V>(a_coef);
  ent = ent && s.entropy != BE_NONE;
  for (int64_t j = 0; j < k; ++j) {
    const V ev = exp_nonpositive<Bytes>(load<V>(x + j * stride) - m);
    store(e + j * W, ev);
  }
  if (ct != nullptr) {  // <c, p> of each lane, subtracted from its coefficient
    V cp = {};
    for (int64_t j = 0; j < k; ++j) cp += load<V>(e + j * W) * ct[j];
    coef -= cp * inv * ck;
  }
  float sa, sb;
  smoothing_constants<float>(k, sa, sb);
  // (inv in [1/K, 1]: normal; a padded lane's 0 gives a result that is never written)
  const V lse = ent && dfi == nullptr ? V{} - log_positive<Bytes>(inv) : V{};
  for (int64_t j = 0; j < k; ++j) {
    const V p = load<V>(e + j * W) * inv;
    V a = coef;
    if (ent && dfi != nullptr) {
      a -= ghv * load<V>(dfi + j * stride);
    } else if (ent) {
      V f, df;
      entropy_lanes<float>(p, (load<V>(x + j * stride) - m) - lse, s.entropy, sa, sb, f, df);
      a -= ghv * df;
    }
    if (ct != nullptr) a += ck * ct[j];
    const V jf = broadcast<V>(static_cast<float>(j)), zero = {};
    V v = p * a + off;
    v += jf == yv ? y_extra : zero;
    v += jf == argv ? top : zero;
    store(g + j * stride, v);
  }
}

}  // namespace torchcal

namespace torchcal {

// -- SB-ECE's label-binned term on the (M) confidences -----------------------------------------------------
// g_ib = kept_i softmax_b(−(r_i − ξ_b)²/T) over the bin centres ξ_b = (b + ½)/B, S_b = Σ_i g_ib,
// A_b = Σ_i g_ib a_i / S'_b (S'_b = S_b, or 1 for an empty bin), total = Σ_i Σ_b g_ib (A_b − r_i)², the
// term sqrt(total / Σ_i kept_i) (margin.py's _sbece_term, form "label"). Rows are walked W at a time (float32
// lanes; float64 one by one); the separate operators recompute the memberships in each pass, the whole-loss
// node keeps pass 1's (M·B numbers) for pass 2 and the backward (decision 222).
// The gradient of total with respect to r_i, with G_ib = ∂g_ib/∂r_i and Q_b = 2 Σ_i g_ib (A_b − r_i):
//   Σ_b G_ib [(A_b − r_i)² + Q_b (a_i − A_b) / S'_b] − 2 Σ_b g_ib (A_b − r_i).

template <typename V>
inline V lanes_exp_nonpositive(V x) {
  if constexpr (std::is_floating_point<V>::value) {
    return std::exp(x);
  } else {
    return exp_nonpositive<sizeof(V)>(x);
  }
}

// tanh x per float32 lane (Cephes' tanhf, ~2 ulp): x + x³·P(x²) for |x| < 0.625, else
// sign(x)·(1 − z)/(1 + z) with z = e^(−2|x|) <= e^(−1.25) (no cancellation); ±1 beyond |x| ≈ 43.7, where z
// underflows. NaN stays NaN.
template <int Bytes>
inline typename Vec<float, Bytes>::type tanh_lanes(typename Vec<float, Bytes>::type x) {
  using V = typename Vec<float, Bytes>::type;
  const V zero = {};
  const V ax = x < zero ? -x : x;
  const V s = x * x;
  V poly = broadcast<V>(-5.70498872745e-3f);
  poly = poly * s + 2.06390887954e-2f;
  poly = poly * s - 5.37397155531e-2f;
  poly = poly * s + 1.33314422036e-1f;
  poly = poly * s - 3.33332819422e-1f;
  const V small = poly * s * x + x;
  const V z = exp_nonpositive<Bytes>(ax * -2.0f);
  const V big = (1.0f - z) / (1.0f + z);
  const V signed_big = x < zero ? -big : big;
  return ax < 0.625f ? small : signed_big;
}

// tanh of the float32 values v[begin, end) into out (float64), in lanes; float64 values by std::tanh
template <typename T>
inline void tanh_into(const T* v, int64_t begin, int64_t end, double* out) {
  int64_t i = begin;
  if constexpr (std::is_same<T, float>::value) {
    using V = typename Vec<float, kWideBytes>::type;
    constexpr int W = Vec<float, kWideBytes>::width;
    for (; i + W <= end; i += W) {
      const V t = tanh_lanes<kWideBytes>(lanes_load<V>(v + i));
      for (int q = 0; q < W; ++q) out[i + q] = static_cast<double>(t[q]);
    }
    for (; i < end; ++i) out[i] = static_cast<double>(std::tanh(v[i]));
  } else {
    for (; i < end; ++i) out[i] = std::tanh(static_cast<double>(v[i]));
  }
}

// the memberships of W rows (g[b·W + t]) and, with ds, ∂s_b/∂r = −2(r − ξ_b)/T and Σ_b σ_b ∂s_b/∂r (mean)
template <typename T, typename V>
inline void soft_bins(V r, V kept, int64_t bins, T inv_t, T* g, T* ds, V& mean) {
  constexpr int W = sizeof(V) / sizeof(T);
  V m = {};
  for (int64_t b = 0; b < bins; ++b) {
    const V d = r - static_cast<T>((static_cast<double>(b) + 0.5) / static_cast<double>(bins));
    const V s = -(d * d) * inv_t;
    lanes_store(g + b * W, s);
    if (ds != nullptr) lanes_store(ds + b * W, d * (-2 * inv_t));
    m = b == 0 ? s : (m < s ? s : m);
  }
  V sum = {};
  for (int64_t b = 0; b < bins; ++b) {
    const V e = lanes_exp_nonpositive(lanes_load<V>(g + b * W) - m);
    lanes_store(g + b * W, e);
    sum += e;
  }
  const V scale = kept / sum;
  mean = V{};
  for (int64_t b = 0; b < bins; ++b) {
    const V gb = lanes_load<V>(g + b * W) * scale;
    lanes_store(g + b * W, gb);
    if (ds != nullptr) mean += gb * lanes_load<V>(ds + b * W);
  }
}

// soft_bins' ds and mean from memberships g it computed before (for W rows at r)
template <typename T, typename V>
inline void bin_slopes(V r, int64_t bins, T inv_t, const T* g, T* ds, V& mean) {
  constexpr int W = sizeof(V) / sizeof(T);
  mean = V{};
  for (int64_t b = 0; b < bins; ++b) {
    const V d = r - static_cast<T>((static_cast<double>(b) + 0.5) / static_cast<double>(bins));
    const V slope = d * (-2 * inv_t);
    lanes_store(ds + b * W, slope);
    mean += lanes_load<V>(g + b * W) * slope;
  }
}

}  // namespace torchcal

namespace torchcal {

// -- the batch terms on the (M) per-row numbers ------------------------------------------------------------
// The terms of margin.py (_mdca_term, the DCA penalty, _avuc_term, _savuc_term, _esd_term) evaluated in
// float64 from the operator's per-row outputs (in the input dtype T) over the rows with in[i] != 0 (kept,
// and in ESD's held-out part when it has one), each with its derivative with respect to those outputs
// (dr, dh: M entries, 0 outside; dcol: K), so that the whole loss is one autograd node. A comparison the
// torch path makes in T (AvUC's H <= threshold) is made in T here too; |·| has the derivative sign(·)
// (0 at 0), as torch's abs.

enum BatchTerm { BT_MDCA = 0, BT_DCA = 1, BT_SBECE = 2, BT_AVUC = 3, BT_SAVUC = 4, BT_ESD = 5 };

inline double sign_of(double v) { return v > 0 ? 1.0 : (v < 0 ? -1.0 : 0.0); }

// MDCA: (1/K) Σ_k |(col_k − lab_k) / n|, col the kept rows' column sums of p, lab their label counts
inline double mdca_term(int64_t k, const double* col, const double* lab, double n, double* dcol) {
  double total = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    const double d = (col[j] - lab[j]) / n;
    total += std::abs(d);
    dcol[j] = sign_of(d) / (static_cast<double>(k) * n);
  }
  return total / static_cast<double>(k);
}

// DCA: |Σ r − Σ a| / n over the rows in
template <typename T>
double dca_term(int64_t m, const T* r, const T* a, const uint8_t* in, double* dr) {
  double sr = 0.0, sa = 0.0, n = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    if (!in[i]) continue;
    sr += static_cast<double>(r[i]);
    sa += static_cast<double>(a[i]);
    n += 1.0;
  }
  const double d = (sr - sa) / n, g = sign_of(d) / n;
  for (int64_t i = 0; i < m; ++i) dr[i] = in[i] ? g : 0.0;
  return std::abs(d);
}

// fn(c, begin, end) over fixed blocks of kTermRows rows, in parallel (parallel(count, f) calls f(c) for every
// c in [0, count), possibly at once); per-block sums added in block order do not depend on the thread count
constexpr int64_t kTermRows = 1024;

template <typename Parallel, typename Fn>
int64_t over_term_blocks(int64_t m, const Parallel& parallel, const Fn& fn) {
  const int64_t blocks = (m + kTermRows - 1) / kTermRows;
  parallel(blocks, [&](int64_t c) { fn(c, c * kTermRows, std::min(m, (c + 1) * kTermRows)); });
  return blocks;
}

// c ? a : b by the bits (exact, NaN included), with no branch: a loop of these vectorises where GCC keeps the
// conditional expressions of floating-point values as branches
inline double pick(bool c, double a, double b) {
  uint64_t x, y;
  std::memcpy(&x, &a, sizeof(x));
  std::memcpy(&y, &b, sizeof(y));
  const uint64_t mask = -static_cast<uint64_t>(c);
  x = (x & mask) | (y & ~mask);
  double r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
}

// AvUC (the released AvULoss): the four counts n_AC, n_AU, n_IC, n_IU (accurate rows weighted by r,
// inaccurate by 1 − r, certain (H <= threshold) by 1 − tanh H, uncertain by tanh H), the term
// −log(AvU + 1e-10) with AvU = (n_AC + n_IU) / (Σ counts + 1e-10); stats: Σ H and the count of the accurate
// rows, then of the inaccurate ones (the threshold update's sums). tanh H is taken once per row (kept in dh
// between the passes; float32 H in float32 lanes, as the torch path's tanh).
template <typename T, typename Parallel>
double avuc_term(int64_t m, const T* r, const T* a, const T* h, const uint8_t* in, T threshold, double* dr, double* dh,
                 double* stats, const Parallel& parallel) {
  std::vector<double> part(static_cast<size_t>((m + kTermRows - 1) / kTermRows) * 8, 0.0);
  // (both passes vectorised, so branch-free, with the sums in registers: a branch on the correctness or the
  // threshold mispredicts about every other row, and sums kept in `part` were stored and reloaded on every
  // row. A row that does not count adds an exact 0 to each sum, selected, not multiplied: its entropy may be
  // NaN. The lanes' partial sums make the order of the additions depend on the vector width, not the threads.)
  const int64_t blocks = over_term_blocks(m, parallel, [&](int64_t c, int64_t begin, int64_t end) {
    tanh_into<T>(h, begin, end, dh);  // (float32: in lanes, as the torch path's float32 tanh)
    const T* hp = h;
    const T* rp = r;
    const T* ap = a;
    const uint8_t* kp = in;
    const double* tp = dh;
    const T th = threshold;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, s5 = 0.0, s6 = 0.0, s7 = 0.0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
    for (int64_t i = begin; i < end; ++i) {
      const bool kept = kp[i] != 0, acc = ap[i] != T(0), right = kept & acc, wrong = kept & !acc;
      const double hi = static_cast<double>(hp[i]), t = tp[i], ri = static_cast<double>(rp[i]);
      const bool certain = hp[i] <= th;
      const double p1 = pick(certain, 1.0 - t, 0.0), p2 = pick(certain, 0.0, t);
      s0 += pick(right, ri * p1, 0.0);
      s1 += pick(right, ri * p2, 0.0);
      s4 += pick(right, hi, 0.0);
      s5 += pick(right, 1.0, 0.0);
      s2 += pick(wrong, (1.0 - ri) * p1, 0.0);
      s3 += pick(wrong, (1.0 - ri) * p2, 0.0);
      s6 += pick(wrong, hi, 0.0);
      s7 += pick(wrong, 1.0, 0.0);
    }
    double* s = part.data() + c * 8;  // the four counts, then the statistics
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
    s[3] = s3;
    s[4] = s4;
    s[5] = s5;
    s[6] = s6;
    s[7] = s7;
  });
  double s[8] = {};
  for (int64_t c = 0; c < blocks; ++c)
    for (int v = 0; v < 8; ++v) s[v] += part[c * 8 + v];
  for (int v = 0; v < 4; ++v) stats[v] = s[4 + v];
  const double good = s[0] + s[3], total = s[0] + s[1] + s[2] + s[3] + 1e-10, avu = good / total;
  const double d_avu = -1.0 / (avu + 1e-10);
  const double g_good = d_avu * (1.0 / total - good / (total * total)), g_bad = d_avu * (-good / (total * total));
  over_term_blocks(m, parallel, [&](int64_t, int64_t begin, int64_t end) {
    const T* hp = h;
    const T* rp = r;
    const T* ap = a;
    const uint8_t* kp = in;
    double* drp = dr;
    double* dhp = dh;
    const T th = threshold;
    const double gg = g_good, gw = g_bad;  // (locals: the stores below could otherwise overwrite them)
    for (int64_t i = begin; i < end; ++i) {
      const double t = dhp[i], ri = static_cast<double>(rp[i]);
      const bool certain = hp[i] <= th, right = ap[i] != T(0), kept = kp[i] != 0;
      const double p1 = pick(certain, 1.0 - t, 0.0), p2 = pick(certain, 0.0, t);
      const double dp1 = pick(certain, -1.0, 0.0), dp2 = pick(certain, 0.0, 1.0);  // d/d tanh H
      // accurate: n_AC (g_good) and n_AU (g_bad), weighted by r; inaccurate: n_IC (g_bad) and n_IU (g_good),
      // weighted by 1 − r
      const double d_right = gg * p1 + gw * p2, d_wrong = -(gw * p1 + gg * p2);
      const double t_right = ri * (gg * dp1 + gw * dp2), t_wrong = (1.0 - ri) * (gw * dp1 + gg * dp2);
      drp[i] = pick(kept, pick(right, d_right, d_wrong), 0.0);
      dhp[i] = pick(kept, pick(right, t_right, t_wrong) * (1.0 - t * t), 0.0);
    }
  });
  return -std::log(avu + 1e-10);
}

// S-AvUC's per-row tanh H into t and q = σ((logit e − logit κ) / temperature) into q (e = clamp(H / log K, ε,
// 1 − ε), ε the machine epsilon of T) for the rows [begin, end): float32 H in float32 lanes, as the torch
// path computes both in the logits' dtype (Cephes' tanhf, logf and expf, ~1-2 ulp each; σ(u) from e^(−|u|)
// on either side of 0, so the exponential never overflows); float64 by the standard library, scalar
template <typename T>
inline void savuc_rows_into(const T* h, int64_t begin, int64_t end, double log_k, double logit_kappa,
                            double temperature, double* t, double* q) {
  int64_t i = begin;
  if constexpr (std::is_same<T, float>::value) {
    using V = typename Vec<float, kWideBytes>::type;
    constexpr int W = Vec<float, kWideBytes>::width;
    const float eps = std::numeric_limits<float>::epsilon(), lk = static_cast<float>(log_k);
    const float lkap = static_cast<float>(logit_kappa), temp = static_cast<float>(temperature);
    const V lo = broadcast<V>(eps), hi = broadcast<V>(1.0f - eps), one = broadcast<V>(1.0f), zero = {};
    for (; i + W <= end; i += W) {
      const V hv = lanes_load<V>(h + i);
      const V tv = tanh_lanes<kWideBytes>(hv);
      V e = hv / lk;
      e = e < lo ? lo : e;  // (NaN stays NaN: its t is NaN, and so are the sums it enters)
      e = e > hi ? hi : e;
      const V u = (log_positive<kWideBytes>(e / (one - e)) - lkap) / temp;
      const V w = exp_nonpositive<kWideBytes>(u < zero ? u : -u);  // e^(−|u|)
      const V qv = u < zero ? w / (one + w) : one / (one + w);
      for (int l = 0; l < W; ++l) {
        t[i + l] = static_cast<double>(tv[l]);
        q[i + l] = static_cast<double>(qv[l]);
      }
    }
  }
  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  for (; i < end; ++i) {
    const double hi = static_cast<double>(h[i]);
    const double e = std::min(std::max(hi / log_k, eps), 1.0 - eps);
    t[i] = std::tanh(hi);
    q[i] = 1.0 / (1.0 + std::exp(-(std::log(e / (1.0 - e)) - logit_kappa) / temperature));
  }
}

// S-AvUC (uncertainty-baselines' get_soft_avuc_loss): e = clamp(H / log K, ε, 1 − ε) (ε the machine epsilon
// of T), q = σ((logit e − logit κ) / temperature), the counts with accurate / inaccurate rows against
// certain (1 − q)(1 − tanh H) / uncertain q tanh H, and log(1 + (n_AU + n_IC) / max(n_AC + n_IU, 1e-5)).
// tanh H and q are taken once per row (kept in dh and q between the passes).
template <typename T, typename Parallel>
double savuc_term(int64_t m, const T* a, const T* h, const uint8_t* in, int64_t k, double temperature, double kappa,
                  double* dh, const Parallel& parallel) {
  const double eps = static_cast<double>(std::numeric_limits<T>::epsilon());
  const double log_k = std::log(static_cast<double>(k)), logit_kappa = std::log(kappa / (1.0 - kappa));
  std::vector<double> qs(static_cast<size_t>(m));
  std::vector<double> part(static_cast<size_t>((m + kTermRows - 1) / kTermRows) * 2, 0.0);
  const int64_t blocks = over_term_blocks(m, parallel, [&](int64_t c, int64_t begin, int64_t end) {
    savuc_rows_into<T>(h, begin, end, log_k, logit_kappa, temperature, dh, qs.data());
    // (branch-free, the sums in registers, as avuc_term's passes; an uncounted row adds an exact 0)
    const T* ap = a;
    const uint8_t* kp = in;
    const double* tp = dh;
    const double* qp = qs.data();
    double good = 0.0, bad = 0.0;  // n_AC + n_IU, n_AU + n_IC
#pragma omp simd reduction(+ : good, bad)
    for (int64_t i = begin; i < end; ++i) {
      const double t = tp[i], q = qp[i];
      const double certain = (1.0 - q) * (1.0 - t), uncertain = q * t;
      const bool kept = kp[i] != 0, acc = ap[i] != T(0);
      good += pick(kept, pick(acc, certain, uncertain), 0.0);
      bad += pick(kept, pick(acc, uncertain, certain), 0.0);
    }
    part[c * 2] = good;
    part[c * 2 + 1] = bad;
  });
  double good = 0.0, bad = 0.0;
  for (int64_t c = 0; c < blocks; ++c) {
    good += part[c * 2];
    bad += part[c * 2 + 1];
  }
  const double denom = std::max(good, 1e-5), g_bad = 1.0 / (denom + bad);
  const double g_good = good >= 1e-5 ? -bad / (denom * (denom + bad)) : 0.0;
  over_term_blocks(m, parallel, [&](int64_t, int64_t begin, int64_t end) {
    const T* ap = a;
    const T* hp = h;
    const uint8_t* kp = in;
    const double* qp = qs.data();
    double* dhp = dh;
    const double gg = g_good, gw = g_bad, lk = log_k, temp = temperature, lo = eps, hi = 1.0 - eps;
    for (int64_t i = begin; i < end; ++i) {
      const double t = dhp[i], q = qp[i], e0 = static_cast<double>(hp[i]) / lk;
      const bool inside = e0 >= lo && e0 <= hi;
      const double e = std::min(std::max(e0, lo), hi);
      // certain (1 − q)(1 − t) counts to g_c, uncertain q t to g_u
      const bool acc = ap[i] != T(0);
      const double g_c = pick(acc, gg, gw), g_u = pick(acc, gw, gg);
      const double dq = -g_c * (1.0 - t) + g_u * t, dt = -g_c * (1.0 - q) + g_u * q;
      const double de = pick(inside, 1.0 / lk, 0.0);
      dhp[i] = pick(kp[i] != 0, dt * (1.0 - t * t) + dq * q * (1.0 - q) / temp / (e * (1.0 - e)) * de, 0.0);
    }
  });
  return std::log1p(bad / denom);
}

// ESD, the U-statistic of margin.py's _esd_term, over the rows in (n of them, sorted by r): with
// x_j = a_j − r_j, S_i = Σ_{j≠i, r_j<=r_i} x_j, Q_i the same sum of x_j², ESD = Σ_i (S_i² − Q_i) / (n(n − 1)(n − 2))
// (0 when n < 3). Its derivative in x_j sums over the rows i ≠ j with r_i >= r_j, those from the start of
// j's run of equal confidences on: (2/D)(U − S_j − x_j (c − 1)) with U the sum of S_i and c their number.
// dr gets the derivative in r of every row (0 outside in), times scale_of(ESD).
// float32 confidences are sorted as (bits << 32 | row << 1 | a) words by radix (radix_sort_upper_words);
// float64 (and batches of 2^31 rows or more) by std::sort of the rows. The passes over the sorted rows run on
// chunks that start at a run of equal confidences, their number fixed by n (the sums do not depend on the
// thread count): the chunks' Σ x and Σ x² give each its prefix, then each its S and partial sums, then each
// its suffix sums of S (from the later chunks') and its rows' derivatives.
template <typename T, typename Parallel, typename Scale>
double esd_term(int64_t m, const T* r, const T* a, const uint8_t* in, double* dr, const Parallel& parallel,
                const Scale& scale_of) {
  const int64_t row_chunks = std::min<int64_t>(16, std::max<int64_t>(1, m >> 14));
  // the kept rows of each chunk of rows (and dr = 0 for the others)
  std::vector<int64_t> kept(static_cast<size_t>(row_chunks + 1), 0);
  parallel(row_chunks, [&](int64_t c) {
    int64_t count = 0;
    for (int64_t i = chunk_start(m, row_chunks, c), end = chunk_start(m, row_chunks, c + 1); i < end; ++i) {
      count += in[i] != 0;
      if (!in[i]) dr[i] = 0.0;
    }
    kept[c + 1] = count;
  });
  for (int64_t c = 0; c < row_chunks; ++c) kept[c + 1] += kept[c];
  const int64_t n = kept[row_chunks];
  // (uninitialised arrays, first written by the parallel passes)
  std::unique_ptr<int64_t[]> order(new int64_t[static_cast<size_t>(n)]);  // the kept rows in ascending r
  std::unique_ptr<double[]> x(new double[static_cast<size_t>(n)]);        // x of each, in that order
  std::unique_ptr<uint8_t[]> same(new uint8_t[static_cast<size_t>(n)]);   // whether its r equals the last one's
  bool radix = false;
  if constexpr (std::is_same<T, float>::value) radix = m < (int64_t{1} << 31);  // (row << 1 in 32 bits)
  if (radix) {
    std::unique_ptr<uint64_t[]> words(new uint64_t[static_cast<size_t>(n)]), tmp(new uint64_t[static_cast<size_t>(n)]);
    uint64_t* wp = words.get();
    parallel(row_chunks, [&](int64_t c) {
      int64_t q = kept[c];
      for (int64_t i = chunk_start(m, row_chunks, c), end = chunk_start(m, row_chunks, c + 1); i < end; ++i) {
        if (!in[i]) continue;
        uint32_t bits;
        std::memcpy(&bits, r + i, sizeof(bits));
        wp[q++] = (static_cast<uint64_t>(bits) << 32) | (static_cast<uint64_t>(i) << 1) |
                  static_cast<uint64_t>(a[i] != T(0));
      }
    });
    const uint64_t* sorted = radix_sort_upper_words(wp, tmp.get(), n, parallel);
    parallel(row_chunks, [&](int64_t c) {
      for (int64_t q = chunk_start(n, row_chunks, c), end = chunk_start(n, row_chunks, c + 1); q < end; ++q) {
        const uint64_t w = sorted[q];
        const uint32_t bits = static_cast<uint32_t>(w >> 32);
        float rq;
        std::memcpy(&rq, &bits, sizeof(rq));
        order[q] = static_cast<int64_t>((w & 0xFFFFFFFFu) >> 1);
        x[q] = static_cast<double>(w & 1) - static_cast<double>(rq);
        same[q] = q > 0 && (sorted[q - 1] >> 32) == bits && !std::isnan(rq);  // (equal bits: equal r; NaN never)
      }
    });
  } else {
    int64_t q = 0;
    for (int64_t i = 0; i < m; ++i)
      if (in[i]) order[q++] = i;
    // (NaN last: a strict weak order, as the radix sort's bit order puts NaN above every number)
    std::sort(order.get(), order.get() + n, [r](int64_t p, int64_t q) {
      return !std::isnan(r[p]) && (std::isnan(r[q]) || r[p] < r[q]);
    });
    for (q = 0; q < n; ++q) {
      const int64_t i = order[q];
      x[q] = static_cast<double>(a[i]) - static_cast<double>(r[i]);
      same[q] = q > 0 && r[order[q - 1]] == r[i];
    }
  }
  if (n < 3) {
    for (int64_t q = 0; q < n; ++q) dr[order[q]] = 0.0;
    return 0.0;
  }
  // chunks of the sorted rows, each from the start of a run of equal confidences
  const int64_t chunks = std::min<int64_t>(16, std::max<int64_t>(1, n >> 14));
  std::vector<int64_t> cut(static_cast<size_t>(chunks + 1));
  for (int64_t c = 0; c <= chunks; ++c) {
    int64_t q = chunk_start(n, chunks, c);
    while (q < n && same[q]) ++q;
    cut[c] = q;
  }
  std::vector<double> sum_x(static_cast<size_t>(chunks)), sum_x2(static_cast<size_t>(chunks));
  parallel(chunks, [&](int64_t c) {
    double s1 = 0.0, s2 = 0.0;
    for (int64_t q = cut[c]; q < cut[c + 1]; ++q) {
      s1 += x[q];
      s2 += x[q] * x[q];
    }
    sum_x[c] = s1;
    sum_x2[c] = s2;
  });
  std::unique_ptr<double[]> s(new double[static_cast<size_t>(n)]);
  std::vector<double> part(static_cast<size_t>(chunks)), sum_s(static_cast<size_t>(chunks));
  parallel(chunks, [&](int64_t c) {
    double prefix = 0.0, prefix2 = 0.0;  // the earlier chunks' sums
    for (int64_t e = 0; e < c; ++e) {
      prefix += sum_x[e];
      prefix2 += sum_x2[e];
    }
    double total = 0.0, ss = 0.0;
    for (int64_t q0 = cut[c]; q0 < cut[c + 1];) {  // one run of equal confidences [q0, q1)
      int64_t q1 = q0 + 1;
      while (q1 < n && same[q1]) ++q1;
      for (int64_t q = q0; q < q1; ++q) {
        prefix += x[q];
        prefix2 += x[q] * x[q];
      }
      for (int64_t q = q0; q < q1; ++q) {
        s[q] = prefix - x[q];
        total += s[q] * s[q] - (prefix2 - x[q] * x[q]);
        ss += s[q];
      }
      q0 = q1;
    }
    part[c] = total;
    sum_s[c] = ss;
  });
  double total = 0.0;
  for (const double v : part) total += v;
  const double nd = static_cast<double>(n), denom = nd * (nd - 1.0) * (nd - 2.0);
  const double esd = total / denom;
  const double coef = 2.0 / denom * scale_of(esd);
  parallel(chunks, [&](int64_t c) {
    double suffix = 0.0;  // Σ S of the later chunks, then of the rows from the current run on
    for (int64_t e = chunks - 1; e > c; --e) suffix += sum_s[e];
    for (int64_t q1 = cut[c + 1]; q1 > cut[c];) {  // the runs from the last: [q0, q1)
      int64_t q0 = q1 - 1;
      while (same[q0]) --q0;  // (same[cut[c]] is false)
      for (int64_t q = q1 - 1; q >= q0; --q) suffix += s[q];
      const double tail = static_cast<double>(n - q0 - 1);
      for (int64_t q = q0; q < q1; ++q) dr[order[q]] = -coef * (suffix - s[q] - x[q] * tail);  // x = a − r
      q1 = q0;
    }
  });
  return esd;
}

}  // namespace torchcal
