// A stable ascending sort of non-negative floats carrying one flag per value: plain C++17 (no torch; the
// caller passes its parallel loop), included by fused_losses.cpp. The equal-mass estimators (AdaECE,
// debiased ECE, ECE sweep) need the top-label confidences in stable sorted order with their correctness.
// An LSD radix sort of the bit patterns (which order as the values for non-negative IEEE floats) is stable by
// construction, so it needs no index to break ties, and each pass moves one word per value (the bits and the
// flag), where a comparison sort of 64-bit (value, index) keys followed by a gather of the flags moves
// several times that.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchcal {

// the first of the items [0, total) that chunk c of `parts` holds (equal chunks, the first total % parts one
// larger): a cut that depends on the total only
inline int64_t chunk_start(int64_t total, int64_t parts, int64_t c) {
  return total / parts * c + std::min(c, total % parts);
}

// whether digit d moves anything: no bucket holds all n values (counts: each chunk's histograms of every
// digit, (chunk, digit, bucket))
inline bool digit_moves(const std::vector<int64_t>& counts, int64_t chunks, int digits, int buckets, int d,
                        int64_t n) {
  for (int b = 0; b < buckets; ++b) {
    int64_t total = 0;
    for (int64_t c = 0; c < chunks; ++c) total += counts[(c * digits + d) * buckets + b];
    if (total == n) return false;
    if (total != 0) return true;
  }
  return false;
}

// offsets[c·B + b] (each chunk's count of bucket b) replaced by where that chunk's values of the bucket go:
// bucket by bucket, chunk by chunk (chunk order within a bucket keeps the sort stable)
inline void chunk_offsets(std::vector<int64_t>& offsets, int64_t chunks, int buckets) {
  int64_t at = 0;
  for (int b = 0; b < buckets; ++b) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t count = offsets[c * buckets + b];
      offsets[c * buckets + b] = at;
      at += count;
    }
  }
}

// offsets (chunk c's bucket b at c·B + b) for the pass of digit d, then chunk_offsets: the chunks' counts of
// the input order (`counts`, (chunk, digit, bucket)) until a pass has moved the values (`moved`), or with one
// chunk (the whole array's count holds in any order); else each chunk's count of the current order,
// count_chunk(c, h) adding chunk c into its zeroed buckets h, the chunks at once through parallel
template <typename Parallel, typename CountChunk>
inline void pass_offsets(const std::vector<int64_t>& counts, int64_t chunks, int digits, int buckets, int d,
                         bool moved, std::vector<int64_t>& offsets, const Parallel& parallel,
                         const CountChunk& count_chunk) {
  if (!moved || chunks == 1) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t* h = counts.data() + (c * digits + d) * buckets;
      std::copy(h, h + buckets, offsets.data() + c * buckets);
    }
  } else {
    parallel(chunks, [&](int64_t c) {
      int64_t* h = offsets.data() + c * buckets;
      std::fill(h, h + buckets, 0);
      count_chunk(c, h);
    });
  }
  chunk_offsets(offsets, chunks, buckets);
}

// Sorts values[0, n) with their flags into out_values / out_flags (stable: equal values keep their order).
// Returns the number of values that are negative (below −0.0) or NaN, which this order does not handle: the
// caller raises when it is not 0 (the outputs are then unspecified). −0.0 sorts as +0.0.
//
// parallel(count, f) calls f(c) for every c in [0, count), possibly at once. The values are cut into
// chunks (a number that depends on n only); each pass counts the digits of every chunk, gives each chunk its
// own offsets in every bucket (chunk order within a bucket: stable) and moves the chunks at once.
template <typename T, typename Parallel>
int64_t radix_sort_with_flags(const T* values, const bool* flags, int64_t n, T* out_values, bool* out_flags,
                              const Parallel& parallel) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int kBits = 11, kBuckets = 1 << kBits;
  constexpr int kKeyBits = static_cast<int>(sizeof(U)) * 8 - 1;  // a non-negative value's bits: no sign
  constexpr int kDigits = (kKeyBits + kBits - 1) / kBits;
  constexpr U kSign = U{1} << kKeyBits;
  constexpr U kInf = static_cast<U>(sizeof(T) == 4 ? 0x7F800000ull : 0x7FF0000000000000ull);
  if (n == 0) return 0;
  const int64_t chunks = std::min<int64_t>(16, std::max<int64_t>(1, n >> 16));
  // (by value: the loops store through int64_t pointers, which could alias anything captured by reference)
  const auto chunk_begin = [n, chunks](int64_t c) { return chunk_start(n, chunks, c); };
  const auto bits_of = [&](int64_t i) {
    U u;
    std::memcpy(&u, values + i, sizeof(U));
    return u == kSign ? U{0} : u;  // −0.0
  };
  // a moved word is (bits << 1) | flag: one write per value and pass, the flag riding below the digits
  const auto word_of = [&](int64_t i) { return static_cast<U>(bits_of(i) << 1) | static_cast<U>(flags[i]); };

  // the histograms of every digit over all values (which passes can be skipped) and the invalid values
  std::vector<int64_t> counts(static_cast<size_t>(chunks) * kDigits * kBuckets, 0);
  std::vector<int64_t> bad(static_cast<size_t>(chunks), 0);
  parallel(chunks, [&](int64_t c) {
    int64_t* h = counts.data() + c * kDigits * kBuckets;
    int64_t invalid = 0;
    for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i) {
      const U u = bits_of(i);
      invalid += u > kInf;  // sign bit set (negative) or NaN
      for (int d = 0; d < kDigits; ++d) ++h[d * kBuckets + ((u >> (d * kBits)) & (kBuckets - 1))];
    }
    bad[c] = invalid;
  });
  int64_t n_bad = 0;
  for (const int64_t b : bad) n_bad += b;
  if (n_bad != 0) return n_bad;
  std::vector<bool> active(kDigits, false);  // a digit some values differ in: its pass moves something
  for (int d = 0; d < kDigits; ++d) active[d] = digit_moves(counts, chunks, kDigits, kBuckets, d, n);

  std::vector<U> first(static_cast<size_t>(n)), second;
  const U* src = nullptr;  // null until a pass has moved the words: the first pass reads the inputs
  U* dst = first.data();
  std::vector<int64_t> offsets(static_cast<size_t>(chunks) * kBuckets);
  for (int d = 0; d < kDigits; ++d) {
    if (!active[d]) continue;
    const int shift = 1 + d * kBits;
    const U* from = src;
    const auto word_at = [&word_of, from](int64_t i) { return from == nullptr ? word_of(i) : from[i]; };
    pass_offsets(counts, chunks, kDigits, kBuckets, d, src != nullptr, offsets, parallel, [&](int64_t c, int64_t* h) {
      for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i)
        ++h[(word_at(i) >> shift) & (kBuckets - 1)];
    });
    U* to = dst;
    parallel(chunks, [&, to](int64_t c) {
      int64_t* h = offsets.data() + c * kBuckets;
      for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i) {
        const U w = word_at(i);
        to[h[(w >> shift) & (kBuckets - 1)]++] = w;
      }
    });
    if (src == nullptr) {
      second.resize(static_cast<size_t>(n));
      src = first.data();
      dst = second.data();
    } else {
      src = dst;
      dst = dst == first.data() ? second.data() : first.data();
    }
  }
  const U* sorted = src;
  parallel(chunks, [&, sorted](int64_t c) {
    for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i) {
      const U w = sorted == nullptr ? word_of(i) : sorted[i];
      const U u = w >> 1;
      std::memcpy(out_values + i, &u, sizeof(U));
      out_flags[i] = (w & 1) != 0;
    }
  });
  return 0;
}

}  // namespace torchcal

namespace torchcal {

// Sorts the n 64-bit words w by their upper 32 bits, stably: an LSD radix sort of four 8-bit digits,
// skipping a digit on which every word agrees (the batch-term losses sort (confidence bits << 32 | row) words,
// the row riding below the key). Four passes over 256 buckets rather than three over 2048: a batch of a few
// thousand rows spent as much on clearing and scanning the buckets as on moving its words (decision 272). The words are cut into chunks (a number that depends on n only); each pass
// counts the digit of every chunk, gives each chunk its own offsets in every bucket (chunk order within a
// bucket: stable) and moves the chunks at once through parallel(count, f), which calls f(c) for every c in
// [0, count). tmp is scratch of n words; returns the buffer that holds the sorted words (w or tmp).
template <typename Parallel>
uint64_t* radix_sort_upper_words(uint64_t* w, uint64_t* tmp, int64_t n, const Parallel& parallel) {
  constexpr int kBits = 8, kBuckets = 1 << kBits, kDigits = 4;
  if (n < 2) return w;
  const int64_t chunks = std::min<int64_t>(16, std::max<int64_t>(1, n >> 15));
  const auto chunk_begin = [n, chunks](int64_t c) { return chunk_start(n, chunks, c); };
  // every digit's histogram per chunk of the input order (which digits move something, and the first
  // pass's offsets)
  std::vector<int64_t> counts(static_cast<size_t>(chunks) * kDigits * kBuckets, 0);
  parallel(chunks, [&](int64_t c) {
    int64_t* h = counts.data() + c * kDigits * kBuckets;
    for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i) {
      const uint64_t v = w[i];
      for (int d = 0; d < kDigits; ++d) ++h[d * kBuckets + ((v >> (32 + d * kBits)) & (kBuckets - 1))];
    }
  });
  uint64_t* src = w;
  uint64_t* dst = tmp;
  // whether a pass has moved the words (src == w again after two passes: not a test of this)
  bool moved = false;
  std::vector<int64_t> offsets(static_cast<size_t>(chunks) * kBuckets);
  for (int d = 0; d < kDigits; ++d) {
    if (!digit_moves(counts, chunks, kDigits, kBuckets, d, n)) continue;
    const int shift = 32 + d * kBits;
    const uint64_t* from = src;
    pass_offsets(counts, chunks, kDigits, kBuckets, d, moved, offsets, parallel, [&, from](int64_t c, int64_t* h) {
      for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i)
        ++h[(from[i] >> shift) & (kBuckets - 1)];
    });
    uint64_t* to = dst;
    parallel(chunks, [&, from, to](int64_t c) {
      int64_t* h = offsets.data() + c * kBuckets;
      for (int64_t i = chunk_begin(c), end = chunk_begin(c + 1); i < end; ++i) {
        const uint64_t v = from[i];
        to[h[(v >> shift) & (kBuckets - 1)]++] = v;
      }
    });
    std::swap(src, dst);
    moved = true;
  }
  return src;
}

}  // namespace torchcal
