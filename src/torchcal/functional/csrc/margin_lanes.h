// The margin losses (margin.h) on (N, K, d1, ...) logits read in place, one position per vector lane: a block
// of W positions (W = the wide vector's width: 16 float32, 8 float64 lanes with AVX-512) is walked class by
// class (stride: the positions per image), so every step is a contiguous load and the max, exp-sum, arg-max,
// label logit and the kind's terms are lane-wise, with no horizontal reduction and no transpose. The
// arithmetic is margin_forward_row / margin_backward_row's, lane by lane: the same dtype for each quantity,
// the per-class sums in input-dtype lanes over blocks of 256 classes and float64 across blocks, per-row
// float64 finishing (log Σ, 1/Σ, the cross entropy, the penalty's sums), the label and arg-max entries of the
// gradient recomputed in float64. A block that runs past the image's last position (its tail) is copied into
// a padded tile first. Plain C++17 (no torch), included by fused_losses.cpp after margin.h.

#pragma once

#include "margin.h"

#include <vector>

namespace torchcal {

// whether the lane path computes this kind (others take the tile path of over_rows)
inline bool margin_lanes_kind(int64_t kind) {
  return kind == M_MBLS || kind == M_MAXSUP || kind == M_ACLS || kind == M_CP || kind == M_CALS || kind == M_POLY1;
}

// how far ahead of a block (in entries along a class's positions) its class rows are prefetched: K rows at
// a stride of the image's positions are more streams than the hardware prefetcher follows
constexpr int64_t kAhead = 256;

template <typename T>
struct MarginLanes {
  static constexpr int Bytes = kWideBytes;
  using V = typename Vec<T, Bytes>::type;
  static constexpr int W = Vec<T, Bytes>::width;
  typedef double D __attribute__((vector_size(W * sizeof(double))));  // W float64 lanes (the sums)
};

// e^x (x <= 0) per lane: the row path's vectorised expf for float32; std::exp per lane for float64
template <typename T, typename V>
inline V lanes_exp(V x) {
  if constexpr (std::is_same<T, float>::value) {
    return exp_nonpositive<sizeof(V)>(x);
  } else {
    V r;
    for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(T)); ++l) r[l] = std::exp(x[l]);
    return r;
  }
}

// cp_lanes on W lanes: vectorised for float32 (its logf), lane by lane (std::log) for float64; the form is
// chosen per call (cp_form), the branch the same for every block of a call
template <typename T, int Form, typename V>
inline void cp_lanes_form(V p, V log_p, double eps, V& f, V& df) {
  if constexpr (std::is_same<T, float>::value) {
    cp_lanes<T, Form>(p, log_p, eps, f, df);
  } else {
    for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(T)); ++l) {
      T fl, dfl;
      cp_lanes<T, Form>(p[l], log_p[l], eps, fl, dfl);
      f[l] = fl;
      df[l] = dfl;
    }
  }
}

template <typename T, typename V>
inline void cp_lanes_of(V p, V log_p, const MarginSpec& s, V& f, V& df) {
  switch (cp_form(s)) {
    case CP_MBLS:
      cp_lanes_form<T, CP_MBLS>(p, log_p, s.eps, f, df);
      break;
    case CP_EXACT:
      cp_lanes_form<T, CP_EXACT>(p, log_p, s.eps, f, df);
      break;
    default:
      cp_lanes_form<T, CP_EPS>(p, log_p, s.eps, f, df);
  }
}

template <typename D, typename V>
inline D widen(V v) {
  return __builtin_convertvector(v, D);
}

// The statistics of the W positions at x (class j of lane l at x[j * stride + l]) into o + l * N_STAT, with
// labels y[l] (−1: no cross entropy). e: scratch of k * W entries (the confidence penalty's exp(x − max)).
// sums (CALS, or null): the training statistics of the lanes with a label added into sums[0..2K], as
// cals_row's, entry by entry in lane order (each entry's additions in the positions' order: the blocks of an
// image taken in order, the sums are those of the image's rows in row order). df (the confidence penalty, or
// null): f'(p) of every entry stored at df[j * W + l] for the backward (the lanes' order of a block).
// Both lane kernels are flattened (every call inlined into them): the helpers they share with the row kernels
// (cp_lanes, the vectorised logf) then keep those as their one caller, and GCC keeps inlining them there
// (called out of line, the confidence penalty's rows are 5-10% slower).
template <typename T>
__attribute__((flatten)) void margin_forward_lanes(const T* x, int64_t stride, int64_t k, const T* y,
                                                  const MarginSpec& s, T* e, double* o,
                                                  typename MarginLanes<T>::D* sums = nullptr, T* df = nullptr) {
  using L = MarginLanes<T>;
  using V = typename L::V;
  using D = typename L::D;
  constexpr int W = L::W;
  // pass 1: the max, its first index (a strict compare keeps the first), the label's logit
  const V yv = load<V>(y);
  V m = load<V>(x), arg = {}, xy = {};
  xy = yv == T(0) ? m : xy;
  __builtin_prefetch(x + kAhead);
  for (int64_t j = 1; j < k; ++j) {
    __builtin_prefetch(x + j * stride + kAhead);
    const V v = load<V>(x + j * stride), jv = broadcast<V>(static_cast<T>(j));
    const auto gt = m < v;
    m = gt ? v : m;
    arg = gt ? jv : arg;
    xy = yv == jv ? v : xy;
  }
  // pass 2: Σ exp(x − m) and the kind's sums (a: hinges / Σx / h² / f / w r² / Poly-1's e_y; b: active hinges /
  // ties / p f' / r)
  const V zero = {}, one = broadcast<V>(T(1));
  const V thr = m + static_cast<T>(-s.margin);
  const T* cls = static_cast<const T*>(s.cls);  // CALS: rows a, b, w of class_params
  D sum = {}, a = {}, b = {};
  for (int64_t j0 = 0; j0 < k; j0 += 256) {
    const int64_t j1 = std::min<int64_t>(k, j0 + 256);
    V es = {}, as = {}, bs = {};
    for (int64_t j = j0; j < j1; ++j) {
      const V v = load<V>(x + j * stride);
      const V ev = lanes_exp<T>(v - m);
      es += ev;
      if (s.kind == M_MBLS) {
        const V r = thr - v;
        as += r > zero ? r : zero;
        bs += r > zero ? one : zero;
      } else if (s.kind == M_MAXSUP) {
        a += widen<D>(v);  // float64 per class, as the row path
      } else if (s.kind == M_ACLS) {
        const V r = thr - v;
        const V h = r > zero ? r : zero;
        as += h * h;
        bs += v == m ? one : zero;
      } else if (s.kind == M_CALS) {  // r = relu(a_j (m − x) + b_j), w_j r² (cals_row's, in the dtype)
        V r = (m - v) * broadcast<V>(cls[j]) + broadcast<V>(cls[k + j]);
        r = r > zero ? r : zero;
        as += r * r * broadcast<V>(cls[2 * k + j]);
        bs += r;
        if (sums != nullptr) {  // clamp(r, λ_min, λ_max) in the dtype, max − x in float64, kept lanes only
          const T lo = static_cast<T>(s.lo), hi = static_cast<T>(s.hi);
          V c = r < lo ? broadcast<V>(lo) : r;
          c = c > hi ? broadcast<V>(hi) : c;
          // the other lanes zeroed in the dtype (exact), so that the float64 lanes need no select: a select
          // on vectors of 16 doubles (two registers) was lowered lane by lane, 60% of the forward
          const auto kept = yv >= zero;
          sums[j] += widen<D>(kept ? c : zero);
          sums[k + j] += widen<D>(kept ? m : zero) - widen<D>(kept ? v : zero);
        }
      } else if (s.kind == M_CP) {
        store(e + j * W, ev);
      } else if (s.kind == M_POLY1) {  // e_y, the label's term of Σ
        as += yv == broadcast<V>(static_cast<T>(j)) ? ev : zero;
      }
    }
    sum += widen<D>(es);
    if (s.kind == M_MBLS || s.kind == M_ACLS || s.kind == M_CALS || s.kind == M_POLY1) {
      a += widen<D>(as);
      b += widen<D>(bs);
    }
  }
  // in float64 lanes: log Σ, 1/Σ, the cross entropy
  const D log_sum = log_lanes(sum), inv_d = 1.0 / sum, zero_d = {};
  const D ce = widen<D>(yv) >= 0.0 ? (widen<D>(m) - widen<D>(xy)) + log_sum : zero_d;
  const V lse = __builtin_convertvector(log_sum, V), inv = __builtin_convertvector(inv_d, V);
  for (int l = 0; l < W; ++l) {
    double* ol = o + l * N_STAT;
    ol[S_CE] = ce[l];
    ol[S_MAX] = static_cast<double>(m[l]);
    ol[S_INV] = inv_d[l];
    ol[S_ARG] = static_cast<double>(arg[l]);
  }
  if (s.kind == M_CP) {  // pass 3: p = exp(x − m) / Σ, log p = (x − m) − log Σ, the terms f and p f'
    for (int64_t j0 = 0; j0 < k; j0 += 256) {
      const int64_t j1 = std::min<int64_t>(k, j0 + 256);
      V as = {}, bs = {};
      for (int64_t j = j0; j < j1; ++j) {
        const V p = load<V>(e + j * W) * inv;
        const V log_p = (load<V>(x + j * stride) - m) - lse;
        V f, dfv;
        cp_lanes_of<T>(p, log_p, s, f, dfv);
        as += f;
        bs += p * dfv;
        if (df != nullptr) store(df + j * W, dfv);
      }
      a += widen<D>(as);
      b += widen<D>(bs);
    }
  }
  if (sums != nullptr) sums[2 * k] += widen<D>(yv >= zero ? one : zero);
  const double kd = static_cast<double>(k), log_k = std::log(kd);
  for (int l = 0; l < W; ++l) {
    double* ol = o + l * N_STAT;
    double pen = 0.0, aux = 0.0;
    if (s.kind == M_MBLS) {
      pen = a[l] / kd;
      aux = b[l];
    } else if (s.kind == M_MAXSUP) {
      pen = static_cast<double>(m[l]) - a[l] / kd;
    } else if (s.kind == M_ACLS) {
      const T h = m[l] + static_cast<T>(-s.margin);
      const double hd = h > 0 ? static_cast<double>(h) : 0.0;
      pen = s.lam_pos * b[l] * hd * hd + s.lam_neg * a[l] / (kd - 1.0);
      aux = b[l];
    } else if (s.kind == M_CALS) {
      pen = a[l] - s.offset;
      aux = b[l];
    } else if (s.kind == M_POLY1) {
      // ε(1 − p_y) with 1 − p_y = (Σ − e_y)/Σ and p_y = e_y/Σ from the pass's own exps, in float64 (no expm1
      // and exp per position; the row path's −expm1(−ce) carries the same rounding of the float32 Σ, as the
      // focal base of decision 220)
      pen = y[l] >= 0 ? (sum[l] - a[l]) / sum[l] : 0.0;
      aux = y[l] >= 0 ? a[l] / sum[l] : 0.0;
    } else {
      pen = s.mbls_form ? a[l] / kd : log_k + a[l];
      aux = s.mbls_form ? b[l] / kd : b[l];
    }
    ol[S_PEN] = pen;
    ol[S_AUX] = aux;
  }
}

// The gradient of the W positions at x into g (same layout): per lane the statistics o + l * N_STAT, the
// label y[l] (−1: none) and the incoming gradients gce[l], gpen[l] of the cross entropy and of the penalty
// (times coef); a lane with both 0 gets a zero gradient. One pass over the classes in the input dtype, as
// margin_backward_row's, with the arg-max's share of the penalty added on its entry. The label entry, where
// the cross entropy's p − 1 cancels, is finished per lane in float64 from 1 − p_y = Σ_{j≠y} exp(x_j − m)/Σ
// (summed in the pass like Σ in the forward), not from p_y. df (the confidence penalty, or null): the
// forward's f'(p) at df[j * W + l], read instead of taking its logs and division again.
template <typename T>
__attribute__((flatten)) void margin_backward_lanes(const T* x, int64_t stride, int64_t k, const T* y,
                                                   const MarginSpec& s, const double* o, const double* gce,
                                                   const double* gpen, T* g, const T* df = nullptr) {
  using L = MarginLanes<T>;
  using V = typename L::V;
  using D = typename L::D;
  constexpr int W = L::W;
  const double kd = static_cast<double>(k);
  const bool cp = s.kind == M_CP, poly = s.kind == M_POLY1;
  const T* cls = static_cast<const T*>(s.cls);
  // per-lane constants in the input dtype, as margin_backward_row's (computed in float64 lanes)
  D m_d, inv_d, arg_d, aux_d, top_d, gce_d, gpen_d;
  std::memcpy(&gce_d, gce, sizeof(D));
  std::memcpy(&gpen_d, gpen, sizeof(D));
  for (int l = 0; l < W; ++l) {
    const double* ol = o + l * N_STAT;
    m_d[l] = ol[S_MAX];
    inv_d[l] = ol[S_INV];
    arg_d[l] = ol[S_ARG];
    aux_d[l] = ol[S_AUX];
    top_d[l] = cp ? 0.0 : penalty_top(k, s, ol, gpen[l]);
  }
  const auto lanes = [](D v) { return __builtin_convertvector(v, V); };
  const D one_d = broadcast<D>(1.0), zero_d = {};
  // the cross entropy's factor on p − onehot(y): gce, Poly-1's gce + gpen p_y (ε(1 − p_y)'s gradient is
  // −ε p_y (onehot − p))
  const D cy_d = poly ? gce_d + gpen_d * aux_d : gce_d;
  const V m = lanes(m_d), a = lanes(cy_d * inv_d), arg = lanes(arg_d), top = lanes(top_d);
  const V live = lanes(gce_d != 0.0 || gpen_d != 0.0 ? one_d : zero_d);
  V c = {}, lse = {}, pinv = {}, scale = {}, base = {};
  if (s.kind == M_MBLS || s.kind == M_MAXSUP) c = lanes(gpen_d / kd);
  if (s.kind == M_ACLS) c = lanes(gpen_d * s.lam_neg * 2.0 / (kd - 1.0));
  if (s.kind == M_CALS) c = lanes(gpen_d / (kd * s.scale));
  if (cp) {
    lse = lanes(log_lanes(1.0 / inv_d));
    pinv = lanes(inv_d);
    scale = lanes(s.mbls_form ? gpen_d / kd : gpen_d);
    base = lanes(gce_d - gpen_d * aux_d);
  }
  const V yv = load<V>(y), zero = {}, thr = m + static_cast<T>(-s.margin);
  V pen_y = {}, p_y = {}, df_y = {};  // at the label: the penalty's share (CP: p and f'(p))
  D others = {};                      // Σ_{j≠y} exp(x_j − m)
  for (int64_t j0 = 0; j0 < k; j0 += 256) {
    const int64_t j1 = std::min<int64_t>(k, j0 + 256);
    V os = {};
    for (int64_t j = j0; j < j1; ++j) {
      __builtin_prefetch(x + j * stride + kAhead);
      __builtin_prefetch(g + j * stride + kAhead, 1);
      const V v = load<V>(x + j * stride), jv = broadcast<V>(static_cast<T>(j));
      const V ev = lanes_exp<T>(v - m);
      const auto at_y = yv == jv;
      os += at_y ? zero : ev;
      V gv;
      if (cp) {
        const V p = ev * pinv;
        V f, dfv;
        if (df != nullptr) {
          dfv = load<V>(df + j * W);
        } else {
          cp_lanes_of<T>(p, (v - m) - lse, s, f, dfv);
        }
        gv = p * (base + scale * dfv);
        p_y = at_y ? p : p_y;
        df_y = at_y ? dfv : df_y;
      } else {
        V pen;
        if (s.kind == M_MBLS) {
          pen = thr - v > zero ? c : zero;
        } else if (s.kind == M_MAXSUP) {
          pen = c;
        } else if (s.kind == M_CALS) {
          V r = (m - v) * broadcast<V>(cls[j]) + broadcast<V>(cls[k + j]);
          pen = c * (r > zero ? r : zero);
        } else if (poly) {
          pen = zero;
        } else {  // M_ACLS
          const V r = thr - v;
          pen = c * (r > zero ? r : zero);
        }
        gv = (a * ev - pen) + (arg == jv ? top : zero);
        pen_y = at_y ? pen : pen_y;
      }
      gv = live != zero ? gv : zero;
      store(g + j * stride, gv);
    }
    others += widen<D>(os);
  }
  for (int l = 0; l < W; ++l) {
    if (live[l] == T(0) || y[l] < 0) continue;
    const double* ol = o + l * N_STAT;
    const double ce = -cy_d[l] * ol[S_INV] * others[l];  // gce (p_y − 1) (Poly-1: gce + gpen p_y)
    double v;
    if (cp) {  // p_y (gce − gpen Σ p f' + scale f'(p_y)) − gce, as margin_backward_row's
      v = ce + static_cast<double>(p_y[l]) * (static_cast<double>(scale[l]) * df_y[l] - gpen[l] * ol[S_AUX]);
    } else {
      v = ce - static_cast<double>(pen_y[l]) + (y[l] == arg[l] ? top_d[l] : 0.0);
    }
    g[static_cast<int64_t>(y[l]) * stride + l] = static_cast<T>(v);
  }
}

}  // namespace torchcal
