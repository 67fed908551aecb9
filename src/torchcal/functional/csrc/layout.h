// The (N, K, d1, ...) logits and (N, d1, ...) integer labels that torchcal's fused loss operators take, checked
// once for all of them (margin, batch-term and mL1-ACE operators): their sizes as N images of S positions of K
// classes.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace torchcal {

struct Layout {
  int64_t n, k, sp;
};

// `op` names the operator in the device error
inline Layout loss_layout(const at::Tensor& logits, const at::Tensor& targets, const char* op) {
  TORCH_CHECK_VALUE(logits.dim() >= 2, "`logits` must have shape (N, K, d1, ...), got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.device().is_cpu() && targets.device().is_cpu(), op, " runs on CPU");
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
                    "`logits` must be float32 or float64, got ", logits.scalar_type());
  bool ok = targets.dim() == logits.dim() - 1 && targets.size(0) == logits.size(0);
  for (int64_t d = 2; ok && d < logits.dim(); ++d) ok = targets.size(d - 1) == logits.size(d);
  TORCH_CHECK_VALUE(ok, "`targets` must have the shape of `logits` without its class dimension, got ",
                    targets.sizes(), " for logits ", logits.sizes());
  TORCH_CHECK_VALUE(!at::isFloatingType(targets.scalar_type()) && targets.scalar_type() != at::kBool,
                    "`targets` must hold integer labels");
  const int64_t n = logits.size(0), k = logits.size(1);
  TORCH_CHECK_VALUE(n > 0 && k >= 2 && logits.numel() > 0, "`logits` must hold at least one row of >= 2 classes");
  return {n, k, logits.numel() / (n * k)};
}

// Prefetches `len` entries of each of the K class runs at x (class j at x + j·sp, sp the image's positions),
// for writing when `write`: a tile's or block's successor while it is computed, since K runs at a stride of
// the image are more streams than the hardware prefetcher follows (the runs past an image's end are
// prefetched too, which a prefetch may do)
template <typename T>
inline void prefetch_runs(const T* x, int64_t sp, int64_t k, int64_t len, bool write) {
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < len; t += line) {
      if (write) {
        __builtin_prefetch(x + j * sp + t, 1);
      } else {
        __builtin_prefetch(x + j * sp + t);
      }
    }
  }
}

// The error for the first of `rows` labels outside [0, K) that is not `ignore` (when has_ignore), raised by an
// operator whose pass counted one; returns when there is none
inline void raise_bad_label(const int64_t* tp, int64_t rows, int64_t k, bool has_ignore, int64_t ignore) {
  for (int64_t i = 0; i < rows; ++i) {
    if (!(has_ignore && tp[i] == ignore) && (tp[i] < 0 || tp[i] >= k))
      TORCH_CHECK_VALUE(false, "`targets` must lie in [0, ", k, "), found label ", tp[i]);
  }
}

// The labels given to a backward operator of the torch.compile pairs, which a caller can call with other
// labels than its forward checked: the layout's errors (loss_layout), then the forward's error for a label
// outside [0, K) that is not `ignore`, before any label indexes a row; returns the layout
inline Layout check_backward_labels(const at::Tensor& logits, const at::Tensor& targets, c10::optional<int64_t> ignore,
                                  const char* op) {
  const Layout l = loss_layout(logits, targets, op);
  const at::Tensor t = targets.to(at::kLong).contiguous();
  raise_bad_label(t.data_ptr<int64_t>(), t.numel(), l.k, ignore.has_value(), ignore.value_or(0));
  return l;
}

}  // namespace torchcal
