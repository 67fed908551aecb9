// mL1-ACE (hard and soft bins) plus cross entropy in one operator (torchcal/functional/margin.py's
// ml1ace_loss for integer labels of CPU float32/float64 logits; docs/decisions.md 211-213). Included by
// fused_losses.cpp after true_class.h, whose vectorised row maximum and exponential it uses.
//
// Forward: one read of each row (max, exp(x − max), Σ), its cross entropy, and the scatter of every binned
// class's p into a (group, class, bin) table of (Σ w, Σ w·p, Σ w·y) in float64. Rows are split into
// chunks fixed by the shape (never by the thread count), each with its own table, summed in chunk order:
// the value and the gradient do not depend on the number of threads. The backward recomputes p per row,
// looks up u_ik = ∂ACE/∂p_ik from the table (the bin's sign / count, and for soft bins the membership's
// derivative) and writes grad z = g_ce (p − e_y) + p ⊙ (u − <u, p>) in the same pass.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include "layout.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace torchcal {
namespace ace {

constexpr double kFloat32Eps = 1.1920928955078125e-07;  // the reference's upper bin edge is 1 + float32 eps
constexpr int64_t kTile = 64;                            // positions of a (N, K, S) tile gathered into rows
enum Option { O_BINS, O_SOFT, O_FIRST, O_IGNORE_EMPTY, O_PER_IMAGE, O_REDUCTION, N_OPTIONS };
enum Cell { C_COUNT, C_SUM_P, C_SUM_Y, N_CELL };  // per (group, class, bin)

struct Spec {
  int64_t n, k, sp;        // logits (N, K, S), S = Π spatial sizes
  int64_t rows, groups;    // M = N·S rows (positions), G groups (images, or 1 for the pooled batch)
  int64_t per_group;       // rows of a group (M / G): each group one contiguous block
  int64_t bins, first, c;  // M bins, first binned class (1 without background), C' = K − first
  bool soft, ignore_empty;
  int64_t reduction;  // 0 none, 1 mean, 2 sum
  double lambda, empty_weight;
  bool has_ignore;
  int64_t ignore;
  int64_t chunks;  // chunks per group, each with its own partial table
  // the forward's float64 statistics, one flat tensor: tables (G, bins, C', N_CELL), present (G, C'),
  // kept rows (G), Σ cross entropy and the cross entropy's row count, then each row's max (M; the backward
  // recomputes p from it)
  int64_t table_size() const { return groups * c * bins * N_CELL; }
  int64_t stats_size() const { return table_size() + groups * c + groups + 2 + rows; }
  // one chunk's partial: its table (bins, C', N_CELL) of the entries that are not simple (Bins), the simple
  // entries' count and Σ p per class (2 C', bin 0), present (C'), kept rows, Σ cross entropy. Bin-major: the
  // scattered entries of one bin are close in memory
  int64_t part_size() const { return c * bins * N_CELL + 3 * c + 2; }
};

inline Spec make_spec(const at::Tensor& logits, const at::Tensor& targets, at::ArrayRef<double> params,
                      at::IntArrayRef options, c10::optional<int64_t> ignore_index) {
  const Layout l = loss_layout(logits, targets, "fused_ace");
  TORCH_CHECK_VALUE(params.size() == 2 && options.size() == N_OPTIONS, "fused_ace takes 2 params and ",
                    static_cast<int>(N_OPTIONS), " options");
  Spec s{};
  s.n = l.n;
  s.k = l.k;
  s.sp = l.sp;
  s.rows = s.n * s.sp;
  s.bins = options[O_BINS];
  s.soft = options[O_SOFT] != 0;
  s.first = options[O_FIRST];
  s.ignore_empty = options[O_IGNORE_EMPTY] != 0;
  s.groups = options[O_PER_IMAGE] != 0 ? s.n : 1;
  s.reduction = options[O_REDUCTION];
  TORCH_CHECK_VALUE(s.bins >= 1 && (s.first == 0 || s.first == 1) && s.reduction >= 0 && s.reduction <= 2,
                    "fused_ace: bad options");
  s.c = s.k - s.first;
  s.per_group = s.rows / s.groups;
  s.lambda = params[0];
  s.empty_weight = params[1];
  s.has_ignore = ignore_index.has_value();
  s.ignore = ignore_index.value_or(0);
  // chunks of about 1024 rows or more (the tiles of (N, K, S) inputs may cut a few short), at most 16 per group,
  // their partial tables within 8 MiB: fixed by the shape (each chunk zeroes its partial and folds its
  // intervals; the partials are summed once: decision 261)
  s.chunks = std::max<int64_t>(1, std::min<int64_t>(16, s.per_group / 1024));
  while (s.chunks > 1 && s.groups * s.chunks * s.part_size() * 8 > (int64_t{8} << 20)) --s.chunks;
  return s;
}

// the row's label, or −1 when it is ignored (or outside [0, K): counted in bad)
inline int64_t row_label(const Spec& s, int64_t y, int64_t& bad) {
  if (s.has_ignore && y == s.ignore) return -1;
  if (y < 0 || y >= s.k) {
    ++bad;
    return -1;
  }
  return y;
}

// max of a row and e = exp(x − max), returning Σ e (float64); p = e·(1/Σ) follows in Bins::scan. The same
// arithmetic forward and backward (the backward takes the forward's max), so that p, and its hard bin, is
// the same number in both
inline float row_max_of(const float* x, int64_t k) { return row_max(x, k); }
inline double row_max_of(const double* x, int64_t k) {
  double mx = x[0];
  for (int64_t j = 1; j < k; ++j) mx = mx < x[j] ? x[j] : mx;
  return mx;
}
inline double exp_of(const float* x, int64_t k, float mx, float* e) { return exp_sum_row(x, k, mx, e, nullptr); }
inline double exp_of(const double* x, int64_t k, double mx, double* e) {
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += (e[j] = std::exp(x[j] - mx));
  return sum;
}

// The bins of a row's probabilities. Most of them fall wholly into bin 0 of their class ("simple": p at or
// below the first inner edge for hard bins, below the first centre for soft bins, where the weight is 1 and
// its derivative 0): those are found and summed by vectorised loops, and only the others are binned and
// scattered one by one. Hard: b = the number of inner edges below p (torch.bucketize, right=False), a
// first guess from p·M/(1 + eps) corrected by comparisons with the edges. Soft: p between the centres of
// bins l and l + 1 with weight r on l + 1, u = clamp(p·M/(1 + eps) − 1/2, 0, M − 1), l = min(floor(u), M − 2)
// in the input dtype as the torch path, da = ∂r/∂p (0 where u is clamped, as torch's clamp); one bin: l = 0,
// r = 0 (every p simple).
// Bins is a view, trivially copyable: each parallel loop takes a local copy, whose fields the compiler keeps
// in registers across the loop's stores into the bins' sums (through the shared object it reloaded them for
// every entry); BinTables owns the tables it points into.
template <typename T>
struct Bins {
  const T* lower;  // lower[b] = bin b's lower edge (−inf for bin 0), lower[M] = +inf (hard)
  // below[i] = the number of inner edges < i/L (i = 0..L), L a power of two >= 4M: p·L is exact, so p in
  // [i/L, (i + 1)/L) has bin below[i] or, where the one edge that an interval can hold lies below p, the next
  const int32_t* below;
  int64_t n;
  bool soft;
  T scale, first_edge, lscale;
  // p is simple (wholly in bin 0, no derivative of its weight) unless v = p (hard) or p·M/(1 + eps) (soft,
  // in the input dtype) exceeds thr: the first inner edge, or the largest number below 1/2 (u >= 0); one
  // soft bin: every p. NaN is simple (its sums become NaN).
  double threshold() const {
    if (!soft) return static_cast<double>(first_edge);
    if (n == 1) return std::numeric_limits<double>::infinity();
    return static_cast<double>(std::nextafter(T(0.5), T(0)));
  }
  bool simple(T p) const { return !(static_cast<double>(soft ? p * scale : p) > threshold()); }
  // b with lower[b] < p <= lower[b + 1]: below[⌊p·L⌋], one step up where the interval's edge lies below p
  // (no branch on the data: the clamps are selects, the padded edges need no bounds tests), checked, and
  // the exact search only where the check fails (never for p in [0, 1]; NaN, which is simple, is not binned)
  __attribute__((always_inline)) int64_t hard(T p) const {
    T f = p * lscale;
    f = f > T(0) ? f : T(0);
    f = f < lscale ? f : lscale;
    int64_t b = below[static_cast<size_t>(f)];
    const T* e = lower;
    b += static_cast<int64_t>(e[b + 1] < p);
    if (static_cast<int>(!(e[b] < p)) | static_cast<int>(e[b + 1] < p)) {
      while (b > 0 && !(e[b] < p)) --b;
      while (b < n - 1 && e[b + 1] < p) ++b;
    }
    return b;
  }
  void soft_of(T p, int64_t& l, T& r, T& da) const {
    if (n == 1) {
      l = 0, r = T(0), da = T(0);
      return;
    }
    // one rounding (fused multiply-add) at every call site: the compiler may contract p·scale − 1/2 in one
    // inlined copy and not in another, and the count, Σ w y and the backward need the same r
    const T raw = std::fma(p, scale, T(-0.5));
    const T hi = static_cast<T>(n - 1);
    // clamps and selects without a branch on p (p·M near M − 1/2 is a coin flip at confident positions): u
    // equals raw exactly where raw is inside [0, M − 1], the derivative's range (NaN, never binned: 0)
    // (each select the form of one max / min instruction; std::fmin and std::fmax are library calls)
    const T low = raw > T(0) ? raw : T(0);
    const T u = low < hi ? low : hi;
    da = u == raw ? scale : T(0);
    const T below = std::floor(u);
    const T fl = below < hi - T(1) ? below : hi - T(1);
    l = static_cast<int64_t>(fl);
    r = u - fl;
  }
  // u = ∂ACE/∂p of an entry that is not simple, of class column ci (of C'), label indicator yv; pg, qg the
  // group's P and Q tables (bins, C'). Hard: its bin's P. Soft, ∂/∂p of Σ_b P_b (w_b p − w_b y) − Q_b w_b…:
  // (1 − r)P_l + r P_{l+1} + r'((P_{l+1} − P_l)(p − y) − (Q_{l+1} − Q_l))
  double u_of(T p, double yv, const double* pg, const double* qg, int64_t c, int64_t ci) const {
    if (!soft) return pg[hard(p) * c + ci];
    if (n == 1) return pg[ci];  // (one soft bin: its weight 1, no derivative, and no bin 1 to read)
    int64_t l;
    T r, da;
    soft_of(p, l, r, da);
    const int64_t i0 = l * c + ci, i1 = i0 + c;
    return (1.0 - r) * pg[i0] + r * pg[i1] +
           static_cast<double>(da) * ((pg[i1] - pg[i0]) * (static_cast<double>(p) - yv) - (qg[i1] - qg[i0]));
  }
  // the threshold in the dtype (the same comparisons: both sides of threshold() are exact in it)
  T threshold_t() const { return static_cast<T>(threshold()); }
  // One vectorised pass over a row's count entries in the dtype's lanes: p = e·inv written over e (one
  // multiply, the rounding of every other use), list[0..m) = the indices of those that are not simple
  // (returns m); with zacc (count entries of the dtype) the simple ones' p added per class (their count is the
  // kept rows' less the others'; the caller adds zacc into its float64 sums every few rows); with pz (bin 0's
  // gradient row, in the dtype) *dot = Σ pz·p, its lanes' sums added in float64
  // (with ``given``, e already holds p: it is read, not scaled or written)
  int64_t scan(T* e, T inv, int64_t count, int32_t* list, T* zacc, const T* pz = nullptr, double* dot = nullptr,
               bool given = false) const {
    // the widest vectors, then one of 32 and one of 16 bytes (a row of K = 10 floats is no 16-lane vector),
    // then scalars
    const T thr = threshold_t();
    int64_t m = 0, j = 0;
    double sum = 0.0;
    scan_span<kWideBytes>(e, inv, count, list, zacc, pz, given, thr, j, m, sum);
    if constexpr (kWideBytes > 32) scan_span<32>(e, inv, count, list, zacc, pz, given, thr, j, m, sum);
    if constexpr (kWideBytes > 16) scan_span<16>(e, inv, count, list, zacc, pz, given, thr, j, m, sum);
    for (; j < count; ++j) {
      const T p = given ? e[j] : e[j] * inv;
      if (!given) e[j] = p;
      const bool other = (soft ? p * scale : p) > thr;
      if (zacc != nullptr && !other) zacc[j] += p;
      if (pz != nullptr) sum += static_cast<double>(pz[j] * p);
      list[m] = static_cast<int32_t>(j);
      m += other;
    }
    if (dot != nullptr) *dot = sum;
    return m;
  }
  // scan's vectors of Bytes from j while a whole one fits (j and m advanced; the lanes of Σ pz·p added into
  // sum in float64, lane by lane)
  template <int Bytes>
  __attribute__((always_inline)) void scan_span(T* e, T inv, int64_t count, int32_t* list, T* zacc, const T* pz,
                                                bool given, T thr, int64_t& j, int64_t& m, double& sum) const {
    constexpr int W = Vec<T, Bytes>::width;
    using V = typename Vec<T, Bytes>::type;
    if (j + W > count) return;
    const V thr_v = broadcast<V>(thr), zero = {};
    const V sc = broadcast<V>(scale), iv = broadcast<V>(inv);
    V acc = {};
    for (; j + W <= count; j += W) {
      const V pv = given ? load<V>(e + j) : load<V>(e + j) * iv;
      if (!given) store(e + j, pv);
      const V v = soft ? pv * sc : pv;
      const uint64_t bits = compare_mask<T, Bytes>(v, thr_v);
      if (zacc != nullptr) store(zacc + j, load<V>(zacc + j) + (v > thr_v ? zero : pv));
      if (pz != nullptr) acc += load<V>(pz + j) * pv;
      m = append_lanes<W>(list, m, bits, static_cast<int32_t>(j));
    }
    if (pz != nullptr)
      for (int l = 0; l < W; ++l) sum += static_cast<double>(acc[l]);
  }
};

template <typename T>
struct BinTables {
  std::vector<T> lower;
  std::vector<int32_t> below;
  Bins<T> bins;
  BinTables(const T* e, int64_t n, bool soft) {
    bins.n = n;
    bins.soft = soft;
    bins.scale = static_cast<T>(static_cast<double>(n) / (1.0 + kFloat32Eps));
    bins.first_edge = n > 1 && !soft ? e[0] : std::numeric_limits<T>::infinity();
    bins.lscale = T(0);
    bins.lower = nullptr;
    bins.below = nullptr;
    if (soft) return;
    lower.assign(static_cast<size_t>(n + 1), std::numeric_limits<T>::infinity());
    lower[0] = -std::numeric_limits<T>::infinity();
    for (int64_t b = 1; b < n; ++b) lower[b] = e[b - 1];
    int64_t l = 1024;
    while (l < 4 * n && l < (int64_t{1} << 22)) l *= 2;
    const T lscale = static_cast<T>(l);
    below.assign(static_cast<size_t>(l + 1), 0);
    int64_t b = 0;
    for (int64_t i = 0; i <= l; ++i) {
      const T at = static_cast<T>(i) / lscale;  // exact
      while (b < n - 1 && e[b] < at) ++b;
      below[static_cast<size_t>(i)] = static_cast<int32_t>(b);
    }
    bins.lscale = lscale;
    bins.lower = lower.data();
    bins.below = below.data();
  }
  BinTables(const BinTables&) = delete;  // (bins points into this object's vectors)
  BinTables& operator=(const BinTables&) = delete;
};

// g_j = p_j (u_j + c) in the dtype's lanes (u = bin 0's P of the class in the dtype, c = gce − <u, p> rounded to
// it): two roundings of p (|u| + |c|) at most, where the torch path's float32 softmax backward, p ⊙ (g − <g, p>),
// has the same two
template <typename T, int Bytes>
inline void grad_span(const T* u, const T* p, int64_t k, T c, T* g, int64_t& j) {
  constexpr int W = Vec<T, Bytes>::width;
  using V = typename Vec<T, Bytes>::type;
  const V cv = broadcast<V>(c);
  for (; j + W <= k; j += W) store(g + j, load<V>(p + j) * (load<V>(u + j) + cv));
}
template <typename T>
inline void grad_row(const T* u, const T* p, int64_t k, T c, T* g) {
  int64_t j = 0;  // (the widest vectors, then 32 and 16 bytes, as Bins::scan)
  grad_span<T, kWideBytes>(u, p, k, c, g, j);
  if constexpr (kWideBytes > 32) grad_span<T, 32>(u, p, k, c, g, j);
  if constexpr (kWideBytes > 16) grad_span<T, 16>(u, p, k, c, g, j);
  for (; j < k; ++j) g[j] = p[j] * (u[j] + c);
}

// per-thread buffers of a row
template <typename T>
struct RowBuffers {
  std::vector<T> xb, gb, e;
  std::vector<int32_t> list;
  std::vector<double> u;
  std::vector<T> zacc;  // the forward's simple entries' Σ p per class, in the dtype, for up to kFlushRows rows
  int64_t since = 0;    // rows added into zacc since it was last flushed
  // (the list: room for a vector's lanes past its end, Bins::scan)
  explicit RowBuffers(int64_t k)
      : e(static_cast<size_t>(k)), list(static_cast<size_t>(k + 16)), u(static_cast<size_t>(k)),
        zacc(static_cast<size_t>(k), T(0)) {}
  // zacc's first c sums added into the float64 sums (and zacc cleared)
  void flush(double* sums, int64_t c) {
    for (int64_t j = 0; j < c; ++j) {
      sums[j] += static_cast<double>(zacc[j]);
      zacc[j] = T(0);
    }
    since = 0;
  }
};

// rows whose simple entries' p are summed in the dtype before they are added into the float64 sums: a float32
// sum of at most 16 numbers in [0, 1] is within 16 ulps of their sum's magnitude (the torch path sums every
// row in the dtype), in place of a float64 read-modify-write of every entry
constexpr int64_t kFlushRows = 16;

// fn(row, x_row, grad_row) over rows [m0, m1): rows of a (N, K) tensor in place; positions of a (N, K, S)
// tensor gathered in tiles of up to 64 rows (the gradient rows scattered back when grad is not null)
template <typename T, typename Fn>
void for_rows(const Spec& s, const T* x, T* grad, int64_t m0, int64_t m1, std::vector<T>& xb, std::vector<T>& gb,
              const Fn& fn) {
  const int64_t k = s.k, sp = s.sp;
  if (sp == 1) {
    for (int64_t m = m0; m < m1; ++m) fn(m, x + m * k, grad == nullptr ? nullptr : grad + m * k);
    return;
  }
  xb.resize(static_cast<size_t>(kTile * k));
  if (grad != nullptr) gb.resize(static_cast<size_t>(kTile * k));
  for (int64_t m = m0; m < m1;) {
    const int64_t img = m / sp, pos = m % sp;
    const int64_t w = std::min({kTile, m1 - m, sp - pos});
    const T* src = x + img * k * sp + pos;
    transpose(src, sp, k, w, xb.data(), k);
    for (int64_t t = 0; t < w; ++t) fn(m + t, xb.data() + t * k, grad == nullptr ? nullptr : gb.data() + t * k);
    if (grad != nullptr) {
      T* dst = grad + img * k * sp + pos;
      transpose(gb.data(), k, w, k, dst, sp);
    }
    m += w;
  }
}

// cell[C_COUNT] += w, cell[C_SUM_P] += wp as one 16-byte load and store: the next entry of the same cell then
// reads what the store forwards (a 16-byte read of two 8-byte stores waits for them to reach the cache)
inline void add_count_p(double* cell, double w, double wp) {
  using D2 = typename Vec<double, 16>::type;
  const D2 v = load<D2>(cell + C_COUNT) + D2{w, wp};
  store(cell + C_COUNT, v);
}

// ACE of cell (g, c) from its bins (tab: its bin 0, the next bins C'·N_CELL apart) (the unweighted mean of |Σ w p − Σ w y| / Σ w over the occupied bins) and
// the number of occupied bins
inline double cell_ace(const Spec& s, const double* tab, int64_t& occupied) {
  double gap = 0.0;
  occupied = 0;
  for (int64_t b = 0; b < s.bins; ++b) {
    const double* q = tab + b * s.c * N_CELL;
    if (s.soft ? q[C_COUNT] >= s.empty_weight : q[C_COUNT] > 0.0) {
      gap += std::abs(q[C_SUM_P] - q[C_SUM_Y]) / q[C_COUNT];
      ++occupied;
    }
  }
  return gap / static_cast<double>(std::max<int64_t>(occupied, 1));
}

struct Forward {
  at::Tensor loss;
  at::Tensor stats;
  at::Tensor probs;  // every kept row's p ((N, K) inputs, when asked: the whole-loss node's backward reads it)
};

// -- (N, K, S) inputs: tiles of positions, vectorised across positions ------------------------------------
// Each class of an image is a contiguous plane of S positions: a tile of up to 64 positions is computed class
// by class with the positions in vector lanes (no transposes; the gradient is written in place). Tiles are
// fixed by the image (position 64a on), so forward and backward compute every p the same way. float32 (N, K)
// rows of few classes (rows_by_planes) are one image of N positions whose tiles are transposed in (and their
// gradient out) through per-thread buffers.

constexpr int64_t kPlane = 64;
constexpr int64_t kFlushTiles = 4;  // tiles whose simple entries' Σ p are summed in the dtype (forward_planes)

template <typename T>
struct PlaneBuffers {
  std::vector<T> e, mx, inv;
  std::vector<double> sum, lse, u, gce, dot, zc, zsd;
  std::vector<T> zs, cpos;  // the lanes' sums per class and lane for a few tiles (added into zsd: Σ p of the
                            // simple entries, or Σ p, Σ u, Σ u·p of soft interval 0); the backward's gce − dot
                            // per position, in the dtype
  int64_t since = 0;        // tiles added into zs since it was last flushed
  std::vector<int64_t> y;
  std::vector<int32_t> list;  // the tile's entries that are not simple, j·kPlane + t (room for a vector's lanes)
  std::vector<T> xr;          // (N, K) rows (rows_by_planes): the tile's logits, class j at j·kPlane
  PlaneBuffers(int64_t k, int64_t c)
      : e(static_cast<size_t>(k * kPlane)), mx(kPlane), inv(kPlane), sum(kPlane), lse(kPlane),
        u(kPlane), gce(kPlane), dot(kPlane),
        zc(static_cast<size_t>(c * Vec<T, kWideBytes>::width)), zsd(static_cast<size_t>(3 * zc.size())),
        zs(zsd.size()), cpos(kPlane),
        y(kPlane),
        list(static_cast<size_t>(k * kPlane + 16)), xr(static_cast<size_t>(k * kPlane)) {}
};

// e[t] = exp(x[t] − mx[t]), sum[t] += e[t] for t < w
inline void exp_lanes(const float* x, const float* mx, float* e, double* sum, int64_t w) {
  using V = typename Vec<float, kWideBytes>::type;
  constexpr int L = Vec<float, kWideBytes>::width;
  int64_t t = 0;
  for (; t + L <= w; t += L) {
    const V v = exp_nonpositive<kWideBytes>(load<V>(x + t) - load<V>(mx + t));
    store(e + t, v);
  }
  for (; t < w; ++t) e[t] = std::exp(x[t] - mx[t]);
  for (t = 0; t < w; ++t) sum[t] += e[t];
}
inline void exp_lanes(const double* x, const double* mx, double* e, double* sum, int64_t w) {
  for (int64_t t = 0; t < w; ++t) sum[t] += (e[t] = std::exp(x[t] - mx[t]));
}

// p of the tile's w positions into b.e (class j at j·kPlane); the max computed, or the forward's (saved)
template <typename T>
inline void plane_softmax(const T* x, int64_t sp, int64_t k, int64_t w, const double* saved, PlaneBuffers<T>& b) {
  T* mx = b.mx.data();
  if (saved != nullptr) {
    for (int64_t t = 0; t < w; ++t) mx[t] = static_cast<T>(saved[t]);
  } else {
    for (int64_t t = 0; t < w; ++t) mx[t] = x[t];
    for (int64_t j = 1; j < k; ++j) {
      const T* xj = x + j * sp;
      for (int64_t t = 0; t < w; ++t) mx[t] = mx[t] < xj[t] ? xj[t] : mx[t];
    }
  }
  double* sum = b.sum.data();
  std::fill(sum, sum + w, 0.0);
  T* e = b.e.data();
  for (int64_t j = 0; j < k; ++j) exp_lanes(x + j * sp, mx, e + j * kPlane, sum, w);
  T* inv = b.inv.data();
  for (int64_t t = 0; t < w; ++t) inv[t] = static_cast<T>(1.0 / sum[t]);
  for (int64_t j = 0; j < k; ++j) {
    T* ej = e + j * kPlane;
    for (int64_t t = 0; t < w; ++t) ej[t] *= inv[t];
  }
}

// p of the tile's ignored positions set to 0 (y[t] < 0): their logits may be NaN or −inf (masked padding). A p
// of 0 is simple (bin 0) and adds 0 to the sums, its dot and gradient are 0 (y[t] = −1, gce 0): the passes
// below need no kept flag. A pass over the classes only for the tiles that hold one.
template <typename T>
inline void zero_ignored(int64_t k, int64_t w, PlaneBuffers<T>& b) {
  for (int64_t t = 0; t < w; ++t) {
    if (b.y[t] >= 0) continue;
    for (int64_t j = 0; j < k; ++j) b.e[j * kPlane + t] = T(0);
  }
}

// -- ∂ACE/∂p of a tile's entries in vector lanes (the backward) ---------------------------------------------
// Every entry of a class row of a tile belongs to one class, so its u = ∂ACE/∂p (the label's term aside) is a
// function of p alone with at most M + 1 pieces: hard bins u = P_b of p's bin b; soft bins, with l, r and r'
// = da of Bins::soft_of, u = (1 − r)P_l + r P_{l+1} + da((P_{l+1} − P_l)(p − y) − (Q_{l+1} − Q_l)). Where u
// is not clamped (da = s, the soft scale), s·p = l + r + 1/2 up to the rounding of the position's fused
// multiply-add, so for y = 0 u = γ_l + δ_l r with γ_l = P_l + (l + 1/2)(P_{l+1} − P_l) − s(Q_{l+1} − Q_l) (u
// at r = 0, bin l's centre) and δ_l = 2(P_{l+1} − P_l); clamped above (r = 1, da = 0) u = P_{M−1}, below (r =
// 0, da = 0) u = P_0. So a class has a table of M + 1 pairs (index l, M − 1 above, M below; hard: P_b and 0),
// rounded to the dtype once per group, and u = γ[i] + δ[i]·r is two lookups and one multiply-add per lane:
// with float32 and M + 1 <= 32 a two-register permute of each table (AVX-512) or four one-register permutes
// and three blends (AVX2), else a load per lane. The
// rounding of the position (|r| < 1, the dropped term (P_{l+1} − P_l)·(s·p − l − r − 1/2) at most
// 2⁻²⁴·M·|P_{l+1} − P_l| in float32, 2⁻⁵³·M·|P_{l+1} − P_l| in float64) and of the tables (one rounding of γ
// and δ) replace the float64 arithmetic of Bins::u_of; the label's u (its −s(P_{l+1} − P_l) term, and the
// cancellation of p − 1) is taken in float64 per position.
#if defined(__AVX2__)
constexpr bool kHasAvx2 = true;
#else
constexpr bool kHasAvx2 = false;
#endif
constexpr int64_t kLaneTable = 32;  // a class's table: at least 32 entries (2 AVX-512 or 4 AVX2 float32 registers)

inline int64_t lane_table_size(int64_t bins) { return std::max<int64_t>(kLaneTable, bins + 1); }

// the hard bins' lower edges (−inf, the inner edges, +inf) padded with +inf to a class table's size
template <typename T>
std::vector<T> lane_lower(const BinTables<T>& tables, int64_t n_bins, bool soft) {
  std::vector<T> lower(static_cast<size_t>(lane_table_size(n_bins)), std::numeric_limits<T>::infinity());
  if (!soft) std::copy(tables.lower.begin(), tables.lower.end(), lower.begin());
  return lower;
}

// the tables of one group's classes, (C', 2, size) of the dtype: (γ, δ) (soft) or (P, 0) (hard)
template <typename T>
void fill_lane_tables(const Spec& s, const Bins<T>& bins, const double* pg, const double* qg, T* out) {
  const int64_t size = lane_table_size(s.bins), m = s.bins, c = s.c;
  const double sc = static_cast<double>(bins.scale);
  for (int64_t ci = 0; ci < c; ++ci) {
    T* gam = out + ci * 2 * size;
    T* del = gam + size;
    std::fill(gam, gam + 2 * size, T(0));
    const auto p = [&](int64_t b) { return pg[b * c + ci]; };
    if (!s.soft || m == 1) {
      for (int64_t b = 0; b < m; ++b) gam[b] = static_cast<T>(p(b));
      if (s.soft) gam[1] = static_cast<T>(p(0));  // (one soft bin: every position is clamped below)
      continue;
    }
    for (int64_t l = 0; l + 1 < m; ++l) {
      const double d = p(l + 1) - p(l), e = qg[(l + 1) * c + ci] - qg[l * c + ci];
      gam[l] = static_cast<T>(p(l) + (static_cast<double>(l) + 0.5) * d - sc * e);
      del[l] = static_cast<T>(2.0 * d);
    }
    gam[m - 1] = static_cast<T>(p(m - 1));
    gam[m] = static_cast<T>(p(0));
  }
}

// tab[i] for the lanes' indices i (exact small integers in the dtype's lanes)
template <typename T, int Bytes>
__attribute__((always_inline)) inline typename Vec<T, Bytes>::type lookup(const T* tab, typename Vec<T, Bytes>::type i,
                                                                          bool permute) {
  using V = typename Vec<T, Bytes>::type;
  using I = typename Vec<T, Bytes>::int32;
  const I idx = __builtin_convertvector(i, I);
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value && Bytes == 64) {
    if (permute) return (V)_mm512_permutex2var_ps(_mm512_loadu_ps(tab), (__m512i)idx, _mm512_loadu_ps(tab + 16));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same<T, float>::value && Bytes == 32) {
    if (permute) {  // each quarter of the table permuted by the index's low 3 bits, chosen by its bits 3 and 4
      const __m256i ix = (__m256i)idx;
      const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28));  // (blendv reads the sign bit)
      const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(ix, 27));
      const __m256 q01 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(tab), ix),
                                          _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 8), ix), b3);
      const __m256 q23 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 16), ix),
                                          _mm256_permutevar8x32_ps(_mm256_loadu_ps(tab + 24), ix), b3);
      return (V)_mm256_blendv_ps(q01, q23, b4);
    }
  }
#endif
  (void)permute;
  V out;
  for (int l = 0; l < Vec<T, Bytes>::width; ++l) out[l] = tab[idx[l]];
  return out;
}

// a·b + c with one rounding in every lane (as std::fma in Bins::soft_of: the scalar and the lanes' bins see the
// same position)
template <typename T, int Bytes>
__attribute__((always_inline)) inline typename Vec<T, Bytes>::type fma_lanes(typename Vec<T, Bytes>::type a,
                                                                             typename Vec<T, Bytes>::type b,
                                                                             typename Vec<T, Bytes>::type c) {
  using V = typename Vec<T, Bytes>::type;
#if defined(__AVX512F__)
  if constexpr (Bytes == 64) {
    if constexpr (std::is_same<T, float>::value) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
    else return (V)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
  }
#endif
#if defined(__FMA__)
  if constexpr (Bytes == 32) {
    if constexpr (std::is_same<T, float>::value) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
    else return (V)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
  }
#endif
  V out;
  for (int l = 0; l < Vec<T, Bytes>::width; ++l) out[l] = std::fma(a[l], b[l], c[l]);
  return out;
}

// Bins::hard of every lane (out of line: the lanes' path rarely takes it)
template <typename T, int Bytes>
__attribute__((noinline)) typename Vec<T, Bytes>::type hard_lanes(const Bins<T>& bins, typename Vec<T, Bytes>::type p) {
  typename Vec<T, Bytes>::type b;
  for (int l = 0; l < Vec<T, Bytes>::width; ++l) b[l] = static_cast<T>(bins.hard(p[l]));
  return b;
}

// the hard bin of the lanes p (Bins::hard): b = ⌊p·M/(1 + eps)⌋ clamped to [0, M − 1], checked against its
// edges (lower: lane_lower's), two lookups; Bins::hard for the lanes of a vector where the check fails (p
// within a few ulps of an edge with torch.linspace edges, and NaN; any sorted edges stay exact)
template <typename T, int Bytes>
__attribute__((always_inline)) inline typename Vec<T, Bytes>::type hard_bin_lanes(const Bins<T>& bins, const T* lower,
                                                                                  typename Vec<T, Bytes>::type p,
                                                                                  bool permute) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int W = Vec<T, Bytes>::width;
  const V zero = {}, one = broadcast<V>(T(1)), top = broadcast<V>(static_cast<T>(bins.n - 1));
  V f = p * broadcast<V>(bins.scale);
  f = f > zero ? f : zero;  // (NaN: 0)
  f = f < top ? f : top;
  const V b = __builtin_convertvector(__builtin_convertvector(f, typename Vec<T, Bytes>::int32), V);
  const V lo = lookup<T, Bytes>(lower, b, permute), hi = lookup<T, Bytes>(lower, b + one, permute);
  constexpr uint64_t all = (uint64_t{1} << W) - 1;
  if ((compare_mask<T, Bytes>(p, lo) & ~compare_mask<T, Bytes>(p, hi) & all) != all) return hard_lanes<T, Bytes>(bins, p);
  return b;
}

// the soft position of the lanes p (Bins::soft_of, M >= 2): raw = fma(p, s, −1/2), u = raw clamped to
// [0, M − 1] (NaN: 0), l = min(⌊u⌋, M − 2); r = u − l
template <typename T, int Bytes>
__attribute__((always_inline)) inline void soft_lanes(const Bins<T>& bins, typename Vec<T, Bytes>::type p,
                                                      typename Vec<T, Bytes>::type& raw,
                                                      typename Vec<T, Bytes>::type& u,
                                                      typename Vec<T, Bytes>::type& l) {
  using V = typename Vec<T, Bytes>::type;
  const V zero = {}, hi = broadcast<V>(static_cast<T>(bins.n - 1));
  raw = fma_lanes<T, Bytes>(p, broadcast<V>(bins.scale), broadcast<V>(T(-0.5)));
  const V low = raw > zero ? raw : zero;
  u = low < hi ? low : hi;
  l = __builtin_convertvector(__builtin_convertvector(u, typename Vec<T, Bytes>::int32), V);  // (u >= 0)
  l = l < hi - broadcast<V>(T(1)) ? l : hi - broadcast<V>(T(1));
}

// u of the lanes p of one class with y = 0 (tab: its (γ, δ) or (P, 0) table)
template <typename T, int Bytes>
__attribute__((always_inline)) inline typename Vec<T, Bytes>::type lane_u(const Bins<T>& bins, const T* tab, int64_t size,
                                                                          const T* lower,
                                                                          typename Vec<T, Bytes>::type p,
                                                                          bool permute) {
  using V = typename Vec<T, Bytes>::type;
  const V zero = {};
  if (!bins.soft) return lookup<T, Bytes>(tab, hard_bin_lanes<T, Bytes>(bins, lower, p, permute), permute);
  if (bins.n == 1) return lookup<T, Bytes>(tab, broadcast<V>(T(1)), permute);
  V raw, u, l;
  soft_lanes<T, Bytes>(bins, p, raw, u, l);
  const V i = u == raw ? l : (raw > zero ? broadcast<V>(static_cast<T>(bins.n - 1)) : broadcast<V>(static_cast<T>(bins.n)));
  return fma_lanes<T, Bytes>(lookup<T, Bytes>(tab + size, i, permute), u - l, lookup<T, Bytes>(tab, i, permute));
}

// bits of the lanes [t, t + W) of p that are not simple (Bins::scan; an ignored position's p is 0, simple), in
// the dtype's lanes; with zs (per class and lane, the dtype) the simple lanes' p added
template <typename T>
inline uint64_t plane_block(const Bins<T>& bins, const T* p, T thr, T* zs) {
  using V = typename Vec<T, kWideBytes>::type;
  const V thr_v = broadcast<V>(thr), zero = {};
  const V pv = load<V>(p);
  const V v = bins.soft ? pv * broadcast<V>(bins.scale) : pv;
  if (zs != nullptr) store(zs, load<V>(zs) + (v > thr_v ? zero : pv));
  return compare_mask<T, kWideBytes>(v, thr_v);
}

// One class row p of a tile (w positions): its entries that are not simple appended to list as base + t
// (lane order; returns the new length); with zs / zc (that class's lanes) the simple entries' p added and the
// others counted (an ignored position's p is 0 here: simple, adding 0)
template <typename T>
inline int64_t list_class(const Bins<T>& bins, const T* p, int64_t w, T thr, int32_t base, int32_t* list,
                          int64_t n_list, T* zs, double* zc) {
  constexpr int W = Vec<T, kWideBytes>::width;
  int64_t t = 0;
  for (; t + W <= w; t += W) {
    const uint64_t bits = plane_block(bins, p + t, thr, zs);
    if (zc != nullptr) zc[0] += __builtin_popcountll(bits);  // the others: not in bin 0's count
    n_list = append_lanes<W>(list, n_list, bits, base + static_cast<int32_t>(t));
  }
  for (; t < w; ++t) {  // the tail: the same criterion lane by lane
    const bool other = !bins.simple(p[t]);
    if (zs != nullptr && !other) zs[0] += p[t];
    if (zc != nullptr) zc[0] += other;
    list[n_list] = base + static_cast<int32_t>(t);
    n_list += other;
  }
  return n_list;
}

// Soft bins (M >= 2): one class row p of a tile (w positions) whose entries in interval 0 — position u (that
// of Bins::soft_of: the fused multiply-add, clamped to [0, M − 1]) below 1, the entries
// below the first centre (u = 0) among them — are summed per lane in zs (three rows of the class's lanes: Σ p,
// Σ u, Σ u·p); the others are appended to list as base + t and counted in zc (an ignored position's p is 0:
// u = 0, adding 0)
template <typename T>
inline int64_t list_class_soft(const Bins<T>& bins, const T* p, int64_t w, int32_t base, int32_t* list,
                               int64_t n_list, T* zs, double* zc) {
  constexpr int W = Vec<T, kWideBytes>::width;
  using V = typename Vec<T, kWideBytes>::type;
  const V zero = {}, one = broadcast<V>(T(1)), below_one = broadcast<V>(std::nextafter(T(1), T(0)));
  int64_t t = 0;
  for (; t + W <= w; t += W) {
    const V pv = load<V>(p + t);
    V raw, u, l;  // (u's clamp at M − 1 >= 1 leaves u < 1 as it is; l is not used)
    soft_lanes<T, kWideBytes>(bins, pv, raw, u, l);
    const auto in0 = u < one;
    store(zs, load<V>(zs) + (in0 ? pv : zero));
    store(zs + W, load<V>(zs + W) + (in0 ? u : zero));
    store(zs + 2 * W, load<V>(zs + 2 * W) + (in0 ? u * pv : zero));
    const uint64_t bits = compare_mask<T, kWideBytes>(u, below_one);
    zc[0] += __builtin_popcountll(bits);
    n_list = append_lanes<W>(list, n_list, bits, base + static_cast<int32_t>(t));
  }
  for (; t < w; ++t) {  // the tail: the same arithmetic lane by lane
    const T raw = std::fma(p[t], bins.scale, T(-0.5));
    const T u = raw > T(0) ? raw : T(0);
    const bool other = !(u < T(1));
    if (!other) zs[0] += p[t], zs[W] += u, zs[2 * W] += u * p[t];
    zc[0] += other;
    list[n_list] = base + static_cast<int32_t>(t);
    n_list += other;
  }
  return n_list;
}

// A listed entry of soft bins: position u = l + r in interval l (weight 1 − r on bin l, r on bin l + 1), its
// (1, u, p, u·p) added into the interval's sums in float64 (one 32-byte read-modify-write, where the bins'
// weights took two dependent ones; u·p of float32 u and p is exact). fold_intervals makes the bins' sums:
// bin l gains (1 + l)·n − Σu and (1 + l)·Σp − Σu·p, bin l + 1 gains Σu − l·n and Σu·p − l·Σp.
template <typename T>
__attribute__((always_inline)) inline void add_interval(double* cell, double l, T r, T p) {
  using V4 = typename Vec<double, 32>::type;
  const double u = l + static_cast<double>(r), pd = static_cast<double>(p);
  store(cell, load<V4>(cell) + V4{1.0, u, pd, u * pd});
}
// (between left zeroed for the next chunk: every write into an interval counts its entries in v[0], so an
// interval with v[0] = 0 holds zeros and is skipped; the others are folded and cleared)
inline void fold_intervals(double* between, int64_t c, int64_t n_bins, double* tab) {
  const int64_t stride = c * N_CELL;
  for (int64_t ci = 0; ci < c; ++ci) {
    for (int64_t l = 0; l + 1 < n_bins; ++l) {
      double* v = between + (ci * n_bins + l) * 4;
      if (v[0] == 0.0) continue;
      const double ld = static_cast<double>(l);
      double* cell = tab + l * stride + ci * N_CELL;
      cell[C_COUNT] += (1.0 + ld) * v[0] - v[1];
      cell[C_SUM_P] += (1.0 + ld) * v[2] - v[3];
      cell[stride + C_COUNT] += v[1] - ld * v[0];
      cell[stride + C_SUM_P] += v[3] - ld * v[2];
      v[0] = v[1] = v[2] = v[3] = 0.0;
    }
  }
}

// (N, K) float32 rows of at most kRowLaneClasses classes, pooled in one group, take the tiles' path 64 rows at
// a time (transposed; decision 267)
template <typename T>
inline bool rows_by_planes(const Spec& s) {
  return std::is_same<T, float>::value && s.sp == 1 && s.groups == 1 && s.k <= kRowLaneClasses;
}

// Whether the logits take the tiles (forward_planes / backward_planes): (N, K, S) inputs, and rows_by_planes's
// rows; the forward and the backward ask this one question
inline bool takes_planes(const at::Tensor& x, const Spec& s) {
  return s.sp > 1 || (x.scalar_type() == at::kFloat && rows_by_planes<float>(s));
}

template <typename T>
void forward_planes(const Spec& s, const T* x, const int64_t* tp, const Bins<T>& shared_bins, double* parts,
                    double* row_max, T* ce_rows, std::atomic<int64_t>& n_bad) {
  constexpr int W = Vec<double, kWideBytes>::width;
  constexpr int WT = Vec<T, kWideBytes>::width;  // (the simple entries' sums: lanes of the dtype)
  const int64_t k = s.k, first = s.first, c = s.c;
  const int64_t stride = c * N_CELL;
  // (N, K) rows (rows_by_planes): one image of N positions, each tile's rows transposed into b.xr
  const bool by_rows = s.sp == 1;
  const int64_t sp = by_rows ? s.n : s.sp, images = by_rows ? 1 : s.n;
  const int64_t per_image = (sp + kPlane - 1) / kPlane;
  const int64_t group_tiles = s.groups == 1 ? images * per_image : per_image;
  const T thr = shared_bins.threshold_t();
  const bool soft = s.soft && s.bins > 1;  // (one soft bin: every entry is simple, as with hard bins)
  at::parallel_for(0, s.groups * s.chunks, 1, [&](int64_t begin, int64_t end) {
    const Bins<T> bins = shared_bins;  // (the local copy: see Bins)
    PlaneBuffers<T> b(k, c);
    // soft bins: the listed entries' (n, Σu, Σp, Σu·p) per (class, interval l) of the chunk (add_interval)
    std::vector<double> between(static_cast<size_t>(soft ? c * s.bins * 4 : 0));
    double* const between_p = between.data();
    const int64_t n_bins = s.bins;  // (locals: the loop's stores would make it reload them from the captures)
    int64_t bad = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / s.chunks, r = item % s.chunks;
      const int64_t q0 = g * group_tiles + group_tiles * r / s.chunks;
      const int64_t q1 = g * group_tiles + group_tiles * (r + 1) / s.chunks;
      double* tab = parts + item * s.part_size();
      std::fill(tab, tab + s.part_size(), 0.0);  // (zeroed by its thread: the pages it then uses)
      double* zero = tab + c * s.bins * N_CELL;
      double* present = zero + 2 * c;
      double& kept = present[c];
      double& ce_sum = present[c + 1];
      std::fill(b.zc.begin(), b.zc.end(), 0.0);
      std::fill(b.zsd.begin(), b.zsd.end(), 0.0);
      std::fill(b.zs.begin(), b.zs.end(), T(0));
      b.since = 0;
      // zs (the dtype) added into zsd (float64) every kFlushTiles tiles: a lane then holds at most 16 float32
      // numbers in [0, 1] (64 / WT per tile), within 16 ulps of their magnitudes' sum (the torch path sums
      // every position in the dtype)
      const auto flush = [&]() {
        for (size_t i = 0; i < b.zs.size(); ++i) {
          b.zsd[i] += static_cast<double>(b.zs[i]);
          b.zs[i] = T(0);
        }
        b.since = 0;
      };
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t img = q / per_image, pos = (q % per_image) * kPlane, w = std::min(kPlane, sp - pos);
        const int64_t m0 = img * sp + pos;
        const T* xt = x + img * k * sp + pos;
        int64_t xs = sp;  // (from one class of the tile to the next)
        if (by_rows) {
          transpose(x + m0 * k, k, w, k, b.xr.data(), kPlane);  // (class j of row t at j·kPlane + t)
          xt = b.xr.data();
          xs = kPlane;
        } else {
          prefetch_runs(xt + kPlane, sp, k, kPlane, false);  // the next tile
        }
        for (int64_t t = 0; t < w; ++t) {
          b.y[t] = row_label(s, tp[m0 + t], bad);
        }
        plane_softmax(xt, xs, k, w, nullptr, b);
        zero_ignored(k, w, b);
        // log Σ of the tile's positions in float64 lanes (~1 ulp, as the margin lanes); the padded lanes
        // hold Σ = 1
        for (int64_t t = w; t < kPlane; ++t) b.sum[t] = 1.0;
        for (int64_t t = 0; t < kPlane; t += W) {
          const auto v = log_lanes(load<typename Vec<double, kWideBytes>::type>(b.sum.data() + t));
          store(b.lse.data() + t, v);
        }
        for (int64_t t = 0; t < w; ++t) {
          const int64_t y = b.y[t];
          // (an ignored position's max too: the backward takes its exps again, whose arguments x − max must
          // stay in the vectorised exp's domain, x − max <= 0)
          row_max[m0 + t] = static_cast<double>(b.mx[t]);
          if (y < 0) {
            if (ce_rows != nullptr) ce_rows[m0 + t] = T(0);
            continue;
          }
          const double ce = (static_cast<double>(b.mx[t]) - static_cast<double>(xt[y * xs + t])) + b.lse[t];
          if (ce_rows != nullptr) ce_rows[m0 + t] = static_cast<T>(ce);
          ce_sum += ce;
          kept += 1.0;
        }
        // the entries that are not simple listed class by class (lane order within a class), then binned
        int32_t* list = b.list.data();
        int64_t n_list = 0;
        for (int64_t j = first; j < k; ++j) {
          const int64_t ci = j - first;
          const T* p = b.e.data() + j * kPlane;
          const int32_t base = static_cast<int32_t>(j * kPlane);
          if (soft)
            n_list = list_class_soft(bins, p, w, base, list, n_list, b.zs.data() + 3 * ci * WT, b.zc.data() + ci * WT);
          else
            n_list = list_class(bins, p, w, thr, base, list, n_list, b.zs.data() + ci * WT, b.zc.data() + ci * WT);
        }
        if (++b.since == kFlushTiles) flush();
        for (int64_t i = 0; i < n_list; ++i) {
          const int64_t li = static_cast<uint32_t>(list[i]), j = li / kPlane;
          const T pj = b.e[li];
          double* cq = tab + (j - first) * N_CELL;
          if (!bins.soft) {
            cq += bins.hard(pj) * stride;
            add_count_p(cq, 1.0, static_cast<double>(pj));
          } else {
            int64_t l;
            T rr, da;
            bins.soft_of(pj, l, rr, da);
            add_interval(between_p + ((j - first) * n_bins + l) * 4, static_cast<double>(l), rr, pj);
          }
        }
        for (int64_t t = 0; t < w; ++t) {  // the label's class: Σ w y of its bins
          const int64_t y = b.y[t];
          if (y < first) continue;
          present[y - first] += 1.0;
          const T py = b.e[y * kPlane + t];
          double* cell = tab + (y - first) * N_CELL;
          if (soft) {  // (the count's weights, 1 − r and r in float64 as its intervals' sums)
            int64_t l;
            T rr, da;
            bins.soft_of(py, l, rr, da);
            cell[l * stride + C_SUM_Y] += 1.0 - static_cast<double>(rr);
            cell[(l + 1) * stride + C_SUM_Y] += rr;
          } else {
            cell[(bins.simple(py) ? 0 : bins.hard(py)) * stride + C_SUM_Y] += 1.0;
          }
        }
      }
      flush();
      for (int64_t ci = 0; ci < c; ++ci) {  // the lanes' sums in lane order; their count is the kept positions'
        const double n0 = kept - b.zc[ci * WT];  // less the others'
        if (!soft) {  // bin 0
          zero[ci] += n0;
          for (int l = 0; l < WT; ++l) zero[c + ci] += b.zsd[ci * WT + l];
          continue;
        }
        double* cell = between_p + ci * n_bins * 4;  // soft interval 0: (n, Σu, Σp, Σu·p)
        cell[0] += n0;
        for (int l = 0; l < WT; ++l) {
          cell[2] += b.zsd[3 * ci * WT + l];
          cell[1] += b.zsd[3 * ci * WT + WT + l];
          cell[3] += b.zsd[3 * ci * WT + 2 * WT + l];
        }
      }
      if (soft) fold_intervals(between_p, c, n_bins, tab);
    }
    if (bad) n_bad += bad;
  });
}

// g[t] = p[t]·(u[t] + c[t]) for t < w (distinct arrays: vectorised without alias checks)
template <typename T>
inline void plane_scale(const T* __restrict p, const T* __restrict u, const T* __restrict c, int64_t w,
                        T* __restrict g) {
  for (int64_t t = 0; t < w; ++t) g[t] = p[t] * (u[t] + c[t]);
}

// the backward of a tile: u_jt = ∂ACE/∂p of every entry in vector lanes (the label's in float64), then the
// gradient in place
template <typename T>
void backward_planes(const Spec& s, const T* x, T* grad, const int64_t* tp, const Bins<T>& shared_bins,
                     const double* pt, const double* qt, const double* row_max, const double* gp, int64_t gstride,
                     double ce_div, const T* lower) {
  constexpr int W = Vec<T, kWideBytes>::width;
  using V = typename Vec<T, kWideBytes>::type;
  static_assert(kPlane % W == 0, "a tile is whole vectors");
  const int64_t k = s.k, first = s.first, c = s.c;
  const bool by_rows = s.sp == 1;  // (rows_by_planes: as forward_planes, the gradient transposed back)
  const int64_t sp = by_rows ? s.n : s.sp, images = by_rows ? 1 : s.n;
  const int64_t per_image = (sp + kPlane - 1) / kPlane;
  const int64_t size = lane_table_size(s.bins);
  const bool permute = std::is_same<T, float>::value && (kWideBytes == 64 || (kWideBytes == 32 && kHasAvx2)) &&
                       s.bins + 1 <= kLaneTable;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (k * kPlane));
  at::parallel_for(0, images * per_image, grain, [&](int64_t begin, int64_t end) {
    const Bins<T> bins = shared_bins;
    PlaneBuffers<T> b(k, c);
    std::vector<T> gr(static_cast<size_t>(by_rows ? k * kPlane : 0));  // (rows: the tile's gradient)
    std::vector<T> tables(static_cast<size_t>(c * 2 * size));
    std::vector<T> uf(static_cast<size_t>(k * kPlane), T(0));  // u of every entry (0 for the unbinned background)
    int64_t table_group = -1;
    for (int64_t q = begin; q < end; ++q) {
      const int64_t img = q / per_image, pos = (q % per_image) * kPlane, w = std::min(kPlane, sp - pos);
      const int64_t m0 = img * sp + pos;
      const T* xt = x + img * k * sp + pos;
      T* gt = grad + img * k * sp + pos;
      int64_t xs = sp;  // (from one class of the tile to the next, in xt and gt)
      if (by_rows) {
        transpose(x + m0 * k, k, w, k, b.xr.data(), kPlane);
        xt = b.xr.data();
        gt = gr.data();
        xs = kPlane;
      } else {
        prefetch_runs(xt + kPlane, sp, k, kPlane, false);  // the next tile, and its gradient for writing
        prefetch_runs(gt + kPlane, sp, k, kPlane, true);
      }
      for (int64_t t = 0; t < w; ++t) {
        const int64_t y = tp[m0 + t];
        const bool keep = !(s.has_ignore && y == s.ignore);
        b.y[t] = keep ? y : -1;
        b.gce[t] = keep ? gp[(m0 + t) * gstride] / ce_div : 0.0;
      }
      plane_softmax(xt, xs, k, w, row_max + m0, b);
      zero_ignored(k, w, b);
      if (w < kPlane)  // (the lanes past the image: p = 0, their u and gradient unused)
        for (int64_t j = 0; j < k; ++j) std::fill(b.e.begin() + j * kPlane + w, b.e.begin() + (j + 1) * kPlane, T(0));
      const int64_t group = s.groups == 1 ? 0 : img;
      const double* pg = pt + group * s.bins * c;
      const double* qg = s.soft ? qt + group * s.bins * c : nullptr;  // (no Q table for hard bins)
      if (group != table_group) {
        fill_lane_tables(s, bins, pg, qg, tables.data());
        table_group = group;
      }
      // u of every binned entry, and dot = Σ_j u p per position in the dtype's lanes (a sum of K products, as
      // the torch path's float32 softmax backward)
      T* cz = b.cpos.data();
      std::fill(cz, cz + kPlane, T(0));
      for (int64_t j = first; j < k; ++j) {
        const T* tab = tables.data() + (j - first) * 2 * size;
        const T* pj = b.e.data() + j * kPlane;
        T* uj = uf.data() + j * kPlane;
        for (int64_t t = 0; t < kPlane; t += W) {
          const V pv = load<V>(pj + t);
          const V u = lane_u<T, kWideBytes>(bins, tab, size, lower, pv, permute);
          store(uj + t, u);
          store(cz + t, load<V>(cz + t) + u * pv);
        }
      }
      // the label's entry in float64: its u (with its −s(P_{l+1} − P_l) term) in place of the lanes' in the dot,
      // then c = gce − dot in the dtype
      for (int64_t t = 0; t < w; ++t) {
        const int64_t y = b.y[t];
        double dot = static_cast<double>(cz[t]);
        if (y >= first) {
          const T py = b.e[y * kPlane + t];
          b.u[t] = bins.u_of(py, 1.0, pg, qg, c, y - first);
          dot += (b.u[t] - static_cast<double>(uf[y * kPlane + t])) * static_cast<double>(py);
        } else {
          b.u[t] = 0.0;
        }
        b.dot[t] = dot;
        cz[t] = static_cast<T>(b.gce[t] - dot);
      }
      // g = gce (p − e_y) + p (u − dot): every entry p (u + gce − dot) in the dtype's lanes (two roundings of
      // p (|u| + |gce − dot|), as the torch path's p ⊙ (g − <g, p>)), then the label's entry (p − 1 cancels:
      // float64)
      for (int64_t j = 0; j < k; ++j) plane_scale(b.e.data() + j * kPlane, uf.data() + j * kPlane, cz, w, gt + j * xs);
      for (int64_t t = 0; t < w; ++t) {
        const int64_t y = b.y[t];
        if (y < 0) continue;
        const double pd = static_cast<double>(b.e[y * kPlane + t]);
        gt[y * xs + t] = static_cast<T>(b.gce[t] * (pd - 1.0) + pd * (b.u[t] - b.dot[t]));
      }
      if (by_rows) {
        transpose(gt, kPlane, k, w, grad + m0 * k, k);
      }
    }
  });
}

// probs: where every kept row's p is written (the whole-loss node's backward then reads it instead of taking
// its exps again: decision 222) or null
template <typename T>
void forward_rows(const Spec& s, const T* x, const int64_t* tp, const Bins<T>& shared_bins, double* parts, double* row_max,
                  T* ce_rows, std::atomic<int64_t>& n_bad, T* probs = nullptr) {
  const int64_t items = s.groups * s.chunks, k = s.k, first = s.first, c = s.c;
  const int64_t stride = c * N_CELL;  // from one bin of a class to the next
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const Bins<T> bins = shared_bins;
    RowBuffers<T> w(k);
    // soft bins (M >= 2; one soft bin lists nothing): the listed entries' (n, Σu, Σp, Σu·p) per (class,
    // interval) of the chunk (add_interval)
    const bool soft = s.soft && s.bins > 1;
    std::vector<double> between(static_cast<size_t>(soft ? c * s.bins * 4 : 0));
    double* const between_p = between.data();
    const int64_t n_bins = s.bins;
    int64_t bad = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / s.chunks, r = item % s.chunks;
      const int64_t m0 = g * s.per_group + s.per_group * r / s.chunks;
      const int64_t m1 = g * s.per_group + s.per_group * (r + 1) / s.chunks;
      double* tab = parts + item * s.part_size();
      std::fill(tab, tab + s.part_size(), 0.0);  // (zeroed by its thread: the pages it then uses)
      double* zero = tab + c * s.bins * N_CELL;
      double* present = zero + 2 * c;
      double& kept = present[c];
      double& ce_sum = present[c + 1];
      for_rows<T>(s, x, nullptr, m0, m1, w.xb, w.gb, [&](int64_t m, const T* row, T*) {
        const int64_t y = row_label(s, tp[m], bad);
        if (y < 0) {
          if (ce_rows != nullptr) ce_rows[m] = T(0);
          row_max[m] = 0.0;
          return;
        }
        const T mx = row_max_of(row, k);
        row_max[m] = static_cast<double>(mx);
        T* e = probs != nullptr ? probs + m * k : w.e.data();
        const double sum = exp_of(row, k, mx, e);
        const double ce = (static_cast<double>(mx) - static_cast<double>(row[y])) + std::log(sum);
        if (ce_rows != nullptr) ce_rows[m] = static_cast<T>(ce);
        ce_sum += ce;
        kept += 1.0;
        int32_t* list = w.list.data();
        const T inv = static_cast<T>(1.0 / sum);
        if (probs != nullptr)
          for (int64_t j = 0; j < first; ++j) e[j] *= inv;  // (the unbinned background's p too)
        const int64_t n_other = bins.scan(e + first, inv, c, list, w.zacc.data());
        if (++w.since == kFlushRows) w.flush(zero + c, c);
        const T* p = e + first;  // (now p)
        for (int64_t i = 0; i < n_other; ++i) zero[list[i]] -= 1.0;  // bin 0's count: kept rows less these
        if (!bins.soft) {
          for (int64_t i = 0; i < n_other; ++i) {
            const int64_t j = list[i];
            double* q = tab + bins.hard(p[j]) * stride + j * N_CELL;
            add_count_p(q, 1.0, static_cast<double>(p[j]));
          }
          if (y >= first) {  // the label's class: Σ y of its bin (y = 1 there, 0 in every other class)
            const T py = p[y - first];
            tab[(bins.simple(py) ? 0 : bins.hard(py)) * stride + (y - first) * N_CELL + C_SUM_Y] += 1.0;
          }
        } else {
          int64_t l;
          T r, da;
          for (int64_t i = 0; i < n_other; ++i) {
            const int64_t j = list[i];
            bins.soft_of(p[j], l, r, da);
            add_interval(between_p + (j * n_bins + l) * 4, static_cast<double>(l), r, p[j]);
          }
          if (y >= first) {  // the label's class: Σ w y of its bins (y = 1 there, 0 in every other class)
            const T py = p[y - first];
            double* q = tab + (y - first) * N_CELL;
            if (bins.simple(py)) {
              q[C_SUM_Y] += 1.0;
            } else {
              bins.soft_of(py, l, r, da);
              q[l * stride + C_SUM_Y] += 1.0 - static_cast<double>(r);
              q[(l + 1) * stride + C_SUM_Y] += r;
            }
          }
        }
        if (y >= first) present[y - first] += 1.0;
      });
      w.flush(zero + c, c);
      for (int64_t j = 0; j < c; ++j) zero[j] += kept;  // bin 0's count: every kept row but the others
      if (soft) fold_intervals(between_p, c, n_bins, tab);
    }
    if (bad) n_bad += bad;
  });
}

// the ACE of each cell (G, C') into ace, from the statistics; returns the number of covered groups
inline int64_t aces(const Spec& s, const double* st, std::vector<double>& ace, std::vector<int64_t>& occupied) {
  const double* present = st + s.table_size();
  const double* kept = present + s.groups * s.c;
  ace.assign(static_cast<size_t>(s.groups * s.c), 0.0);
  occupied.assign(static_cast<size_t>(s.groups * s.c), 0);
  int64_t covered = 0;
  for (int64_t g = 0; g < s.groups; ++g) {
    covered += kept[g] > 0.0;
    for (int64_t c = 0; c < s.c; ++c) {
      const int64_t i = g * s.c + c;
      const double a = cell_ace(s, st + (g * s.bins * s.c + c) * N_CELL, occupied[i]);
      ace[i] = s.ignore_empty && !(present[i] > 0.0) ? 0.0 : a;
    }
  }
  return covered;
}

inline Forward forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& edges,
                       at::ArrayRef<double> params, at::IntArrayRef options, c10::optional<int64_t> ignore_index,
                       bool keep_probs = false) {
  const Spec s = make_spec(logits, targets, params, options, ignore_index);
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const at::Tensor ed = edges.to(logits.scalar_type()).contiguous();
  TORCH_CHECK_VALUE(s.soft || ed.numel() == s.bins - 1, "`edges` must hold the n_bins - 1 inner edges");
  double* row_max = nullptr;
  const int64_t* tp = t.data_ptr<int64_t>();
  at::Tensor stats = at::zeros({s.stats_size()}, x.options().dtype(at::kDouble));
  // one partial per chunk (each zeroed by the thread that fills it)
  at::Tensor parts = at::empty({s.groups * s.chunks * s.part_size()}, stats.options());
  at::Tensor loss;
  at::Tensor ce_rows;
  if (s.reduction == 0) ce_rows = at::empty(targets.sizes(), logits.options());
  std::atomic<int64_t> n_bad{0};
  row_max = stats.data_ptr<double>() + s.stats_size() - s.rows;
  // (the tiles, of (N, K, S) inputs and of rows_by_planes's rows, take their exps again in the backward: an
  // array of the logits' size costs more there in first-touch page faults than the exps, as the batch-term
  // node's lanes, decision 220)
  at::Tensor probs;
  const bool planes = takes_planes(x, s);
  if (keep_probs && !planes) probs = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_ace", [&] {
    const BinTables<scalar_t> tables(s.soft ? nullptr : ed.data_ptr<scalar_t>(), s.bins, s.soft);
    const Bins<scalar_t>& bins = tables.bins;
    scalar_t* ce = s.reduction == 0 ? ce_rows.data_ptr<scalar_t>() : nullptr;
    if (planes)
      forward_planes<scalar_t>(s, x.data_ptr<scalar_t>(), tp, bins, parts.data_ptr<double>(), row_max, ce, n_bad);
    else
      forward_rows<scalar_t>(s, x.data_ptr<scalar_t>(), tp, bins, parts.data_ptr<double>(), row_max, ce, n_bad,
                             probs.defined() ? probs.data_ptr<scalar_t>() : nullptr);
  });
  if (n_bad.load() > 0) raise_bad_label(tp, s.rows, s.k, s.has_ignore, s.ignore);
  // the chunks' partials summed in chunk order into the statistics
  double* st = stats.data_ptr<double>();
  const double* pp = parts.data_ptr<double>();
  const int64_t table = s.c * s.bins * N_CELL;
  double* present = st + s.table_size();
  double* kept = present + s.groups * s.c;
  double* totals = kept + s.groups;
  // (each number of the tables sums its chunks in order, bin 0's counts and Σ p each chunk's table then its
  // simple entries, as one loop would; ranges of the numbers in parallel)
  const int64_t bin0 = s.c * N_CELL;
  at::parallel_for(0, s.groups * table, 2048, [&](int64_t begin, int64_t end) {
    while (begin < end) {  // (one group at a time)
      const int64_t g = begin / table, i0 = begin % table, i1 = std::min(table, i0 + (end - begin));
      double* out = st + g * table;
      for (int64_t r = 0; r < s.chunks; ++r) {
        const double* part = pp + (g * s.chunks + r) * s.part_size();
        for (int64_t i = i0; i < i1; ++i) out[i] += part[i];
        const double* zero = part + table;  // the simple entries: bin 0
        for (int64_t i = i0; i < std::min(i1, bin0); ++i) {
          const int64_t kind = i % N_CELL;
          if (kind != C_SUM_Y) out[i] += zero[(kind == C_SUM_P ? s.c : 0) + i / N_CELL];
        }
      }
      begin += i1 - i0;
    }
  });
  for (int64_t g = 0; g < s.groups; ++g) {
    for (int64_t r = 0; r < s.chunks; ++r) {
      const double* part = pp + (g * s.chunks + r) * s.part_size();
      const double* rest = part + table + 2 * s.c;
      for (int64_t c = 0; c < s.c; ++c) present[g * s.c + c] += rest[c];
      kept[g] += rest[s.c];
      totals[0] += rest[s.c + 1];
      totals[1] += rest[s.c];
    }
  }
  std::vector<double> ace;
  std::vector<int64_t> occupied;
  const int64_t covered = aces(s, st, ace, occupied);
  if (s.reduction == 1) {
    double sum = 0.0;
    for (int64_t g = 0; g < s.groups; ++g)
      if (kept[g] > 0.0)
        for (int64_t c = 0; c < s.c; ++c) sum += ace[g * s.c + c];
    // no kept row: 0/0 = NaN, as the torch path
    const double value =
        totals[0] / totals[1] + s.lambda * (sum / static_cast<double>(covered * s.c));
    loss = at::scalar_tensor(value, logits.options());
  } else {
    std::vector<double> term(static_cast<size_t>(s.groups));
    for (int64_t g = 0; g < s.groups; ++g) {
      double sum = 0.0;
      for (int64_t c = 0; c < s.c; ++c) sum += ace[g * s.c + c];
      term[g] = s.lambda * (sum / static_cast<double>(s.c));
    }
    if (s.reduction == 0) {
      loss = ce_rows;
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_ace_none", [&] {
        scalar_t* lp = loss.data_ptr<scalar_t>();
        for (int64_t m = 0; m < s.rows; ++m) {
          if (!(s.has_ignore && tp[m] == s.ignore)) lp[m] += static_cast<scalar_t>(term[m / s.per_group]);
        }
      });
    } else {
      double value = totals[0];
      for (int64_t g = 0; g < s.groups; ++g) value += term[g] * kept[g];
      loss = at::scalar_tensor(value, logits.options());
    }
  }
  return {loss, stats, probs};
}

// probs: the forward's kept p (keep_probs) or undefined (the exps are taken again)
inline at::Tensor backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& targets,
                           const at::Tensor& edges, const at::Tensor& stats, at::ArrayRef<double> params,
                           at::IntArrayRef options, c10::optional<int64_t> ignore_index,
                           const at::Tensor& probs = at::Tensor()) {
  const Spec s = make_spec(logits, targets, params, options, ignore_index);
  TORCH_CHECK_VALUE(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.numel() == s.stats_size(),
                    "`stats` must be the forward's float64 statistics");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const at::Tensor ed = edges.to(logits.scalar_type()).contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  const double* st = stats.data_ptr<double>();
  const double* present = st + s.table_size();
  const double* kept = present + s.groups * s.c;
  const double* totals = kept + s.groups;
  std::vector<double> ace;
  std::vector<int64_t> occupied;
  const int64_t covered = aces(s, st, ace, occupied);
  // the incoming gradient of each row's cross entropy, and of each cell's ACE (coef)
  at::Tensor per_row;
  double single = 0.0, ce_div = 1.0;
  const double* gp = &single;
  int64_t stride = 0;
  std::vector<double> coef(static_cast<size_t>(s.groups * s.c), 0.0);
  if (s.reduction == 0) {
    per_row = grad_loss.to(at::kDouble).contiguous();
    TORCH_CHECK_VALUE(per_row.numel() == s.rows, "`grad_loss` must have one entry per row");
    gp = per_row.data_ptr<double>();
    stride = 1;
    std::vector<double> group_sum(static_cast<size_t>(s.groups), 0.0);
    for (int64_t m = 0; m < s.rows; ++m)
      if (!(s.has_ignore && tp[m] == s.ignore)) group_sum[m / s.per_group] += gp[m];
    for (int64_t i = 0; i < s.groups * s.c; ++i)
      coef[i] = s.lambda * group_sum[i / s.c] / static_cast<double>(s.c);
  } else {
    single = grad_loss.item<double>();
    if (s.reduction == 1) ce_div = totals[1];
    for (int64_t i = 0; i < s.groups * s.c; ++i) {
      const double g = kept[i / s.c];
      if (s.reduction == 1)
        coef[i] = g > 0.0 ? s.lambda * single / static_cast<double>(covered * s.c) : 0.0;
      else
        coef[i] = s.lambda * single * g / static_cast<double>(s.c);
    }
  }
  // per (group, class, bin): P = A·sign(Σ w p − Σ w y)/Σ w and Q = A·gap/Σ w with A = coef / occupied bins,
  // 0 for an empty bin or a cell that counts 0 (ignore_empty_classes); laid out as the table, (G, bins, C')
  const int64_t cells = s.groups * s.bins * s.c;
  std::vector<double> pt(static_cast<size_t>(cells), 0.0), qt(static_cast<size_t>(s.soft ? cells : 0), 0.0);
  for (int64_t i = 0; i < s.groups * s.c; ++i) {
    if (s.ignore_empty && !(present[i] > 0.0)) continue;
    const double a = coef[i] / static_cast<double>(std::max<int64_t>(occupied[i], 1));
    const int64_t g = i / s.c, c = i % s.c;
    for (int64_t b = 0; b < s.bins; ++b) {
      const int64_t at = (g * s.bins + b) * s.c + c;
      const double* q = st + at * N_CELL;
      if (!(s.soft ? q[C_COUNT] >= s.empty_weight : q[C_COUNT] > 0.0)) continue;
      const double d = q[C_SUM_P] - q[C_SUM_Y];
      pt[at] = a * (d > 0.0 ? 1.0 : (d < 0.0 ? -1.0 : 0.0)) / q[C_COUNT];
      if (s.soft) qt[at] = a * (std::abs(d) / q[C_COUNT]) / q[C_COUNT];
    }
  }
  const double* row_max = st + s.stats_size() - s.rows;
  at::Tensor grad = at::empty(x.sizes(), x.options());
  const int64_t k = s.k, first = s.first, c = s.c;
  const bool planes = takes_planes(x, s);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_ace_backward", [&] {
    using T = scalar_t;
    const BinTables<T> tables(s.soft ? nullptr : ed.data_ptr<T>(), s.bins, s.soft);
    const Bins<T>& shared_bins = tables.bins;
    if (planes) {
      const std::vector<T> lower = lane_lower(tables, s.bins, s.soft);
      backward_planes<T>(s, x.data_ptr<T>(), grad.data_ptr<T>(), tp, shared_bins, pt.data(), qt.data(), row_max, gp,
                         stride, ce_div, lower.data());
      return;
    }
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / k);
    T* kept_p = probs.defined() ? probs.data_ptr<T>() : nullptr;
    // bin 0's P of every group and class in the dtype: the u of the simple entries in the row's lanes
    std::vector<T> p0(static_cast<size_t>(s.groups * c));
    for (int64_t g = 0; g < s.groups; ++g)
      for (int64_t j = 0; j < c; ++j) p0[g * c + j] = static_cast<T>(pt[g * s.bins * c + j]);
    at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
      const Bins<T> bins = shared_bins;
      RowBuffers<T> w(k);
      for_rows<T>(s, x.data_ptr<T>(), grad.data_ptr<T>(), begin, end, w.xb, w.gb, [&](int64_t m, const T* row, T* gr) {
        const bool keep = !(s.has_ignore && tp[m] == s.ignore);
        if (!keep) {
          std::fill(gr, gr + k, T(0));
          return;
        }
        const int64_t y = tp[m];
        const double gce = gp[m * stride] / ce_div;
        const bool given = kept_p != nullptr;
        T* e = given ? kept_p + m * k : w.e.data();
        const T inv = given ? T(1) : static_cast<T>(1.0 / exp_of(row, k, static_cast<T>(row_max[m]), e));
        if (!given)
          for (int64_t j = 0; j < first; ++j) e[j] *= inv;
        const int64_t at = (m / s.per_group) * s.bins * c;
        const double* pg = pt.data() + at;
        const T* pz = p0.data() + (m / s.per_group) * c;  // u of the simple entries: bin 0's P of their class
        int32_t* list = w.list.data();
        double* v = w.u.data();  // u of the others, in list order
        double dot = 0.0;        // Σ u p: bin 0's, corrected below for the others
        const int64_t n_other = bins.scan(e + first, inv, c, list, nullptr, pz, &dot, given);
        const T* p = e + first;
        const double* qg = s.soft ? qt.data() + at : nullptr;  // (no Q table for hard bins)
        for (int64_t i = 0; i < n_other; ++i) {
          const int64_t j = list[i];
          v[i] = bins.u_of(p[j], j + first == y ? 1.0 : 0.0, pg, qg, c, j);
          dot += (v[i] - static_cast<double>(pz[j])) * static_cast<double>(p[j]);
        }
        // g = gce (p − e_y) + p (u − dot): the unbinned background (u = 0), the binned classes with bin 0's u,
        // then the others and the label's entry rewritten with theirs
        for (int64_t j = 0; j < first; ++j) {
          const double pj = static_cast<double>(e[j]);
          gr[j] = static_cast<T>(gce * pj - pj * dot);
        }
        grad_row<T>(pz, p, c, static_cast<T>(gce - dot), gr + first);
        double uy = y >= first ? static_cast<double>(pz[y - first]) : 0.0;
        for (int64_t i = 0; i < n_other; ++i) {
          const int64_t j = list[i];
          const double pj = static_cast<double>(p[j]);
          gr[first + j] = static_cast<T>(gce * pj + pj * (v[i] - dot));
          if (j + first == y) uy = v[i];
        }
        const double py = static_cast<double>(e[y]);
        gr[y] = static_cast<T>(gce * (py - 1.0) + py * (uy - dot));
      });
    });
  });
  return grad;
}

class FusedAce : public torch::autograd::Function<FusedAce> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const at::Tensor& edges, at::ArrayRef<double> params, at::IntArrayRef options,
                            c10::optional<int64_t> ignore_index, bool keep) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // (keep: a backward will run, for which the row path's p are kept, one array of the logits' size, as
    // cross entropy keeps its log-probabilities; the tiles keep none)
    Forward f = ace::forward(logits, targets, edges, params, options, ignore_index, keep);
    ctx->save_for_backward({logits, targets, edges, f.stats, f.probs});
    ctx->saved_data["params"] = std::vector<double>(params.begin(), params.end());
    ctx->saved_data["options"] = std::vector<int64_t>(options.begin(), options.end());
    ctx->saved_data["has_ignore"] = ignore_index.has_value();
    ctx->saved_data["ignore"] = ignore_index.value_or(0);
    return f.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "the fused CPU mL1-ACE loss is differentiable once only; for higher-order gradients run it with "
                "torchcal.functional.use_cpu_extension(False)");
    const auto saved = ctx->get_saved_variables();
    const std::vector<double> params = ctx->saved_data["params"].toDoubleVector();
    const std::vector<int64_t> options = ctx->saved_data["options"].toIntVector();
    c10::optional<int64_t> ignore;
    if (ctx->saved_data["has_ignore"].toBool()) ignore = ctx->saved_data["ignore"].toInt();
    at::Tensor grad = ace::backward(grads[0], saved[0], saved[1], saved[2], saved[3], params, options, ignore, saved[4]);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace ace

inline at::Tensor fused_ace_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& edges,
                                at::ArrayRef<double> params, at::IntArrayRef options,
                                c10::optional<int64_t> ignore_index) {
  return ace::forward(logits, targets, edges, params, options, ignore_index).loss;
}

inline at::Tensor fused_ace_autograd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& edges,
                                     at::ArrayRef<double> params, at::IntArrayRef options,
                                     c10::optional<int64_t> ignore_index) {
  const bool keep = at::GradMode::is_enabled() && logits.requires_grad();
  return ace::FusedAce::apply(logits, targets, edges, params, options, ignore_index, keep);
}

// the same loss as two plain operators for torch.compile: the forward returns the statistics the backward reads
inline std::tuple<at::Tensor, at::Tensor> fused_ace_fwd_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                            const at::Tensor& edges, at::ArrayRef<double> params,
                                                            at::IntArrayRef options,
                                                            c10::optional<int64_t> ignore_index) {
  ace::Forward f = ace::forward(logits, targets, edges, params, options, ignore_index);
  return {f.loss, f.stats};
}

inline at::Tensor fused_ace_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& targets,
                                    const at::Tensor& edges, const at::Tensor& stats, at::ArrayRef<double> params,
                                    at::IntArrayRef options, c10::optional<int64_t> ignore_index) {
  check_backward_labels(logits, targets, ignore_index, "fused_ace_bwd");
  return ace::backward(grad_loss, logits, targets, edges, stats, params, options, ignore_index);
}

}  // namespace torchcal
