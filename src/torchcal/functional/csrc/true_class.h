// The per-row arithmetic of torchcal's fused focal-family losses: plain C++17 (no torch), included by
// fused_losses.cpp. Same conventions as the torch path (torchcal/functional/_true_class.py with the losses'
// weight functions), per-sample float64 arithmetic (differences: docs/decisions.md 38).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace torchcal {

enum Flag { F_UPPER, F_DUAL, F_MARGIN, F_NLL, F_CAL, F_CAL_LAMBDA, F_BRIER, N_FLAGS };
// columns of the per-sample output (N, N_OUT) float64
enum Out { O_LOSS, O_CT, O_CJ, O_J, O_SQ, O_INV, N_OUT };

// rows per parallel task: enough entries that a thread hand-off pays for itself
int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(k, 1)); }

// (N, K) float32 rows of at most this many classes are transposed into the lane / tile kernels of the
// (N, K, S) layout, a block of rows at a time (the batch terms, the margin family, mL1-ACE: decisions 218,
// 265, 267): walked on its own, a short row is mostly scalar tails and per-row work (at K = 10 about four
// scalar exps and a log per row)
constexpr int64_t kRowLaneClasses = 32;

struct Spec {
  const double* gammas;
  int64_t n_gammas;
  const double* thresholds;
  int64_t n_thresholds;
  const double* sample;  // nullptr: γ from the schedule
  bool upper, dual, margin, nll, cal;
  double cal_lambda, brier;
};

// SIMD vectors through the GCC/Clang vector extensions. The library is compiled for the machine that
// builds it (-march=native on x86-64; the library name includes the CPU, see _extension.py), so the wide
// vectors are as wide as its ISA: 64 bytes with AVX-512, 32 with AVX, else 16 (SSE2, NEON). Rows are walked
// with wide vectors, then 16-byte ones, then scalars: short rows (K = 10) keep their 4-lane path.
#if defined(__AVX512F__)
constexpr int kWideBytes = 64;
#elif defined(__AVX__)
constexpr int kWideBytes = 32;
#else
constexpr int kWideBytes = 16;
#endif

template <typename T, int Bytes>
struct Vec {
  typedef T type __attribute__((vector_size(Bytes)));
  typedef int32_t int32 __attribute__((vector_size(Bytes * 4 / sizeof(T))));
  static constexpr int width = Bytes / sizeof(T);
};

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// v into p[0], p[1], ...: a store of the element type (its alias set; unaligned), not a memcpy. A memcpy store
// may alias any object, so the compiler reloads every pointer and scalar that a loop keeps in memory (a
// lambda's captures, say) after each one.
template <typename V, typename T>
inline void store(T* p, V v) {
  static_assert(std::is_same<typename std::remove_cv<typename std::remove_reference<decltype(v[0])>::type>::type,
                             T>::value,
                "store: the vector's element type must be the pointer's");
  typedef T U __attribute__((vector_size(sizeof(V)), aligned(alignof(T))));
  *reinterpret_cast<U*>(p) = v;
}

template <typename V, typename T>
inline V broadcast(T x) {
  V v = {};
  return v + x;
}

// dst[c · dst_stride + r] = src[r · src_stride + c] for r < rows, c < cols: the copies between a layout's rows
// and a kernel's lanes (a block of (N, K) rows into class-major tiles and the gradient back; a tile of (N, K,
// S) positions into rows). float32 with AVX moves 8 × 8 blocks through registers (8 loads, 24 shuffles, 8
// stores, where the scalar copy takes 64 loads and 64 strided stores), the edges entry by entry; only the
// order of the copies changes, never a value.
#if defined(__AVX__)
inline void transpose8x8(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ss);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // rows i, i+1 interleaved: columns 0, 1 | 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {  // four rows' column c in one 128-bit lane
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // rows 0-3 and 4-7 of columns c and c + 4
    _mm256_storeu_ps(dst + c * ds, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ds, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#endif

template <typename T>
inline void transpose(const T* src, int64_t src_stride, int64_t rows, int64_t cols, T* dst, int64_t dst_stride) {
  int64_t r0 = 0;
#if defined(__AVX__)
  if constexpr (std::is_same<T, float>::value) {
    for (; r0 + 8 <= rows; r0 += 8) {
      int64_t c0 = 0;
      for (; c0 + 8 <= cols; c0 += 8)
        transpose8x8(src + r0 * src_stride + c0, src_stride, dst + c0 * dst_stride + r0, dst_stride);
      for (int64_t c = c0; c < cols; ++c)
        for (int64_t r = r0; r < r0 + 8; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
    }
  }
#endif
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
}

// lanes [From, From + sizeof...(I)) of v as a vector of that many lanes: a shuffle, where a copy through memory
// made GCC keep a folded accumulator in memory inside the loop that fills it
template <int From, typename T, typename V, size_t... I>
inline typename Vec<T, sizeof...(I) * sizeof(T)>::type lanes_of(V v, std::index_sequence<I...>) {
  return typename Vec<T, sizeof...(I) * sizeof(T)>::type{v[I + From]...};
}

// a vector folded in halves down to 16 bytes with ``op`` (lane-wise sum, max, min): log2 steps instead of a
// sequential pass over up to 16 lanes, which at K = 100 costs as much as the row's arithmetic
template <typename T, int Bytes, typename Op>
inline typename Vec<T, 16>::type fold(typename Vec<T, Bytes>::type v, Op op) {
  if constexpr (Bytes == 16) {
    return v;
  } else {
    constexpr int H = Vec<T, Bytes / 2>::width;
    const auto half = std::make_index_sequence<H>{};
    return fold<T, Bytes / 2>(op(lanes_of<0, T>(v, half), lanes_of<H, T>(v, half)), op);
  }
}

struct Add {
  template <typename V>
  V operator()(V a, V b) const {
    return a + b;
  }
};
struct Max {  // a lane that compares false (NaN) keeps ``a``
  template <typename V>
  V operator()(V a, V b) const {
    return a < b ? b : a;
  }
};
struct Min {  // a lane that compares false (NaN) keeps ``a``
  template <typename V>
  V operator()(V a, V b) const {
    return b < a ? b : a;
  }
};

// lanes [j, stop) of a row, stop − j a multiple of 2W: the largest entry strictly below ``below`` (or floor)
template <typename T, int Bytes>
inline T masked_max_span(const T* row, int64_t j, int64_t stop, T below, T floor, T best) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int W = Vec<T, Bytes>::width;
  if (j >= stop) return best;
  const V lim = broadcast<V>(below), low = broadcast<V>(floor);
  V a0 = low, a1 = low;  // two accumulators: the max latency is hidden
  for (; j < stop; j += 2 * W) {
    const V v0 = load<V>(row + j), v1 = load<V>(row + j + W);
    const V c0 = v0 < lim ? v0 : low;
    const V c1 = v1 < lim ? v1 : low;
    a0 = a0 < c0 ? c0 : a0;
    a1 = a1 < c1 ? c1 : a1;
  }
  const auto m = fold<T, Bytes>(a0 < a1 ? a1 : a0, Max{});
  for (int l = 0; l < Vec<T, 16>::width; ++l) best = best < m[l] ? m[l] : best;
  return best;
}

// bit l set where lane l of v is greater than (Equal: equal to) e, false for NaN: one compare and one
// move-mask (AVX-512: mask-register) instruction on x86, where a mask reduced in portable vector code and
// then tested took about six; lane by lane elsewhere
template <typename T, int Bytes, bool Equal = false>
inline uint64_t compare_mask(typename Vec<T, Bytes>::type v, typename Vec<T, Bytes>::type e) {
#if defined(__AVX512F__)
  if constexpr (Bytes == 64 && std::is_same_v<T, float>) {
    return _mm512_cmp_ps_mask((__m512)v, (__m512)e, Equal ? _CMP_EQ_OQ : _CMP_GT_OQ);
  } else if constexpr (Bytes == 64 && std::is_same_v<T, double>) {
    return _mm512_cmp_pd_mask((__m512d)v, (__m512d)e, Equal ? _CMP_EQ_OQ : _CMP_GT_OQ);
  }
#endif
#if defined(__AVX__)
  constexpr int kPredicate = Equal ? _CMP_EQ_OQ : _CMP_GT_OQ;
  if constexpr (Bytes == 32 && std::is_same_v<T, float>) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps((__m256)v, (__m256)e, kPredicate)));
  } else if constexpr (Bytes == 32 && std::is_same_v<T, double>) {
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd((__m256d)v, (__m256d)e, kPredicate)));
  }
#endif
#if defined(__SSE2__)
  if constexpr (Bytes == 16 && std::is_same_v<T, float>) {
    const __m128 c = Equal ? _mm_cmpeq_ps((__m128)v, (__m128)e) : _mm_cmpgt_ps((__m128)v, (__m128)e);
    return static_cast<uint32_t>(_mm_movemask_ps(c));
  } else if constexpr (Bytes == 16 && std::is_same_v<T, double>) {
    const __m128d c = Equal ? _mm_cmpeq_pd((__m128d)v, (__m128d)e) : _mm_cmpgt_pd((__m128d)v, (__m128d)e);
    return static_cast<uint32_t>(_mm_movemask_pd(c));
  }
#endif
  uint64_t mask = 0;
  for (int l = 0; l < Vec<T, Bytes>::width; ++l) {
    mask |= static_cast<uint64_t>(Equal ? v[l] == e[l] : v[l] > e[l]) << l;
  }
  return mask;
}

// kCompress8.lanes[mask] = the lanes l < 8 of mask's set bits in order, one byte each (AVX2's append_lanes)
struct CompressTable {
  uint64_t lanes[256];
};
constexpr CompressTable make_compress_table() {
  CompressTable t{};
  for (int mask = 0; mask < 256; ++mask) {
    int n = 0;
    for (int l = 0; l < 8; ++l)
      if ((mask >> l) & 1) t.lanes[mask] |= static_cast<uint64_t>(l) << (8 * n++);
  }
  return t;
}
inline constexpr CompressTable kCompress8 = make_compress_table();

// list[m..) = j0 + l for each set bit l < N of mask, in lane order; returns m + the number of those bits. No
// branch on the bits: a loop over them mispredicts its exit wherever a few lanes of a row are set. The list
// needs N slots of room past its last entry (the vector paths store all N lanes: AVX-512's compress for N = 8
// or 16, AVX2's lanes of kCompress8 widened to 32 bits for N = 4 or 8, where the scalar loop's stores each
// waited for the count of the one before).
template <int N>
inline int64_t append_lanes(int32_t* list, int64_t m, uint64_t mask, int32_t j0) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  if constexpr (N == 8) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __mmask8 bits = static_cast<__mmask8>(mask);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(list + m), _mm256_maskz_compress_epi32(bits, idx));
    return m + __builtin_popcount(bits);
  }
  if constexpr (N == 16) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(j0),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 bits = static_cast<__mmask16>(mask);
    _mm512_storeu_si512(reinterpret_cast<void*>(list + m), _mm512_maskz_compress_epi32(bits, idx));
    return m + __builtin_popcount(bits);
  }
#elif defined(__AVX2__)
  if constexpr (N == 8) {
    const uint32_t bits = static_cast<uint32_t>(mask & 0xffu);
    const __m128i lanes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kCompress8.lanes + bits));
    const __m256i idx = _mm256_add_epi32(_mm256_cvtepu8_epi32(lanes), _mm256_set1_epi32(j0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(list + m), idx);
    return m + __builtin_popcount(bits);
  }
  if constexpr (N == 4) {
    const uint32_t bits = static_cast<uint32_t>(mask & 0xfu);
    const __m128i lanes = _mm_cvtsi32_si128(static_cast<int>(kCompress8.lanes[bits]));
    const __m128i idx = _mm_add_epi32(_mm_cvtepu8_epi32(lanes), _mm_set1_epi32(j0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(list + m), idx);
    return m + __builtin_popcount(bits);
  }
#endif
  for (int l = 0; l < N; ++l) {
    list[m] = j0 + l;
    m += (mask >> l) & 1u;
  }
  return m;
}

// the first index in [j, stop) (stop − j a multiple of W) holding ``value``, or stop: vector by vector, then
// the lowest set bit of the first vector's mask (a scalar walk within the vector mispredicts its exit)
template <typename T, int Bytes>
inline int64_t first_vector_with(const T* row, int64_t j, int64_t stop, T value) {
  using V = typename Vec<T, Bytes>::type;
  constexpr int W = Vec<T, Bytes>::width;
  const V b = broadcast<V>(value);
  for (; j < stop; j += W) {
    const uint64_t mask = compare_mask<T, Bytes, true>(load<V>(row + j), b);
    if (mask != 0) return j + __builtin_ctzll(mask);
  }
  return stop;
}

// The runner-up of the dual focal loss: the first index of the largest entry strictly below ``below`` (ties
// with p_t excluded), −1 when there is none; no sort. A vectorised masked maximum, then a vectorised search
// for its first occurrence.
template <typename T>
int64_t runner_up(const T* row, int64_t k, T below, T floor) {
  constexpr int WW = Vec<T, kWideBytes>::width, WN = Vec<T, 16>::width;
  const int64_t wide = k - k % (2 * WW);
  const int64_t narrow = wide + (k - wide) / (2 * WN) * (2 * WN);
  T best = masked_max_span<T, kWideBytes>(row, 0, wide, below, floor, floor);
  best = masked_max_span<T, 16>(row, wide, narrow, below, floor, best);
  for (int64_t j = narrow; j < k; ++j) {
    const T c = row[j] < below ? row[j] : floor;
    best = best < c ? c : best;
  }
  if (!(best > floor)) return -1;  // no entry below p_t (entries at or below the floor never count)
  int64_t j = first_vector_with<T, kWideBytes>(row, 0, k - k % WW, best);
  if (j == k - k % WW) j = first_vector_with<T, 16>(row, j, j + (k - j) / WN * WN, best);
  while (row[j] != best) ++j;  // best is an entry of the row: this stops
  return j;
}

// e^x for x <= 0, per lane (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); 0 below
// −87.3 (and for −inf), NaN stays NaN. The rows' x − max are never positive. n = x log2 e rounded to the
// nearest integer by adding and subtracting 1.5·2^23 (the sum's low mantissa bits are n: no conversions
// and no compare on the lane's dependency chain); |x − n ln 2| <= ln 2 / 2, the polynomial's range.
template <int Bytes>
inline typename Vec<float, Bytes>::type exp_nonpositive(typename Vec<float, Bytes>::type x) {
  using V = typename Vec<float, Bytes>::type;
  using I = typename Vec<float, Bytes>::int32;
  const V lo = broadcast<V>(-87.33654f);
  const I under = x < lo;
  x = under ? lo : x;
  const V magic = broadcast<V>(12582912.0f), one = broadcast<V>(1.0f);  // 1.5·2^23
  const V y = x * 1.44269504088896341f + magic;
  const V n = y - magic;
  x = x - n * 0.693359375f;
  x = x - n * -2.12194440e-4f;
  V p = broadcast<V>(1.9875691500e-4f);
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  const V r = p * x * x + x + one;
  I yi;
  std::memcpy(&yi, &y, sizeof(yi));
  // 2^n, n in [−126, 0]: y's bits are those of 1.5·2^23 plus n, whose low 9 bits (zero) the shift drops
  const I bits = (yi + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const V zero = {};
  return under ? zero : r * scale;
}

// the largest entry of lanes [j, stop) (stop − j a multiple of 2W) and ``best``
template <int Bytes>
inline float max_span(const float* x, int64_t j, int64_t stop, float best) {
  using V = typename Vec<float, Bytes>::type;
  constexpr int W = Vec<float, Bytes>::width;
  if (j >= stop) return best;
  V a0 = load<V>(x + j), a1 = load<V>(x + j + W);
  for (j += 2 * W; j < stop; j += 2 * W) {
    const V v0 = load<V>(x + j), v1 = load<V>(x + j + W);
    a0 = a0 < v0 ? v0 : a0;
    a1 = a1 < v1 ? v1 : a1;
  }
  const auto m = fold<float, Bytes>(a0 < a1 ? a1 : a0, Max{});
  for (int l = 0; l < 4; ++l) best = best < m[l] ? m[l] : best;
  return best;
}

// max of a row (vectorised; NaN entries may be skipped here, they still make the row's sum NaN)
inline float row_max(const float* x, int64_t k) {
  constexpr int WW = Vec<float, kWideBytes>::width, WN = Vec<float, 16>::width;
  const int64_t wide = k - k % (2 * WW);
  const int64_t narrow = wide + (k - wide) / (2 * WN) * (2 * WN);
  float m = max_span<16>(x, wide, narrow, max_span<kWideBytes>(x, 0, wide, x[0]));
  for (int64_t j = narrow; j < k; ++j) m = m < x[j] ? x[j] : m;
  return m;
}

// e_j = exp(x_j − m) over [j, stop) (a multiple of the width), stored into e unless it is null; Σ e_j and
// Σ e_j² added in float32 lanes over blocks of 256 entries and in float64 across blocks
template <int Bytes>
inline void exp_sum_span(const float* x, int64_t j, int64_t stop, float m, float* e, double& s, double& s2) {
  using V = typename Vec<float, Bytes>::type;
  constexpr int W = Vec<float, Bytes>::width;
  const V mv = broadcast<V>(m);
  while (j < stop) {
    const int64_t block = std::min<int64_t>(stop, j + 256);
    V acc = {}, acc2 = {};
    for (; j < block; j += W) {
      const V v = exp_nonpositive<Bytes>(load<V>(x + j) - mv);
      if (e != nullptr) store(e + j, v);
      acc += v;
      acc2 += v * v;
    }
    const auto a = fold<float, Bytes>(acc, Add{}), a2 = fold<float, Bytes>(acc2, Add{});
    s += (static_cast<double>(a[0]) + a[1]) + (static_cast<double>(a[2]) + a[3]);
    s2 += (static_cast<double>(a2[0]) + a2[1]) + (static_cast<double>(a2[2]) + a2[3]);
  }
}

// e_j = exp(x_j − m) (stored into e unless it is null), returns Σ e_j and, with sq, Σ e_j²
inline double exp_sum_row(const float* x, int64_t k, float m, float* e, double* sq) {
  constexpr int WW = Vec<float, kWideBytes>::width, WN = Vec<float, 16>::width;
  // short rows stay on 16-byte vectors: a wide block would leave most of a K = 10 row to the scalar tail
  const int64_t wide = k >= 4 * WW ? k - k % WW : 0;
  const int64_t narrow = wide + (k - wide) / WN * WN;
  double s = 0.0, s2 = 0.0;
  exp_sum_span<kWideBytes>(x, 0, wide, m, e, s, s2);
  exp_sum_span<16>(x, wide, narrow, m, e, s, s2);
  for (int64_t j = narrow; j < k; ++j) {
    const float v = std::exp(x[j] - m);
    if (e != nullptr) e[j] = v;
    s += v;
    s2 += static_cast<double>(v) * v;
  }
  if (sq != nullptr) *sq = s2;
  return s;
}

// base^g; small integer exponents (the papers' γ = 1, 2, 3, 5) by multiplication, a few times faster than
// std::pow and within 2 ulp of it
inline double pow_g(double base, double g) {
  if (g >= 0.0 && g <= 8.0 && g == static_cast<double>(static_cast<int>(g))) {
    double r = 1.0;
    for (int i = static_cast<int>(g); i > 0; --i) r *= base;
    return r;
  }
  return std::pow(base, g);
}

// What the loss of one sample needs: log p_t, the runner-up's p_j and index (0, 0 when none or not dual),
// Σ_k p_k² (Brier term only).
struct RowStats {
  double lp_t, p_j;
  int64_t j;
  double sq;
};

// Loss and coefficients c = p·∂loss/∂p of sample i, written to o[O_LOSS..O_SQ]: the float64 arithmetic of
// the p_t-only losses (γ from the schedule or per sample, focal / dual / inverse forms,
// CalFocal's γ, the Brier term). ``round32``: p_t (and the margin) are compared with the thresholds in
// float32, as the torch path compares in the input dtype.
inline void row_loss(const Spec& s, int64_t i, bool round32, double tiny, const RowStats& r, double* o) {
  const double lp = r.lp_t, p_t = std::exp(lp), p_j = r.p_j;
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
      const double w = pow_g(base, g);
      const double g_log = g * w * lp / base;
      loss = -w * lp;
      c_t = g_log * p_t - w;
      c_j = -g_log * p_j;
    } else if (g >= 0) {
      const double q = std::max(-std::expm1(lp), tiny);
      const double w = pow_g(q, g);
      loss = -w * lp;
      // p log p / (1 − p) → −1 as p → 1; where q is clamped (log p rounds to 0) it is 0
      c_t = w * (g * (p_t * lp / q) - 1.0);
    } else {
      const double a = -g;
      const double base = 1.0 + p_t;
      const double w = pow_g(base, a);
      loss = -w * lp;
      c_t = -a * p_t * pow_g(base, a - 1.0) * lp - w;
    }
  }
  if (s.brier != 0) loss += s.brier * (r.sq - 2.0 * p_t + 1.0);
  o[O_LOSS] = loss;
  o[O_CT] = c_t;
  o[O_CJ] = c_j;
  o[O_J] = static_cast<double>(r.j);
  o[O_SQ] = r.sq;
}

inline int64_t clamp_label(int64_t y, int64_t k, int64_t& n_bad) {
  n_bad += (y < 0) | (y >= k);
  return std::min(std::max<int64_t>(y, 0), k - 1);
}

// Rows [begin, end) from log-probabilities (torch's log_softmax) and the logits (for the runner-up).
// Returns the number of labels outside [0, K) (those rows use a clamped label; the caller raises). With
// the Brier term the loss needs Σp², which brier_rows adds once p = exp(log p) exists: here the row's
// log p_t, p_j and j are only kept in o[O_LOSS], o[O_CJ], o[O_J].
template <typename scalar_t>
int64_t forward_rows(const scalar_t* logits, const scalar_t* log_p, const int64_t* t, int64_t begin, int64_t end,
                     int64_t k, const Spec& s, double* out) {
  constexpr bool round32 = std::is_same<scalar_t, float>::value;
  const double tiny = static_cast<double>(std::numeric_limits<scalar_t>::min());
  int64_t n_bad = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t y = clamp_label(t[i], k, n_bad);
    const scalar_t* row = log_p + i * k;
    RowStats r{static_cast<double>(row[y]), 0.0, 0, 0.0};
    if (s.dual) {  // on the logits, as the fused pipeline: ties are exact, not decided by rounded log p
      const scalar_t* x = logits + i * k;
      const int64_t j = runner_up(x, k, x[y], -std::numeric_limits<scalar_t>::infinity());
      if (j >= 0) {  // else no entry below p_t: p_j = 0
        r.j = j;
        r.p_j = std::exp(static_cast<double>(row[j]));
      }
    }
    double* o = out + i * N_OUT;
    o[O_INV] = 1.0;  // p is stored normalised
    if (s.brier != 0) {
      o[O_LOSS] = r.lp_t;
      o[O_CJ] = r.p_j;
      o[O_J] = static_cast<double>(r.j);
    } else {
      row_loss(s, i, round32, tiny, r, o);
    }
  }
  return n_bad;
}

// The Brier term's rows after forward_rows: Σp² from p = exp(log p), then the loss of each row.
template <typename scalar_t>
void brier_rows(const scalar_t* p, int64_t begin, int64_t end, int64_t k, const Spec& s, double* out) {
  constexpr bool round32 = std::is_same<scalar_t, float>::value;
  const double tiny = static_cast<double>(std::numeric_limits<scalar_t>::min());
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* prow = p + i * k;
    double sq = 0.0;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < k; ++j) {
      const double v = static_cast<double>(prow[j]);
      sq += v * v;
    }
    double* o = out + i * N_OUT;
    const RowStats r{o[O_LOSS], o[O_CJ], static_cast<int64_t>(o[O_J]), sq};
    row_loss(s, i, round32, tiny, r, o);
  }
}

// Rows [begin, end) of float32 logits in two vectorised passes per row and no log-softmax tensor: the
// maximum m (and the runner-up, found on the logits: the largest logit strictly below x_t), then
// e = exp(x − m) with Σe (and Σe²). log p_t = (x_t − m) − log Σe and p_j in float64; e (when not null, for
// the backward) stays unnormalised, with 1/Σe in o[O_INV].
inline int64_t forward_rows_fused(const float* logits, float* e, const int64_t* t, int64_t begin, int64_t end,
                                  int64_t k, const Spec& s, double* out) {
  const double tiny = static_cast<double>(std::numeric_limits<float>::min());
  int64_t n_bad = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t y = clamp_label(t[i], k, n_bad);
    const float* x = logits + i * k;
    const float m = row_max(x, k);
    double sq = 0.0;
    const double sum = exp_sum_row(x, k, m, e == nullptr ? nullptr : e + i * k, s.brier != 0 ? &sq : nullptr);
    const double log_sum = std::log(sum);
    RowStats r{(static_cast<double>(x[y]) - m) - log_sum, 0.0, 0, sq / (sum * sum)};
    if (s.dual) {
      const int64_t j = runner_up(x, k, x[y], -std::numeric_limits<float>::infinity());
      if (j >= 0) {
        r.j = j;
        r.p_j = std::exp((static_cast<double>(x[j]) - m) - log_sum);
      }
    }
    double* o = out + i * N_OUT;
    row_loss(s, i, true, tiny, r, o);
    o[O_INV] = 1.0 / sum;
  }
  return n_bad;
}

// grad = −(c_t + c_j)·p + c_t e_t + c_j e_j, plus λ·(2p⊙(p − Σp² + p_t) − 2p_t e_t) for the Brier term,
// each row scaled by scale[i] (or by the single scale when scale_stride is 0); p_k = e_k·o[O_INV].
template <typename scalar_t>
void backward_rows(const scalar_t* e, const int64_t* t, const double* out, const double* scale,
                   int64_t scale_stride, double lam, int64_t begin, int64_t end, int64_t k, scalar_t* grad) {
  for (int64_t i = begin; i < end; ++i) {
    const double sc = scale[i * scale_stride];
    const double* o = out + i * N_OUT;
    const double c_t = o[O_CT] * sc;
    const double c_j = o[O_CJ] * sc;
    const double inv = o[O_INV];
    const int64_t j = static_cast<int64_t>(o[O_J]);
    const int64_t y = t[i];
    const scalar_t* erow = e + i * k;
    scalar_t* grow = grad + i * k;
    const double row = c_t + c_j;
    // the (N, K) pass in the input dtype (vectorised); the entries at the label and at the runner-up,
    // which get the corrections c_t e_t + c_j e_j, are recomputed in float64 (no float32 cancellation)
    const double w = 2.0 * lam * sc;
    const double p_t = static_cast<double>(erow[y]) * inv;
    const double a = lam != 0 ? w * (p_t - o[O_SQ]) - row : -row;
    if (lam != 0) {
      const scalar_t as = static_cast<scalar_t>(a), ws = static_cast<scalar_t>(w);
      const scalar_t is = static_cast<scalar_t>(inv);
#pragma omp simd
      for (int64_t m = 0; m < k; ++m) {
        const scalar_t v = erow[m] * is;
        grow[m] = v * (as + ws * v);
      }
    } else {
      const scalar_t as = static_cast<scalar_t>(a * inv);
#pragma omp simd
      for (int64_t m = 0; m < k; ++m) grow[m] = as * erow[m];
    }
    // entry m of the pass in float64: p_m (a + w p_m) (w = 0 without the Brier term)
    grow[y] = static_cast<scalar_t>(p_t * (a + w * p_t) + c_t - w * p_t);
    if (c_j != 0 && j != y) {
      const double p_j = static_cast<double>(erow[j]) * inv;
      grow[j] = static_cast<scalar_t>(p_j * (a + w * p_j) + c_j);
    }
  }
}

// log x on float64 lanes of x >= 1 (the rows' Σ exp(x − max); NaN and +inf pass through), where the row path
// calls std::log per row (the margin lanes and mL1-ACE's tiles): x = 2^e·f with f in [√½, √2),
// log f = 2 atanh(s) with s = (f − 1)/(f + 1), |s| <= 0.172, by its series to s^25 (truncated below 1e-20
// relative), e·log 2 in two parts: ~1 ulp
template <typename D>
inline D log_lanes(D x) {
  using I = decltype(x < x);
  I bits;
  std::memcpy(&bits, &x, sizeof(bits));
  I e = ((bits >> 52) & 0x7ff) - 1022;
  bits = (bits & 0x000fffffffffffff) | 0x3fe0000000000000;
  D f;
  std::memcpy(&f, &bits, sizeof(f));  // in [0.5, 1)
  const I small = f < 0.70710678118654752440;
  e = small ? e - 1 : e;
  f = small ? f + f : f;
  const D t = (f - 1.0) / (f + 1.0), z = t * t;
  D p = broadcast<D>(1.0 / 25.0);
  for (int n = 23; n >= 1; n -= 2) p = p * z + 1.0 / n;  // Σ z^i / (2i + 1)
  const D ef = __builtin_convertvector(e, D);
  const D r = (ef * -2.1219444005469058277e-4 + 2.0 * t * p) + ef * 0.693359375;
  const D inf = broadcast<D>(std::numeric_limits<double>::infinity());
  return x == x && x != inf ? r : x;
}

}  // namespace torchcal
