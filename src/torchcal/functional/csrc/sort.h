// A stable ascending sort of non-negative floats carrying one flag per value: plain C++17 (no torch),
// included by fused_losses.cpp. The equal-mass estimators (AdaECE, debiased ECE, ECE sweep) need the
// top-label confidences in stable sorted order with their correctness; an LSD radix sort on the bit patterns
// (which order as the values for non-negative IEEE floats) is stable by construction, so it needs no index
// to break ties, and it moves 5 bytes per sample where a comparison sort of 64-bit (value, index) keys
// followed by a gather of the flags moves several times that.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchcal {

// Sorts values[0, n) with their flags into out_values / out_flags (stable: equal values keep their order).
// Returns the number of values that are negative (below −0.0) or NaN, which this order does not handle: the
// caller raises when it is not 0 (the outputs are then unspecified). −0.0 sorts as +0.0.
template <typename T>
int64_t radix_sort_with_flags(const T* values, const bool* flags, int64_t n, T* out_values, bool* out_flags) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int kBits = 11, kBuckets = 1 << kBits;
  constexpr int kKeyBits = static_cast<int>(sizeof(U)) * 8 - 1;  // a non-negative value's bits: no sign
  constexpr int kDigits = (kKeyBits + kBits - 1) / kBits;
  constexpr U kSign = U{1} << kKeyBits;
  constexpr U kInf = static_cast<U>(sizeof(T) == 4 ? 0x7F800000ull : 0x7FF0000000000000ull);
  // a moved word is (bits << 1) | flag: one write per value and pass, the flag riding below the digits
  const auto word_of = [&](int64_t i) {
    U u;
    std::memcpy(&u, values + i, sizeof(U));
    u = u == kSign ? U{0} : u;  // −0.0
    return static_cast<U>(u << 1) | static_cast<U>(flags[i]);
  };
  std::vector<int64_t> hist(static_cast<size_t>(kDigits) * kBuckets, 0);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {  // the histograms of every digit, in one pass
    U u;
    std::memcpy(&u, values + i, sizeof(U));
    u = u == kSign ? U{0} : u;
    bad += u > kInf;  // sign bit set (negative) or NaN
    for (int d = 0; d < kDigits; ++d) ++hist[d * kBuckets + ((u >> (d * kBits)) & (kBuckets - 1))];
  }
  if (bad != 0 || n == 0) return bad;
  std::vector<U> first(static_cast<size_t>(n)), second;
  U* src = nullptr;  // null until a pass has moved the words: the first pass reads the inputs
  U* dst = first.data();
  for (int d = 0; d < kDigits; ++d) {
    int64_t* h = hist.data() + d * kBuckets;
    bool single = false;  // every value has the same digit: the pass would not move anything
    for (int b = 0; b < kBuckets && !single; ++b) single = h[b] == n;
    if (single) continue;
    int64_t offset = 0;
    for (int b = 0; b < kBuckets; ++b) {
      const int64_t c = h[b];
      h[b] = offset;
      offset += c;
    }
    const int shift = 1 + d * kBits;
    for (int64_t i = 0; i < n; ++i) {
      const U w = src == nullptr ? word_of(i) : src[i];
      dst[h[(w >> shift) & (kBuckets - 1)]++] = w;
    }
    if (src == nullptr) {
      second.resize(static_cast<size_t>(n));
      src = first.data();
      dst = second.data();
    } else {
      std::swap(src, dst);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const U w = src == nullptr ? word_of(i) : src[i];
    const U u = w >> 1;
    std::memcpy(out_values + i, &u, sizeof(U));
    out_flags[i] = (w & 1) != 0;
  }
  return bad;
}

}  // namespace torchcal
