// torchcal's fused CPU focal-family loss as a PyTorch operator with a C++ autograd node.
//
// Built on request by torchcal.functional._extension (torch.utils.cpp_extension, ~20-30 s once, cached).
// It computes the p_t-only losses of the torch path (torchcal/functional/_true_class.py) (same conventions and per-sample float64 arithmetic; log p from its own fused log-softmax for float32 rows,
// and the dual loss's ties decided on the logits: docs/decisions.md 38 and 41), and keeps the whole forward +
// backward in C++: no Python autograd.Function round trip, which at batch sizes of a few hundred costs as
// much as PyTorch's fused cross entropy itself.
//
//   torch.ops.torchcal.fused_true_class(logits, targets, params, sample_gammas, reduction) -> loss
//
// logits (N, K) float32/float64 CPU; targets (N,) integer; params: one float64 vector holding the flags
// (upper_on_tie, dual, margin, nll, cal, cal_lambda, brier), the number of thresholds, the thresholds
// (already rounded to float32 for float32 logits, as the torch path compares in the input dtype) and the γ
// schedule (one tensor: the boxed call converts it at once, where lists cost per element);
// sample_gammas: one γ per sample or None; reduction 0 = none, 1 = mean, 2 = sum.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "batch_terms.h"
#include "layout.h"
#include "margin.h"
#include "ace.h"
#include "margin_lanes.h"
#include "scan.h"
#include "sort.h"
#include "true_class.h"

#include <atomic>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace torchcal;

// float32 rows take the fused two-pass pipeline with its own vectorised exp: up to 64 classes always, any
// length when the library is built for 32- or 64-byte vectors (AVX, AVX-512). On 16-byte vectors only (SSE2,
// NEON) longer rows are faster with torch's log_softmax and exp.
constexpr int64_t kFusedMaxClasses = kWideBytes >= 32 ? std::numeric_limits<int64_t>::max() : 64;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The checks both operators make on their inputs: rows (N, K) of float32/64 values and labels (N,), on CPU
void check_rows(const at::Tensor& values, const char* name, const at::Tensor& targets, const char* op) {
  TORCH_CHECK_VALUE(values.dim() == 2, "`", name, "` must have shape (N, K), got ", values.sizes());
  TORCH_CHECK_VALUE(values.device().is_cpu() && targets.device().is_cpu(), op, " runs on CPU");
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble, "`", name,
                    "` must be float32 or float64, got ", values.scalar_type());
  TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == values.size(0),
                    "`targets` must have shape (", values.size(0), ",), got ", targets.sizes());
  // (every row is read from its first entry on: a row of no entries has none)
  TORCH_CHECK_VALUE(values.size(1) >= 1, "`", name, "` must have at least one class (column), got ",
                    values.sizes());
}

struct Forward {
  at::Tensor loss;   // the reduced (or per-sample) loss, in the dtype of the logits
  at::Tensor probs;  // exp(x − row max), unnormalised for float32 (undefined when the backward does not run)
  at::Tensor out;    // (N, N_OUT) float64 per-sample loss, coefficients and 1 / Σ exp(x − max)
};

// params (float64 vector): the 7 flags (upper_on_tie, dual, margin, nll, cal, cal_lambda, brier), the number
// of thresholds T, the T thresholds, then the γ schedule (T + 1 values; none with per-sample γ)
Forward fused_forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& params,
                      const c10::optional<at::Tensor>& sample_gammas, int64_t reduction, bool keep_probs) {
  check_rows(logits, "logits", targets, "fused_true_class");
  TORCH_CHECK_VALUE(params.scalar_type() == at::kDouble && params.dim() == 1 && params.is_contiguous() &&
                        params.device().is_cpu() && params.numel() > N_FLAGS,
                    "`params` must be a contiguous float64 CPU vector of flags, thresholds and γs");
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "`reduction` must be 0, 1 or 2");
  const int64_t n = logits.size(0), k = logits.size(1);
  const double* flags = params.data_ptr<double>();
  const int64_t n_thresholds = static_cast<int64_t>(flags[N_FLAGS]);
  const int64_t n_gammas = params.numel() - (N_FLAGS + 1) - n_thresholds;
  TORCH_CHECK_VALUE(n_thresholds >= 0 && n_gammas >= 0, "`params` is shorter than its threshold count says");
  at::Tensor sample;
  if (sample_gammas.has_value() && sample_gammas->defined()) {
    sample = sample_gammas->to(at::kDouble).contiguous();
    TORCH_CHECK_VALUE(sample.dim() == 1 && sample.size(0) == n, "`sample_gammas` must have shape (", n, ",)");
  } else {
    TORCH_CHECK_VALUE(n_gammas == n_thresholds + 1, "`params` must hold one more γ than thresholds");
  }
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const at::Tensor x = logits.contiguous();
  const bool brier = flags[F_BRIER] != 0;
  at::Tensor out = at::empty({n, N_OUT}, x.options().dtype(at::kDouble));
  const double* thresholds = flags + N_FLAGS + 1;
  const Spec s{thresholds + n_thresholds,
               n_gammas,
               thresholds,
               n_thresholds,
               sample.defined() ? sample.data_ptr<double>() : nullptr,
               flags[F_UPPER] != 0,
               flags[F_DUAL] != 0,
               flags[F_MARGIN] != 0,
               flags[F_NLL] != 0,
               flags[F_CAL] != 0,
               flags[F_CAL_LAMBDA],
               flags[F_BRIER]};
  std::atomic<int64_t> n_bad{0};
  const int64_t* tp = t.data_ptr<int64_t>();
  double* op = out.data_ptr<double>();
  at::Tensor probs;  // what the backward reads: e = exp(x − max) per row (p = e·o[O_INV])
  if (x.scalar_type() == at::kFloat && k <= kFusedMaxClasses) {
    // float32 rows: the log-softmax fused into the rows' two passes (no (N, K) log-probability tensor)
    if (keep_probs) probs = at::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* ep = keep_probs ? probs.data_ptr<float>() : nullptr;
    at::parallel_for(0, n, grain_rows(k), [&](int64_t begin, int64_t end) {
      n_bad += forward_rows_fused(xp, ep, tp, begin, end, k, s, op);
    });
  } else {
    // torch's log_softmax (vectorised for the machine's widest ISA), the per-row arithmetic on it, then
    // p = exp(log p) in place (for the backward, and the Brier term's Σp²): no second (N, K) tensor
    at::Tensor log_p = at::_log_softmax(x, 1, false);
    AT_DISPATCH_FLOATING_TYPES(log_p.scalar_type(), "fused_true_class", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* lp = log_p.data_ptr<scalar_t>();
      at::parallel_for(0, n, grain_rows(k), [&](int64_t begin, int64_t end) {
        n_bad += forward_rows<scalar_t>(xp, lp, tp, begin, end, k, s, op);
      });
    });
    if (keep_probs || brier) probs = log_p.exp_();
    if (brier) {
      AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "fused_true_class_brier", [&] {
        const scalar_t* pp = probs.data_ptr<scalar_t>();
        at::parallel_for(0, n, grain_rows(k), [&](int64_t begin, int64_t end) {
          brier_rows<scalar_t>(pp, begin, end, k, s, op);
        });
      });
    }
  }
  if (n_bad.load() > 0) raise_bad_label(tp, n, k, false, 0);
  at::Tensor loss;
  if (reduction == 0) {
    loss = at::empty({n}, logits.options());
    loss.copy_(out.select(1, O_LOSS));  // a copy, never a view of the saved per-sample output
  } else {
    // summed in row order on one thread: the same value for any thread setting
    const double* op = out.data_ptr<double>();
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += op[i * N_OUT + O_LOSS];
    if (reduction == 1) total /= static_cast<double>(n);
    loss = at::scalar_tensor(total, logits.options().dtype(logits.scalar_type()));
  }
  return {loss, probs, out};
}

at::Tensor fused_backward(const at::Tensor& grad_loss, const at::Tensor& probs, const at::Tensor& targets,
                          const at::Tensor& out, double lam, int64_t reduction) {
  const int64_t n = probs.size(0), k = probs.size(1);
  // the incoming gradient per row: a (N,) tensor for "none", one number (stride 0) for "mean" / "sum"
  at::Tensor per_row;
  double single = 0.0;
  const double* sp = &single;
  int64_t stride = 0;
  if (reduction == 0) {
    per_row = grad_loss.to(at::kDouble).contiguous();
    sp = per_row.data_ptr<double>();
    stride = 1;
  } else {
    single = grad_loss.item<double>() / (reduction == 1 ? static_cast<double>(n) : 1.0);
  }
  at::Tensor grad = at::empty_like(probs);
  const at::Tensor t = targets.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "fused_true_class_backward", [&] {
    const scalar_t* pp = probs.data_ptr<scalar_t>();
    const int64_t* tp = t.data_ptr<int64_t>();
    const double* op = out.data_ptr<double>();
    scalar_t* gp = grad.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(k), [&](int64_t begin, int64_t end) {
      backward_rows<scalar_t>(pp, tp, op, sp, stride, lam, begin, end, k, gp);
    });
  });
  return grad;
}

class FusedTrueClass : public torch::autograd::Function<FusedTrueClass> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const at::Tensor& params, const c10::optional<at::Tensor>& sample_gammas,
                            int64_t reduction, bool keep) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Forward f = fused_forward(logits, targets, params, sample_gammas, reduction, keep);
    if (keep) ctx->save_for_backward({f.probs, targets, f.out});
    ctx->saved_data["brier"] = params.data_ptr<double>()[F_BRIER];
    ctx->saved_data["reduction"] = reduction;
    return f.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "the fused CPU focal-family loss is differentiable once only; for higher-order gradients "
                "run it with torchcal.functional.use_cpu_extension(False)");
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = fused_backward(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["brier"].toDouble(),
                                     ctx->saved_data["reduction"].toInt());
    // one entry per argument of forward: the gradient for the logits, none for the rest
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_true_class_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& params,
                                const c10::optional<at::Tensor>& sample_gammas, int64_t reduction) {
  return fused_forward(logits, targets, params, sample_gammas, reduction, false).loss;
}

at::Tensor fused_true_class_autograd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& params,
                                     const c10::optional<at::Tensor>& sample_gammas, int64_t reduction) {
  // probabilities are kept for the backward only when a graph is recorded (not under torch.no_grad())
  const bool keep = at::GradMode::is_enabled() && logits.requires_grad();
  return FusedTrueClass::apply(logits, targets, params, sample_gammas, reduction, keep);
}

// The same loss as two plain operators for torch.compile, whose fake (shape) implementations and autograd
// formula are registered from Python (torchcal/functional/_extension.py): the forward returns what the
// backward reads, so neither needs a C++ autograd node that tracing with fake tensors could not enter.
// (brier, the λ of the squared-error term, repeats params' flag for the autograd formula, which sees the
// arguments but may not read a tensor's values)
//   fused_true_class_fwd(logits, targets, params, sample_gammas, reduction, brier) -> (loss, probs, out)
//   fused_true_class_bwd(grad_loss, probs, targets, out, brier, reduction) -> grad_logits
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_true_class_fwd_cpu(
    const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& params,
    const c10::optional<at::Tensor>& sample_gammas, int64_t reduction, double brier) {
  TORCH_CHECK_VALUE(params.numel() > N_FLAGS && params.scalar_type() == at::kDouble &&
                        params.data_ptr<double>()[F_BRIER] == brier,
                    "`brier` must repeat the λ of `params`");
  Forward f = fused_forward(logits, targets, params, sample_gammas, reduction, true);
  return {f.loss, f.probs, f.out};
}

at::Tensor fused_true_class_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& probs, const at::Tensor& targets,
                                    const at::Tensor& out, double brier, int64_t reduction) {
  TORCH_CHECK_VALUE(probs.dim() == 2 && probs.is_contiguous() && probs.device().is_cpu() &&
                        (probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble),
                    "`probs` must be the forward's contiguous (N, K) float32/float64 probabilities");
  const int64_t n = probs.size(0);
  TORCH_CHECK_VALUE(targets.numel() == n && !at::isFloatingType(targets.scalar_type()) &&
                        targets.scalar_type() != at::kBool,
                    "`targets` must hold one integer label per row of `probs`");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kDouble && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                        out.size(1) == N_OUT,
                    "`out` must be the forward's (", n, ", ", static_cast<int64_t>(N_OUT), ") float64 array");
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "`reduction` must be 0, 1 or 2");
  TORCH_CHECK_VALUE(grad_loss.numel() == (reduction == 0 ? n : 1), "`grad_loss` must have one entry per row for "
                    "reduction 0 (none), else one");
  const at::Tensor t = targets.to(at::kLong).contiguous();
  raise_bad_label(t.data_ptr<int64_t>(), n, probs.size(1), false, 0);
  return fused_backward(grad_loss, probs, targets, out, brier, reduction);
}


// -- the margin losses: cross entropy plus a row-wise penalty (margin.h) ------------------------------------
//
//   fused_margin(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction) -> loss
//
// logits (N, K, d1, ...) float32/float64 CPU (N, K: rows; with spatial dimensions each position is a row,
// read in place: tiles of positions are transposed through a small per-thread buffer, never the whole
// tensor); targets (N, d1, ...) integer labels. A label equal to ignore_index (when given) has no cross
// entropy, and no penalty unless penalty_all_rows; any other label outside [0, K) raises. params: coef, then
// the kind's (margin.h). reduction 0 = none (the targets' shape), 1 = mean (each term over the rows it
// covers, as _reduce_penalised), 2 = sum. The backward recomputes exp(x − max) from the logits (saved, as
// autograd saves an input: no copy) and the per-row statistics; the autograd nodes keep one (N, K)-sized
// array where it pays (the row path's exps, decision 220; the confidence penalty's f'(p), decisions 208, 269).

MarginSpec margin_spec(int64_t kind, at::ArrayRef<double> params) {
  TORCH_CHECK_VALUE(kind >= M_MBLS && kind <= M_POLY1,
                    "`kind` must be 0 (MbLS), 1 (MaxSup), 2 (ACLS), 3 (CP), 4 (CALS) or 5 (Poly-1)");
  const size_t need[] = {2, 1, 4, 3, 5, 1};
  TORCH_CHECK_VALUE(params.size() == need[kind], "`params` must hold ", need[kind], " numbers for kind ", kind);
  MarginSpec s{kind, params[0], 0.0, 0.0, 0.0, 0.0, false};
  if (kind == M_MBLS) s.margin = params[1];
  if (kind == M_ACLS) {
    s.margin = params[1];
    s.lam_pos = params[2];
    s.lam_neg = params[3];
  }
  if (kind == M_CP) {
    s.eps = params[1];
    s.mbls_form = params[2] != 0;
  }
  if (kind == M_CALS) {
    s.scale = params[1];
    s.lo = params[2];
    s.hi = params[3];
    s.margin = params[4];
  }
  return s;
}

// The per-class numbers of CALS ((4, K): a, b, w, c; Σ c into s.offset) and Poly-1 (class weights (K,) or
// none) checked against the logits, their data put in s; class_params is contiguous on return
void margin_class_params(MarginSpec& s, at::Tensor& class_params, const at::Tensor& logits) {
  const int64_t k = logits.size(1);
  const bool given = class_params.defined();
  if (s.kind == M_CALS || (s.kind == M_POLY1 && given)) {
    const int64_t rows = s.kind == M_CALS ? 4 : 1;
    TORCH_CHECK_VALUE(given && class_params.numel() == rows * k && class_params.device().is_cpu() &&
                          class_params.scalar_type() == logits.scalar_type(),
                      "`class_params` must hold ", rows, " x ", k, " numbers of the logits' dtype on CPU");
    class_params = class_params.contiguous();
    s.cls = class_params.data_ptr();
    if (s.kind == M_CALS) {
      AT_DISPATCH_FLOATING_TYPES(class_params.scalar_type(), "margin_class_params", [&] {
        const scalar_t* c = class_params.data_ptr<scalar_t>() + 3 * k;
        double total = 0.0;
        for (int64_t j = 0; j < k; ++j) total += static_cast<double>(c[j]);
        s.offset = total;
      });
    }
  } else {
    TORCH_CHECK_VALUE(!given, "`class_params` is not taken by kind ", s.kind);
  }
}

// Poly-1's row weight w[y] (1 without class weights or for another kind); y a checked label
inline double margin_row_weight(const MarginSpec& s, const at::Tensor& class_params, int64_t y) {
  if (s.kind != M_POLY1 || s.cls == nullptr) return 1.0;
  return class_params.scalar_type() == at::kFloat ? static_cast<double>(static_cast<const float*>(s.cls)[y])
                                                  : static_cast<const double*>(s.cls)[y];
}

// (N, K, S) sizes of the logits, with the targets' shape checked against them
Layout margin_layout(const at::Tensor& logits, const at::Tensor& targets) {
  return loss_layout(logits, targets, "fused_margin");
}

// fn(row, x_row, grad_row) over every row, in parallel: rows of a (N, K) tensor in place; positions of a
// (N, K, S) tensor through per-thread tiles of up to 64 rows (gathered, and the gradient scattered back)
template <typename T, typename Fn>
void over_rows(const T* x, T* grad, const Layout& l, const Fn& fn) {
  const int64_t k = l.k, sp = l.sp;
  if (sp == 1) {
    at::parallel_for(0, l.n, grain_rows(k), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(i, x + i * k, grad == nullptr ? nullptr : grad + i * k);
    });
    return;
  }
  const int64_t tile = std::min<int64_t>(64, std::max<int64_t>(8, 16384 / k));
  const int64_t per_image = (sp + tile - 1) / tile;
  at::parallel_for(0, l.n * per_image, std::max<int64_t>(1, grain_rows(k) / tile), [&](int64_t begin, int64_t end) {
    std::vector<T> xb(static_cast<size_t>(tile * k)), gb(grad == nullptr ? 0 : static_cast<size_t>(tile * k));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t img = c / per_image, s0 = (c % per_image) * tile, w = std::min(tile, sp - s0);
      const T* src = x + img * k * sp + s0;
      transpose(src, sp, k, w, xb.data(), k);
      for (int64_t t = 0; t < w; ++t)
        fn(img * sp + s0 + t, xb.data() + t * k, grad == nullptr ? nullptr : gb.data() + t * k);
      if (grad != nullptr) {
        T* dst = grad + img * k * sp + s0;
        transpose(gb.data(), k, w, k, dst, sp);
      }
    }
  });
}

// The row's label for the cross entropy: y, or −1 when ignored (or outside [0, K): counted in bad)
inline int64_t margin_label(int64_t y, int64_t k, bool has_ignore, int64_t ignore, int64_t& bad) {
  if (has_ignore && y == ignore) return -1;
  if (y < 0 || y >= k) {
    ++bad;
    return -1;
  }
  return y;
}

// Whether (N, K, S) logits take the lane path of margin_lanes.h: positions along the vector lanes, for the
// kinds it computes, at least one full block of positions per image (fewer: mostly padding, the tile path
// of over_rows is faster) and class indices exact in the input dtype
template <typename T>
bool margin_by_lanes(const Layout& l, const MarginSpec& s) {
  return l.sp >= MarginLanes<T>::W && margin_lanes_kind(s.kind) && l.k < (int64_t{1} << 24);
}

// Whether float32 (N, K) rows take the margin lane kernels, W rows to a tile (float64 lanes take std::exp per
// lane: no faster than the row kernel)
template <typename T>
bool margin_rows_by_lanes(const Layout& l, const MarginSpec& s) {
  return std::is_same<T, float>::value && l.sp == 1 && l.k <= kRowLaneClasses && margin_lanes_kind(s.kind);
}

// Which kernels a margin loss's logits take, asked once by the forward and the backward alike: row_lanes
// (margin_rows_by_lanes), lanes (those or margin_by_lanes's positions), else the row kernels
struct MarginPath {
  bool row_lanes, lanes;
};

MarginPath margin_path(const at::Tensor& x, const Layout& l, const MarginSpec& s) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const bool row_lanes = f32 && margin_rows_by_lanes<float>(l, s);
  return {row_lanes, row_lanes || (f32 ? margin_by_lanes<float>(l, s) : margin_by_lanes<double>(l, s))};
}

// The forward statistics of (N, K) rows by lanes into op (margin_rows_by_lanes): blocks of W rows, each
// transposed into a tile (class j of row t at j·W + t; a partial block, at the end of the rows or of a part,
// padded with zeros and labels −1);
// returns the number of labels outside [0, K). part_sums (CALS's training statistics, or null): the rows in
// cals_parts's fixed parts, each part's blocks in order on one thread into per-lane float64 sums, added into
// its part in lane order at the part's end (the parts' order and bounds depend on the shape only). df (the
// confidence penalty, never with part_sums, or null): f'(p) of block b (rows b·W ...) at df + b·K·W
// (margin_df_entries).
template <typename T>
int64_t margin_forward_by_row_lanes(const T* x, const Layout& l, const MarginSpec& s, const int64_t* tp,
                                    bool has_ignore, int64_t ignore, double* op, double* part_sums, int64_t parts,
                                    T* df = nullptr) {
  constexpr int W = MarginLanes<T>::W;
  using D = typename MarginLanes<T>::D;
  const int64_t k = l.k, n = l.n;
  const bool sums = part_sums != nullptr;
  const int64_t per = sums ? (n + parts - 1) / parts : W;  // rows of a parallel item: a part, or a block
  const int64_t items = sums ? parts : (n + W - 1) / W;
  std::atomic<int64_t> n_bad{0};
  at::parallel_for(0, items, sums ? 1 : std::max<int64_t>(1, grain_rows(k) / W), [&](int64_t begin, int64_t end) {
    std::vector<T> tile(static_cast<size_t>(k * W)), e(static_cast<size_t>(s.kind == M_CP ? k * W : 0));
    std::vector<D> lanes(static_cast<size_t>(sums ? 2 * k + 1 : 0));
    alignas(64) T y[W];
    double o[W * N_STAT];
    int64_t bad = 0;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t r0 = std::min(n, c * per), r1 = std::min(n, (c + 1) * per);
      if (sums) std::fill(lanes.begin(), lanes.end(), D{});
      for (int64_t row0 = r0; row0 < r1; row0 += W) {
        const int64_t w = std::min<int64_t>(W, r1 - row0);
        for (int t = 0; t < W; ++t) {
          y[t] = t < w ? static_cast<T>(margin_label(tp[row0 + t], k, has_ignore, ignore, bad)) : T(-1);
        }
        const T* src = x + row0 * k;
        transpose(src, k, w, k, tile.data(), W);
        for (int64_t t = w; t < W; ++t)
          for (int64_t j = 0; j < k; ++j) tile[j * W + t] = T(0);
        double* out = w == W ? op + row0 * N_STAT : o;
        margin_forward_lanes<T>(tile.data(), W, k, y, s, e.data(), out, sums ? lanes.data() : nullptr,
                                df == nullptr ? nullptr : df + row0 * k);
        if (w < W) std::copy(o, o + w * N_STAT, op + row0 * N_STAT);
      }
      if (sums && r0 < r1) {
        double* part = part_sums + c * (2 * k + 1);
        for (int64_t i = 0; i < 2 * k + 1; ++i)
          for (int t = 0; t < W; ++t) part[i] += lanes[i][t];
      }
    }
    if (bad) n_bad += bad;
  });
  return n_bad.load();
}

// A block's labels y and incoming gradients gce, gpen (W lanes) for its w rows from row0: grads(i, gce, gpen)
// says whether row i has a label; the padding's lanes have label −1 and no gradient
template <typename T, int W, typename Grads>
inline void block_grads(const Grads& grads, const int64_t* tp, int64_t row0, int64_t w, T* y, double* gce,
                        double* gpen) {
  for (int t = 0; t < W; ++t) {
    y[t] = T(-1);
    gce[t] = gpen[t] = 0.0;
    if (t < w && grads(row0 + t, gce[t], gpen[t])) y[t] = static_cast<T>(tp[row0 + t]);
  }
}

// a partial block's statistics: its w rows' from ob copied into o (W rows), the padding's zeros but 1/Σ = 1;
// returns o
template <int W>
inline const double* padded_stats(const double* ob, int64_t w, double* o) {
  std::fill(o, o + W * N_STAT, 0.0);
  std::copy(ob, ob + w * N_STAT, o);
  for (int64_t t = w; t < W; ++t) o[t * N_STAT + S_INV] = 1.0;
  return o;
}

// The gradient of (N, K) rows by lanes into grad (margin_rows_by_lanes): blocks of W rows transposed into a
// tile and their gradient transposed back (a partial block's padding has no gradient and is not written)
template <typename T, typename Grads>
void margin_backward_by_row_lanes(const T* x, T* grad, const Layout& l, const MarginSpec& s, const int64_t* tp,
                                  const double* op, const Grads& grads, const T* df = nullptr) {
  constexpr int W = MarginLanes<T>::W;
  const int64_t k = l.k, n = l.n;
  at::parallel_for(0, (n + W - 1) / W, std::max<int64_t>(1, grain_rows(k) / W), [&](int64_t begin, int64_t end) {
    std::vector<T> tile(static_cast<size_t>(2 * k * W));
    T* g = tile.data() + k * W;
    alignas(64) T y[W];
    double gce[W], gpen[W], o[W * N_STAT];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t row0 = c * W, w = std::min<int64_t>(W, n - row0);
      block_grads<T, W>(grads, tp, row0, w, y, gce, gpen);
      const T* src = x + row0 * k;
      transpose(src, k, w, k, tile.data(), W);
      const double* ob = op + row0 * N_STAT;
      if (w < W) {
        for (int64_t t = w; t < W; ++t)
          for (int64_t j = 0; j < k; ++j) tile[j * W + t] = T(0);
        ob = padded_stats<W>(ob, w, o);
      }
      margin_backward_lanes<T>(tile.data(), W, k, y, s, ob, gce, gpen, g, df == nullptr ? nullptr : df + row0 * k);
      T* dst = grad + row0 * k;
      transpose(g, W, k, w, dst, k);
    }
  });
}

// the blocks of W positions in parallel: fn(image, first position, positions in the block (W but in an
// image's last block), a per-thread tile of K * W entries); by_image: the images in parallel, each image's
// blocks in order on one thread
template <typename T, typename Fn>
void over_lane_blocks(const Layout& l, const Fn& fn, bool by_image = false) {
  constexpr int W = MarginLanes<T>::W;
  const int64_t per_image = (l.sp + W - 1) / W;
  if (by_image) {
    at::parallel_for(0, l.n, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> tile;
      for (int64_t img = begin; img < end; ++img)
        for (int64_t s0 = 0; s0 < l.sp; s0 += W) fn(img, s0, std::min<int64_t>(W, l.sp - s0), tile);
    });
    return;
  }
  at::parallel_for(0, l.n * per_image, std::max<int64_t>(1, grain_rows(l.k) / W), [&](int64_t begin, int64_t end) {
    std::vector<T> tile;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t s0 = (c % per_image) * W;
      fn(c / per_image, s0, std::min<int64_t>(W, l.sp - s0), tile);
    }
  });
}

// The forward statistics of (N, K, S) logits by lanes into op; returns the number of labels outside [0, K).
// part_sums (CALS's training statistics, or null): image i's into part_sums + i (2K + 1) (the parts of
// cals_parts); each image's blocks in order on one thread add into per-lane float64 sums, which its last block
// adds into the part in lane order (a scalar float64 chain per lane and class had cost more than the pass)
template <typename T>
int64_t margin_forward_by_lanes(const T* x, const Layout& l, const MarginSpec& s, const int64_t* tp, bool has_ignore,
                                int64_t ignore, double* op, double* part_sums = nullptr, T* df = nullptr) {
  constexpr int W = MarginLanes<T>::W;
  const int64_t k = l.k, sp = l.sp, per_image = (sp + W - 1) / W;
  std::atomic<int64_t> n_bad{0};
  using D = typename MarginLanes<T>::D;
  over_lane_blocks<T>(l, [&](int64_t img, int64_t s0, int64_t w, std::vector<T>& tile) {
    thread_local std::vector<T> e;
    if (s.kind == M_CP && static_cast<int64_t>(e.size()) < k * W) e.resize(static_cast<size_t>(k * W));
    thread_local std::vector<D> lanes;
    if (part_sums != nullptr && s0 == 0) lanes.assign(static_cast<size_t>(2 * k + 1), D{});
    D* ls = part_sums == nullptr ? nullptr : lanes.data();
    const auto flush = [&] {  // after the image's last block
      if (part_sums == nullptr || s0 + W < sp) return;
      double* sums = part_sums + img * (2 * k + 1);
      for (int64_t i = 0; i < 2 * k + 1; ++i)
        for (int t = 0; t < W; ++t) sums[i] += lanes[i][t];
    };
    const int64_t row0 = img * sp + s0;
    int64_t bad = 0;
    alignas(64) T y[W];
    for (int t = 0; t < W; ++t) {
      y[t] = t < w ? static_cast<T>(margin_label(tp[row0 + t], k, has_ignore, ignore, bad)) : T(-1);
    }
    if (bad) n_bad += bad;
    const T* src = x + img * k * sp + s0;
    T* dfb = df == nullptr ? nullptr : df + (img * per_image + s0 / W) * k * W;
    if (w == W) {
      margin_forward_lanes<T>(src, sp, k, y, s, e.data(), op + row0 * N_STAT, ls, dfb);
      flush();
      return;
    }
    // the image's last, partial block: its positions copied into a tile padded with zeros
    tile.assign(static_cast<size_t>(k * W), T(0));
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < w; ++t) tile[j * W + t] = src[j * sp + t];
    double o[W * N_STAT];
    margin_forward_lanes<T>(tile.data(), W, k, y, s, e.data(), o, ls, dfb);
    std::copy(o, o + w * N_STAT, op + row0 * N_STAT);
    flush();
  }, part_sums != nullptr);
  return n_bad.load();
}

// The gradient of (N, K, S) logits by lanes into grad: row i's label tp[i] (kept when keep(i)) and incoming
// gradients grads(i, gce, gpen)
template <typename T, typename Grads>
void margin_backward_by_lanes(const T* x, T* grad, const Layout& l, const MarginSpec& s, const int64_t* tp,
                              const double* op, const Grads& grads, const T* df = nullptr) {
  constexpr int W = MarginLanes<T>::W;
  const int64_t k = l.k, sp = l.sp, per_image = (sp + W - 1) / W;
  over_lane_blocks<T>(l, [&](int64_t img, int64_t s0, int64_t w, std::vector<T>& tile) {
    const int64_t row0 = img * sp + s0;
    alignas(64) T y[W];
    double gce[W], gpen[W];
    block_grads<T, W>(grads, tp, row0, w, y, gce, gpen);
    const T* src = x + img * k * sp + s0;
    T* dst = grad + img * k * sp + s0;
    const T* dfb = df == nullptr ? nullptr : df + (img * per_image + s0 / W) * k * W;
    if (w == W) {
      margin_backward_lanes<T>(src, sp, k, y, s, op + row0 * N_STAT, gce, gpen, dst, dfb);
      return;
    }
    // the last, partial block through a tile (the padding's lanes have no gradient and are not written back)
    tile.assign(static_cast<size_t>(2 * k * W), T(0));
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < w; ++t) tile[j * W + t] = src[j * sp + t];
    double o[W * N_STAT];
    T* g = tile.data() + k * W;
    margin_backward_lanes<T>(tile.data(), W, k, y, s, padded_stats<W>(op + row0 * N_STAT, w, o), gce, gpen, g, dfb);
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < w; ++t) dst[j * sp + t] = g[j * W + t];
  });
}

// Entries of the confidence penalty's kept f'(p): (M, K) in the rows' layout on the row path; on the lane paths
// K·W per block of W positions, in the lanes' order (block b of (N, K) rows: rows b·W ...; of (N, K, S) logits:
// image b / ⌈S/W⌉, positions from (b mod ⌈S/W⌉)·W), the padding's lanes included
int64_t margin_df_entries(const at::Tensor& x, const Layout& l, bool lanes) {
  if (!lanes) return l.n * l.sp * l.k;
  const int64_t w = x.scalar_type() == at::kFloat ? MarginLanes<float>::W : MarginLanes<double>::W;
  const int64_t blocks = l.sp == 1 ? (l.n + w - 1) / w : l.n * ((l.sp + w - 1) / w);
  return blocks * l.k * w;
}

struct MarginForward {
  at::Tensor loss;   // reduced, or the targets' shape for "none", in the logits' dtype
  at::Tensor stats;  // (M, N_STAT) float64 per row
  at::Tensor sums;   // CALS's statistics (2K + 1) in the logits' dtype when asked for, else empty
  at::Tensor df;     // the confidence penalty's f'(p) in the logits' dtype when kept (margin_df_entries)
  at::Tensor ex;     // the rows' exps (M, K) when kept (the row path of the autograd nodes), else undefined
};

// The CALS statistics' parts: a fixed split of the rows (depending on N, K and the positions only), each
// part's rows accumulated in order and the parts added in order, so the sums do not depend on the thread
// count. (N, K) rows: up to 64 parts of >= 2^14 entries; (N, K, d1, ...): one part per image.
int64_t cals_parts(const Layout& l) {
  return l.sp == 1 ? std::max<int64_t>(1, std::min<int64_t>({64, l.n * l.k >> 14, l.n})) : l.n;
}

// fn(part, row, x_row) over every row, the parts in parallel and each part's rows in order (over_rows on the
// part's own rows, nested: it runs them on the calling thread), then done(part) once its rows are through
template <typename T, typename Fn, typename Done>
void over_row_parts(const T* x, const Layout& l, int64_t parts, const Fn& fn, const Done& done) {
  const int64_t per = l.sp == 1 ? (l.n + parts - 1) / parts : 1;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t r0 = std::min(l.n, c * per), r1 = std::min(l.n, (c + 1) * per);
      if (r0 >= r1) continue;
      const Layout part{r1 - r0, l.k, l.sp};
      over_rows<T>(x + r0 * l.k * l.sp, nullptr, part, [&](int64_t i, const T* row, T*) {
        fn(c, r0 * l.sp + i, row);
      });
      done(c);
    }
  });
}

// CALS's statistics on the row path: each part's kept rows in groups of kRows (in order), a group's 2K sums
// added in the dtype (cals_lanes: a vector add per entry) and each group into the part's float64 sums. Per
// row that is 2K float64 conversions and additions fewer than adding every entry in float64 (a third of
// the forward at 4096 x 100); the rounding stays within the torch path's (whose sums over all the rows are
// in the dtype). The groups follow the rows' order within the part: fixed by the shape, not the threads.
template <typename T>
struct CalsGroups {
  static constexpr int64_t kRows = 16;
  int64_t k;
  double* part_sums;                // (parts, 2K + 1) float64
  std::vector<T> group;             // (parts, 2K) in the dtype
  std::vector<int64_t> rows;        // the rows in each part's open group
  CalsGroups(int64_t parts, int64_t k_, double* sums)
      : k(k_), part_sums(sums), group(static_cast<size_t>(parts * 2 * k_), T(0)), rows(static_cast<size_t>(parts), 0) {}
  T* open(int64_t c) { return group.data() + c * 2 * k; }
  double* part(int64_t c) { return part_sums + c * (2 * k + 1); }
  // a kept row was added into open(c): the part's count, and the group closed when full
  void added(int64_t c) {
    part(c)[2 * k] += 1.0;
    if (++rows[c] == kRows) close(c);
  }
  void close(int64_t c) {
    if (rows[c] == 0) return;
    T* g = open(c);
    double* out = part(c);
    for (int64_t j = 0; j < 2 * k; ++j) {
      out[j] += static_cast<double>(g[j]);
      g[j] = T(0);
    }
    rows[c] = 0;
  }
};

MarginForward margin_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t kind,
                             at::ArrayRef<double> params, c10::optional<int64_t> ignore_index,
                             bool penalty_all_rows, int64_t reduction, at::Tensor class_params = at::Tensor(),
                             bool want_sums = false, bool keep_df = false, bool keep_e = false) {
  const Layout l = margin_layout(logits, targets);
  MarginSpec s = margin_spec(kind, params);
  margin_class_params(s, class_params, logits);
  TORCH_CHECK_VALUE(!want_sums || kind == M_CALS, "only CALS (kind 4) returns statistics");
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "`reduction` must be 0, 1 or 2");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const int64_t rows = l.n * l.sp, k = l.k;
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  at::Tensor stats = at::empty({rows, N_STAT}, x.options().dtype(at::kDouble));
  const int64_t* tp = t.data_ptr<int64_t>();
  double* op = stats.data_ptr<double>();
  std::atomic<int64_t> n_bad{0};
  const int64_t parts = want_sums ? cals_parts(l) : 0;
  std::vector<double> part_sums(static_cast<size_t>(parts * (2 * k + 1)), 0.0);
  // (CALS's statistics: one part per image on either path, its positions in order)
  const MarginPath path = margin_path(x, l, s);
  const bool row_lanes = path.row_lanes, lanes = path.lanes;
  // (the confidence penalty's f'(p), kept for the backward of the autograd node: decisions 208, 269)
  at::Tensor df;
  if (keep_df && s.kind == M_CP) df = at::empty({margin_df_entries(x, l, lanes)}, x.options());
  // (the row path's exps, kept for the backward of the autograd nodes: decision 220)
  at::Tensor ex;
  if (keep_e && !lanes && l.sp == 1) ex = at::empty({rows, k}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_margin", [&] {
    scalar_t* dfp = df.defined() ? df.data_ptr<scalar_t>() : nullptr;
    if (row_lanes) {
      n_bad += margin_forward_by_row_lanes<scalar_t>(x.data_ptr<scalar_t>(), l, s, tp, has_ignore, ignore, op,
                                                     want_sums ? part_sums.data() : nullptr, parts, dfp);
      return;
    }
    if (lanes) {
      n_bad += margin_forward_by_lanes<scalar_t>(x.data_ptr<scalar_t>(), l, s, tp, has_ignore, ignore, op,
                                                 want_sums ? part_sums.data() : nullptr, dfp);
      return;
    }
    const bool scratch = s.kind == M_CP;
    scalar_t* exp_ = ex.defined() ? ex.data_ptr<scalar_t>() : nullptr;
    CalsGroups<scalar_t> groups(want_sums ? parts : 0, k, part_sums.data());
    // (part: the row's part of the statistics, −1 without them)
    const auto row_fn = [&](int64_t i, const scalar_t* row, int64_t part) {
      int64_t bad = 0;
      const int64_t y = margin_label(tp[i], k, has_ignore, ignore, bad);
      if (bad) n_bad += bad;
      thread_local std::vector<scalar_t> buffer;
      if (scratch && static_cast<int64_t>(buffer.size()) < k) buffer.resize(static_cast<size_t>(k));
      const bool kept = part >= 0 && !(has_ignore && tp[i] == ignore);
      margin_forward_row<scalar_t>(row, k, y, s, scratch ? buffer.data() : nullptr, op + i * N_STAT,
                                   kept ? groups.open(part) : nullptr, dfp == nullptr ? nullptr : dfp + i * k,
                                   exp_ == nullptr ? nullptr : exp_ + i * k);
      if (kept) groups.added(part);
    };
    if (want_sums) {
      over_row_parts<scalar_t>(
          x.data_ptr<scalar_t>(), l, parts, [&](int64_t c, int64_t i, const scalar_t* row) { row_fn(i, row, c); },
          [&](int64_t c) { groups.close(c); });
    } else {
      over_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, l,
                          [&](int64_t i, const scalar_t* row, scalar_t*) { row_fn(i, row, -1); });
    }
  });
  // (the parts added in float64, then rounded once to the logits' dtype, as the torch path returns them)
  at::Tensor sums = at::empty({want_sums ? 2 * k + 1 : 0}, x.options());
  if (want_sums) {
    std::vector<double> out(static_cast<size_t>(2 * k + 1), 0.0);
    for (int64_t c = 0; c < parts; ++c)
      for (int64_t j = 0; j < 2 * k + 1; ++j) out[j] += part_sums[static_cast<size_t>(c * (2 * k + 1) + j)];
    // Σ_i h_ik = (Σ_i (max_i − x_ik) − m·count) / s
    for (int64_t j = k; j < 2 * k; ++j) out[j] = (out[j] - s.margin * out[2 * k]) / s.scale;
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_margin_sums", [&] {
      scalar_t* sp = sums.data_ptr<scalar_t>();
      for (int64_t j = 0; j < 2 * k + 1; ++j) sp[j] = static_cast<scalar_t>(out[j]);
    });
  }
  if (n_bad.load() > 0) raise_bad_label(tp, rows, k, has_ignore, ignore);
  at::Tensor loss;
  if (reduction == 0) {
    loss = at::empty(targets.sizes(), logits.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_margin_none", [&] {
      scalar_t* lp = loss.data_ptr<scalar_t>();
      for (int64_t i = 0; i < rows; ++i) {
        const bool keep = !(has_ignore && tp[i] == ignore);
        const double* o = op + i * N_STAT;
        const double w = keep ? margin_row_weight(s, class_params, tp[i]) : 1.0;
        lp[i] = static_cast<scalar_t>(
            w * ((keep ? o[S_CE] : 0.0) + s.coef * (keep || penalty_all_rows ? o[S_PEN] : 0.0)));
      }
    });
  } else {
    // summed in row order on one thread: the same value for any thread setting
    // (Poly-1's class weights: each row's terms times w[y], "mean" over Σ w[y] of the kept rows)
    double ce = 0.0, pen = 0.0, n_ce = 0.0, n_pen = 0.0;
    for (int64_t i = 0; i < rows; ++i) {
      const bool keep = !(has_ignore && tp[i] == ignore);
      const double* o = op + i * N_STAT;
      const double w = keep ? margin_row_weight(s, class_params, tp[i]) : 1.0;
      if (keep) {
        ce += w * o[S_CE];
        n_ce += w;
      }
      if (keep || penalty_all_rows) {
        pen += w * o[S_PEN];
        n_pen += w;
      }
    }
    // "mean" with no row kept is 0/0 = NaN, as the torch path
    const double total = reduction == 2 ? ce + s.coef * pen : ce / n_ce + s.coef * (pen / n_pen);
    loss = at::scalar_tensor(total, logits.options());
  }
  return {loss, stats, sums, df, ex};
}

at::Tensor margin_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& targets,
                           const at::Tensor& stats, int64_t kind, at::ArrayRef<double> params,
                           c10::optional<int64_t> ignore_index, bool penalty_all_rows, int64_t reduction,
                           at::Tensor class_params = at::Tensor(), const at::Tensor& kept_df = at::Tensor(),
                           const at::Tensor& kept_e = at::Tensor()) {
  const Layout l = margin_layout(logits, targets);
  MarginSpec s = margin_spec(kind, params);
  margin_class_params(s, class_params, logits);
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const int64_t rows = l.n * l.sp, k = l.k;
  TORCH_CHECK_VALUE(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.dim() == 2 &&
                        stats.size(0) == rows && stats.size(1) == N_STAT,
                    "`stats` must be the forward's (", rows, ", ", N_STAT, ") float64 statistics");
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  const int64_t* tp = t.data_ptr<int64_t>();
  // the incoming gradient per row: a tensor for "none", one number (stride 0) for "mean" / "sum"
  at::Tensor per_row;
  double single = 0.0, ce_div = 1.0, pen_div = 1.0;
  const double* gp = &single;
  int64_t stride = 0;
  if (reduction == 0) {
    per_row = grad_loss.to(at::kDouble).contiguous();
    TORCH_CHECK_VALUE(per_row.numel() == rows, "`grad_loss` must have one entry per row");
    gp = per_row.data_ptr<double>();
    stride = 1;
  } else {
    single = grad_loss.item<double>();
    if (reduction == 1) {
      double n_ce = 0.0, n_other = 0.0;
      for (int64_t i = 0; i < rows; ++i) {
        if (has_ignore && tp[i] == ignore) {
          n_other += 1.0;
        } else {
          n_ce += margin_row_weight(s, class_params, tp[i]);
        }
      }
      ce_div = n_ce;
      pen_div = penalty_all_rows ? n_ce + n_other : ce_div;
    }
  }
  at::Tensor grad = at::empty(x.sizes(), x.options());
  const double* op = stats.data_ptr<double>();
  const MarginPath path = margin_path(x, l, s);
  const bool row_lanes = path.row_lanes, lanes = path.lanes;
  TORCH_CHECK_VALUE(!kept_df.defined() || (kept_df.is_contiguous() &&
                                            kept_df.numel() == margin_df_entries(x, l, lanes) &&
                                            kept_df.scalar_type() == x.scalar_type()),
                    "`kept_df` must be the forward's array of f'(p)");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_margin_backward", [&] {
    const scalar_t* dfp = kept_df.defined() ? kept_df.data_ptr<scalar_t>() : nullptr;
    if (lanes) {
      // whether row i has a label (its cross entropy kept), with its incoming gradients
      const auto grads = [&](int64_t i, double& gce, double& gpen) {
        const bool keep = !(has_ignore && tp[i] == ignore);
        const double gi = gp[i * stride] * (keep ? margin_row_weight(s, class_params, tp[i]) : 1.0);
        gce = keep ? gi / ce_div : 0.0;
        gpen = keep || penalty_all_rows ? s.coef * gi / pen_div : 0.0;
        return keep;
      };
      if (row_lanes)
        margin_backward_by_row_lanes<scalar_t>(x.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), l, s, tp, op, grads,
                                               dfp);
      else
        margin_backward_by_lanes<scalar_t>(x.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), l, s, tp, op, grads, dfp);
      return;
    }
    const scalar_t* exp_ = kept_e.defined() && l.sp == 1 ? kept_e.data_ptr<scalar_t>() : nullptr;
    over_rows<scalar_t>(x.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), l,
                        [&](int64_t i, const scalar_t* row, scalar_t* g) {
                          const bool keep = !(has_ignore && tp[i] == ignore);
                          const double gi = gp[i * stride] * (keep ? margin_row_weight(s, class_params, tp[i]) : 1.0);
                          const double gce = keep ? gi / ce_div : 0.0;
                          const double gpen = keep || penalty_all_rows ? s.coef * gi / pen_div : 0.0;
                          if (gce == 0.0 && gpen == 0.0) {
                            std::fill(g, g + k, scalar_t(0));
                            return;
                          }
                          margin_backward_row<scalar_t>(row, k, keep ? tp[i] : -1, s, op + i * N_STAT, gce, gpen, g,
                                                        dfp == nullptr ? nullptr : dfp + i * k,
                                                        exp_ == nullptr ? nullptr : exp_ + i * k);
                        });
  });
  return grad;
}

// The options a fused margin autograd node keeps for its backward, and that backward from them (saved:
// logits, targets, the per-row statistics, then the node's own tensors)
void save_margin_options(AutogradContext* ctx, int64_t kind, at::ArrayRef<double> params,
                         c10::optional<int64_t> ignore_index, bool penalty_all_rows, int64_t reduction) {
  ctx->saved_data["kind"] = kind;
  ctx->saved_data["params"] = std::vector<double>(params.begin(), params.end());
  ctx->saved_data["has_ignore"] = ignore_index.has_value();
  ctx->saved_data["ignore"] = ignore_index.value_or(0);
  ctx->saved_data["all"] = penalty_all_rows;
  ctx->saved_data["reduction"] = reduction;
}

at::Tensor margin_backward_saved(AutogradContext* ctx, const at::Tensor& grad_loss, const variable_list& saved,
                                 const at::Tensor& class_params, const at::Tensor& kept_df = at::Tensor(),
                                 const at::Tensor& kept_e = at::Tensor()) {
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "the fused CPU margin loss is differentiable once only; for higher-order gradients run it with "
              "torchcal.functional.use_cpu_extension(False)");
  const std::vector<double> params = ctx->saved_data["params"].toDoubleVector();
  c10::optional<int64_t> ignore;
  if (ctx->saved_data["has_ignore"].toBool()) ignore = ctx->saved_data["ignore"].toInt();
  return margin_backward(grad_loss, saved[0], saved[1], saved[2], ctx->saved_data["kind"].toInt(), params, ignore,
                         ctx->saved_data["all"].toBool(), ctx->saved_data["reduction"].toInt(), class_params,
                         kept_df, kept_e);
}

class FusedMargin : public torch::autograd::Function<FusedMargin> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t kind,
                            at::ArrayRef<double> params, c10::optional<int64_t> ignore_index, bool penalty_all_rows,
                            int64_t reduction, bool keep_df) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // (keep_df: a backward will run, and the confidence penalty keeps f'(p) for it (decision 208), every kind
    // its rows' exps (decision 220))
    MarginForward f = margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction,
                                     at::Tensor(), false, keep_df, keep_df);
    ctx->save_for_backward({logits, targets, f.stats, f.df, f.ex});
    save_margin_options(ctx, kind, params, ignore_index, penalty_all_rows, reduction);
    return f.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = margin_backward_saved(ctx, grads[0], saved, at::Tensor(), saved[3], saved[4]);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_margin_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t kind,
                            at::ArrayRef<double> params, c10::optional<int64_t> ignore_index, bool penalty_all_rows,
                            int64_t reduction) {
  return margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction).loss;
}

at::Tensor fused_margin_autograd(const at::Tensor& logits, const at::Tensor& targets, int64_t kind,
                                 at::ArrayRef<double> params, c10::optional<int64_t> ignore_index,
                                 bool penalty_all_rows, int64_t reduction) {
  const bool keep_df = at::GradMode::is_enabled() && logits.requires_grad();
  return FusedMargin::apply(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction, keep_df);
}

// the same loss as two plain operators for torch.compile (as fused_true_class_fwd / _bwd): the forward
// returns the per-row statistics the backward reads
std::tuple<at::Tensor, at::Tensor> fused_margin_fwd_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                        int64_t kind, at::ArrayRef<double> params,
                                                        c10::optional<int64_t> ignore_index, bool penalty_all_rows,
                                                        int64_t reduction) {
  MarginForward f = margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction);
  return {f.loss, f.stats};
}

// -- the margin losses with per-class numbers (CALS, Poly-1's class weights) -------------------------------
//
//   fused_margin_class(logits, targets, kind, params, class_params, ignore_index, penalty_all_rows, reduction,
//                      sums) -> (loss, sums)
//
// As fused_margin, with class_params (margin.h: CALS (4, K), Poly-1 (K,) or None) and, for CALS with sums,
// the training statistics (2K + 1) of the kept rows (cals_statistics; float64 sums rounded to the logits'
// dtype): per class Σ clamp(r_k, λ_min, λ_max) and Σ h_k = (Σ (max − x_k) − m·count)/s, then the row count
// (else an empty tensor). They are not differentiable.

class FusedMarginClass : public torch::autograd::Function<FusedMarginClass> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               int64_t kind, at::ArrayRef<double> params,
                               const c10::optional<at::Tensor>& class_params, c10::optional<int64_t> ignore_index,
                               bool penalty_all_rows, int64_t reduction, bool sums, bool keep_e) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor cls = class_params.value_or(at::Tensor());
    // (keep_e: a backward will run, for which the rows' exps are kept: decision 220)
    MarginForward f =
        margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction, cls, sums, false, keep_e);
    ctx->save_for_backward({logits, targets, f.stats, cls, f.ex});
    ctx->mark_non_differentiable({f.sums});
    save_margin_options(ctx, kind, params, ignore_index, penalty_all_rows, reduction);
    return {f.loss, f.sums};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = margin_backward_saved(ctx, grads[0], saved, saved[3], at::Tensor(), saved[4]);
    return {grad,         at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> fused_margin_class_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                          int64_t kind, at::ArrayRef<double> params,
                                                          const c10::optional<at::Tensor>& class_params,
                                                          c10::optional<int64_t> ignore_index, bool penalty_all_rows,
                                                          int64_t reduction, bool sums) {
  MarginForward f = margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction,
                                   class_params.value_or(at::Tensor()), sums);
  return {f.loss, f.sums};
}

std::tuple<at::Tensor, at::Tensor> fused_margin_class_autograd(const at::Tensor& logits, const at::Tensor& targets,
                                                               int64_t kind, at::ArrayRef<double> params,
                                                               const c10::optional<at::Tensor>& class_params,
                                                               c10::optional<int64_t> ignore_index,
                                                               bool penalty_all_rows, int64_t reduction, bool sums) {
  const bool keep_e = at::GradMode::is_enabled() && logits.requires_grad();
  variable_list out = FusedMarginClass::apply(logits, targets, kind, params, class_params, ignore_index,
                                              penalty_all_rows, reduction, sums, keep_e);
  return {out[0], out[1]};
}

// the compile pair (as fused_margin_fwd / _bwd): the forward also returns the per-row statistics
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_margin_class_fwd_cpu(
    const at::Tensor& logits, const at::Tensor& targets, int64_t kind, at::ArrayRef<double> params,
    const c10::optional<at::Tensor>& class_params, c10::optional<int64_t> ignore_index, bool penalty_all_rows,
    int64_t reduction, bool sums) {
  MarginForward f = margin_forward(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction,
                                   class_params.value_or(at::Tensor()), sums);
  return {f.loss, f.sums, f.stats};
}

at::Tensor fused_margin_class_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& targets,
                                      const at::Tensor& stats, int64_t kind, at::ArrayRef<double> params,
                                      const c10::optional<at::Tensor>& class_params,
                                      c10::optional<int64_t> ignore_index, bool penalty_all_rows, int64_t reduction) {
  check_backward_labels(logits, targets, ignore_index, "fused_margin_class_bwd");
  return margin_backward(grad_loss, logits, targets, stats, kind, params, ignore_index, penalty_all_rows, reduction,
                         class_params.value_or(at::Tensor()));
}

at::Tensor fused_margin_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& targets,
                                const at::Tensor& stats, int64_t kind, at::ArrayRef<double> params,
                                c10::optional<int64_t> ignore_index, bool penalty_all_rows, int64_t reduction) {
  check_backward_labels(logits, targets, ignore_index, "fused_margin_bwd");
  return margin_backward(grad_loss, logits, targets, stats, kind, params, ignore_index, penalty_all_rows, reduction);
}

// Calls run(std::integral_constant<int, k>) for 2 <= k <= Max, else run(std::integral_constant<int, 0>)
template <int Max, typename Run>
void with_fixed_length(int64_t k, const Run& run) {
  if constexpr (Max < 2) {
    run(std::integral_constant<int, 0>{});
  } else if (k == Max) {
    run(std::integral_constant<int, Max>{});
  } else {
    with_fixed_length<Max - 1>(k, run);
  }
}

// The float64 edges b/M of _binning (as numpy's arange(M + 1) / M; M = 0, no bins: the edges of one bin)
std::vector<double> bin_edges(int64_t m) {
  const int64_t bins = std::max<int64_t>(m, 1);
  std::vector<double> edges(static_cast<size_t>(bins + 1));
  for (int64_t b = 0; b <= bins; ++b) edges[b] = static_cast<double>(b) / static_cast<double>(bins);
  return edges;
}

// The metrics' top-label scan (scan.h) over contiguous CPU probabilities (N, K), rows in parallel:
//   top_label_scan(probs, targets, n_bins, classwise_bins, threshold=None, row_bins=False, bin_vectors=False)
//     -> (conf, correct, top, classwise, stats, bins, vectors)
// conf (N,) in the input dtype, correct (N,) bool; top (3, n_bins) float64 equal-width (count, conf sum,
// correct sum); classwise (3, K, classwise_bins) float64 (count, p sum, label count; bin 0 finished from the
// column totals); stats float64 [largest |row sum − 1|, most negative entry or 0, any non-finite row sum,
// Σ p², labels outside [0, K), then with a threshold the per-sample sums Σ −log p_y, Σ p_y, correct,
// confidence >= threshold, those correct (else 0)] (the caller raises on bad labels); bins (N,) int64
// each row's equal-width top-label bin with row_bins and n_bins > 0 (else empty); vectors (2, n_bins, K)
// float64 with bin_vectors and n_bins > 0 (else empty): per top-label bin Σ p_i and Σ onehot(y_i). n_bins
// or classwise_bins 0: that part is skipped (an empty tensor). The rows are cut into parts that depend on
// the shapes and the requested sums only, and the parts' sums are added in order, so the results are the
// same for any thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
top_label_scan_cpu(const at::Tensor& probs, const at::Tensor& targets, int64_t n_bins, int64_t classwise_bins,
                   c10::optional<double> threshold, bool row_bins, bool bin_vectors) {
  check_rows(probs, "probs", targets, "top_label_scan");
  TORCH_CHECK_VALUE(n_bins >= 0 && classwise_bins >= 0, "bin counts must be >= 0");
  const at::Tensor p = probs.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const int64_t n = p.size(0), k = p.size(1), m = n_bins, mc = classwise_bins;
  const auto f64 = p.options().dtype(at::kDouble);
  // parts of >= 2^14 entries (a hand-off to a waiting OpenMP thread pays for itself), at most 64, and
  // about 8 MB of per-part classwise tables (at least 2 parts; 50k x 1000 had made 64 tables of 368 KB,
  // each allocated, zeroed and summed on every call)
  const int64_t table = mc > 0 ? (3 * mc + 1) * k : 0;
  const int64_t vec_size = bin_vectors && m > 0 ? 2 * m * k : 0;  // per-part vector sums, counted with them
  const int64_t per_part = table + vec_size;
  int64_t parts = std::min<int64_t>({64, std::max<int64_t>(1, n * k >> 14), n});
  if (per_part > 0) parts = std::min<int64_t>(parts, std::max<int64_t>(2, (int64_t{1} << 20) / per_part));
  // and tables that together hold at most an eighth as many numbers as the input: a 256 x 1000 batch had
  // made 15 tables of 46000 float64 (5.5 MB, zeroed and summed) for 1 MB of probabilities (10k x 100 with
  // classwise sums: 1.6-1.8 -> 1.4 ms; 2000 x 1000: 1.9-3.2 -> 1.5 ms)
  if (per_part > 0) parts = std::min<int64_t>(parts, std::max<int64_t>(1, n * k / (8 * per_part)));
  parts = std::max<int64_t>(parts, 1);
  // a multiple of 4 from 4 parts on, so 2 or 4 threads get equal shares (13 parts had split 7/6 on 2)
  if (parts >= 4) parts -= parts % 4;
  const int64_t rows = (n + parts - 1) / std::max<int64_t>(parts, 1);
  at::Tensor conf = at::empty({n}, p.options());
  at::Tensor correct = at::empty({n}, p.options().dtype(at::kBool));
  at::Tensor tops = at::zeros({parts, 3 * m}, f64);
  at::Tensor tables = at::zeros({parts, table}, f64);
  at::Tensor bins = at::empty({row_bins && m > 0 ? n : 0}, p.options().dtype(at::kLong));
  int64_t* bp = bins.numel() > 0 ? bins.data_ptr<int64_t>() : nullptr;
  // (each part zeroes its own vector sums in the parallel loop: no parallel region of its own, and the
  // table is in the cache of the thread that fills it)
  at::Tensor part_vectors = at::empty({vec_size > 0 ? parts : 0, vec_size}, f64);
  double* vp = vec_size > 0 ? part_vectors.data_ptr<double>() : nullptr;
  std::vector<ScanStats> stats(static_cast<size_t>(parts));
  const std::vector<double> edges = bin_edges(m), cw_edges = bin_edges(mc);
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "top_label_scan", [&] {
    const scalar_t* pp = p.data_ptr<scalar_t>();
    const int64_t* tp = t.data_ptr<int64_t>();
    scalar_t* cp = conf.data_ptr<scalar_t>();
    bool* hp = correct.data_ptr<bool>();
    double* topp = tops.data_ptr<double>();
    double* tabp = tables.data_ptr<double>();
    // rows of up to kFixedRows classes take a pass compiled for their length
    const auto run = [&](auto fixed) {
      at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          double* tab = tabp + c * table;
          if (vp != nullptr) std::fill(vp + c * vec_size, vp + (c + 1) * vec_size, 0.0);
          stats[static_cast<size_t>(c)] = scan_rows<scalar_t, decltype(fixed)::value>(
              pp, tp, std::min(n, c * rows), std::min(n, (c + 1) * rows), k, m, edges.data(), mc,
              cw_edges.data(), cp, hp, topp + c * 3 * m, tab, tab + 3 * mc * k, threshold.has_value(),
              static_cast<scalar_t>(threshold.value_or(1.0)), bp,
              vp == nullptr ? nullptr : vp + c * vec_size);
        }
      });
    };
    with_fixed_length<kFixedRows>(k, run);
  });
  ScanStats total;
  for (const ScanStats& s : stats) total.add(s);
  at::Tensor top = tops.sum(0).view({3, m});  // summed in part order
  at::Tensor classwise = at::empty({3, k, mc}, f64);
  if (mc > 0) {
    const at::Tensor sums = tables.sum(0);
    const double* sp = sums.data_ptr<double>();
    double* out = classwise.data_ptr<double>();
    std::copy(sp, sp + 3 * mc * k, out);
    const double* col_total = sp + 3 * mc * k;
    for (int64_t j = 0; j < k; ++j) {  // bin 0 gets the rest of each column, as _ClasswiseAccumulator
      double count = 0.0, psum = 0.0;
      for (int64_t b = 1; b < mc; ++b) {
        count += out[j * mc + b];
        psum += out[k * mc + j * mc + b];
      }
      out[j * mc] = static_cast<double>(n) - count;
      out[k * mc + j * mc] = std::max(col_total[j] - psum, 0.0);
    }
  }
  at::Tensor st = at::empty({10}, f64);
  double* sp = st.data_ptr<double>();
  sp[0] = total.worst;
  sp[1] = total.lowest;
  sp[2] = total.nonfinite ? 1.0 : 0.0;
  sp[3] = total.sum_sq;
  sp[4] = static_cast<double>(total.n_bad);
  sp[5] = total.nll;
  sp[6] = total.p_true;
  sp[7] = static_cast<double>(total.n_correct);
  sp[8] = static_cast<double>(total.n_confident);
  sp[9] = static_cast<double>(total.n_confident_correct);
  at::Tensor vectors = at::zeros({vec_size > 0 ? 2 : 0, m, k}, f64);
  if (vec_size > 0) {  // the parts' sums added in part order
    double* out = vectors.data_ptr<double>();
    for (int64_t c = 0; c < parts; ++c) {
      const double* part = vp + c * vec_size;
      for (int64_t e = 0; e < vec_size; ++e) out[e] += part[e];
    }
  }
  return {conf, correct, top, classwise, st, bins, vectors};
}

// The smallest entry of a row (a loop the compiler vectorises; the row is in cache after the maximum)
template <typename T>
inline T row_min(const T* row, int64_t k) {
  T lo = row[0];
  for (int64_t j = 1; j < k; ++j) lo = row[j] < lo ? row[j] : lo;
  return lo;
}

// The row maximum and Σ_j exp(x_j − max): float32 rows with the fused losses' vectorised exp, float64 rows
// entry by entry; NaN and +inf make the sum NaN, −inf is caught by the caller's minimum
inline double max_and_exp_sum(const float* row, int64_t k, float& mx) {
  mx = row_max(row, k);
  return exp_sum_row(row, k, mx, nullptr, nullptr);
}

inline double max_and_exp_sum(const double* row, int64_t k, double& mx) {
  mx = row[0];
  for (int64_t j = 1; j < k; ++j) mx = mx < row[j] ? row[j] : mx;
  double s = 0.0;
  for (int64_t j = 0; j < k; ++j) s += std::exp(row[j] - mx);
  return s;
}

// The top label of contiguous CPU logits (N, K) without the probability matrix, rows in parallel:
//   logits_top_label(logits, targets, n_bins) -> (conf, correct, top, stats)
// conf = max softmax = 1 / Σ_j exp(x_j − max) (computed in float64 from the row's exp sum; float32 rows
// take the vectorised exp of the fused losses), returned in the input dtype; correct = [first index of the
// row maximum == target] (ties predict the lowest class, as the probability path); top (3, n_bins) float64
// equal-width (count, conf sum, correct sum) of the returned conf, as top_label_scan; stats float64 [rows
// holding a NaN or infinite logit, labels outside [0, K)]: the pass is the finiteness check too. Parts depend on N and K only and
// are summed in order: the same result for any thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logits_top_label_cpu(const at::Tensor& logits,
                                                                                 const at::Tensor& targets,
                                                                                 int64_t n_bins) {
  check_rows(logits, "logits", targets, "logits_top_label");
  TORCH_CHECK_VALUE(n_bins >= 0, "n_bins must be >= 0");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = targets.to(at::kLong).contiguous();
  const int64_t n = x.size(0), k = x.size(1), m = n_bins;
  const auto f64 = x.options().dtype(at::kDouble);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>({64, n * k >> 14, n}));
  const int64_t rows = (n + parts - 1) / parts;
  at::Tensor conf = at::empty({n}, x.options());
  at::Tensor correct = at::empty({n}, x.options().dtype(at::kBool));
  at::Tensor tops = at::zeros({parts, 3 * std::max<int64_t>(m, 1)}, f64);
  std::vector<int64_t> bad(static_cast<size_t>(parts), 0), nonfinite(static_cast<size_t>(parts), 0);
  const std::vector<double> edges = bin_edges(m);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "logits_top_label", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t* tp = t.data_ptr<int64_t>();
    scalar_t* cp = conf.data_ptr<scalar_t>();
    bool* hp = correct.data_ptr<bool>();
    double* topp = tops.data_ptr<double>();
    at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        double* top = topp + c * 3 * std::max<int64_t>(m, 1);
        int64_t n_bad = 0, n_nonfinite = 0;
        for (int64_t i = std::min(n, c * rows); i < std::min(n, (c + 1) * rows); ++i) {
          const scalar_t* row = xp + i * k;
          scalar_t mx;
          const double s = max_and_exp_sum(row, k, mx);
          int64_t pred = 0;
          while (pred < k - 1 && !(row[pred] == mx)) ++pred;
          if (!std::isfinite(s) || !std::isfinite(static_cast<double>(row_min(row, k)))) ++n_nonfinite;
          const scalar_t cf = static_cast<scalar_t>(1.0 / s);
          const int64_t y = tp[i];
          const bool ok = y >= 0 && y < k;
          if (!ok) ++n_bad;
          const bool hit = ok && pred == y;
          cp[i] = cf;
          hp[i] = hit;
          if (m > 0) {
            const double v = static_cast<double>(cf);
            const int64_t b = bin_index(v, m, edges.data());
            top[b] += 1.0;
            top[m + b] += v;
            top[2 * m + b] += hit ? 1.0 : 0.0;
          }
        }
        bad[static_cast<size_t>(c)] = n_bad;
        nonfinite[static_cast<size_t>(c)] = n_nonfinite;
      }
    });
  });
  at::Tensor top = m > 0 ? tops.sum(0).view({3, m}) : at::empty({3, 0}, f64);  // summed in part order
  at::Tensor st = at::empty({2}, f64);
  double* sp = st.data_ptr<double>();
  int64_t total_bad = 0, total_nonfinite = 0;
  for (int64_t c = 0; c < parts; ++c) {
    total_bad += bad[static_cast<size_t>(c)];
    total_nonfinite += nonfinite[static_cast<size_t>(c)];
  }
  sp[0] = static_cast<double>(total_nonfinite);
  sp[1] = static_cast<double>(total_bad);
  return {conf, correct, top, st};
}

// Stable ascending sort of 1-D non-negative float32/64 CPU values carrying a bool flag per value (sort.h):
//   sort_with_flags(values, flags) -> (sorted values, their flags)
std::tuple<at::Tensor, at::Tensor> sort_with_flags_cpu(const at::Tensor& values, const at::Tensor& flags) {
  TORCH_CHECK_VALUE(values.dim() == 1, "`values` must be 1-D, got ", values.sizes());
  TORCH_CHECK_VALUE(values.device().is_cpu() && flags.device().is_cpu(), "sort_with_flags runs on CPU");
  TORCH_CHECK_VALUE(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble,
                    "`values` must be float32 or float64, got ", values.scalar_type());
  TORCH_CHECK_VALUE(flags.dim() == 1 && flags.size(0) == values.size(0) && flags.scalar_type() == at::kBool,
                    "`flags` must be a bool tensor of shape (", values.size(0), ",), got ", flags.scalar_type(),
                    " ", flags.sizes());
  const at::Tensor v = values.contiguous(), f = flags.contiguous();
  at::Tensor out_v = at::empty_like(v), out_f = at::empty_like(f);
  int64_t bad = 0;
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "sort_with_flags", [&] {
    const auto parallel = [](int64_t count, const auto& fn) {
      at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) fn(c);
      });
    };
    bad = radix_sort_with_flags<scalar_t>(v.data_ptr<scalar_t>(), f.data_ptr<bool>(), v.size(0),
                                          out_v.data_ptr<scalar_t>(), out_f.data_ptr<bool>(), parallel);
  });
  TORCH_CHECK_VALUE(bad == 0, "`values` must be non-negative and not NaN (", bad, " are not)");
  return {out_v, out_f};
}

// -- the batch-term losses: per-row statistics and their gradient (batch_terms.h) ----------------------------
//
//   batch_terms_fwd(logits, targets, ignore_index, base, gamma, alpha, entropy, colsum)
//       -> (base (M), r (M), correct (M), entropy (M or 0), column sums (K or 0), saved (M, N_BSTAT) float64)
//   batch_terms_bwd(logits, targets, saved, g_base?, g_r?, g_entropy?, g_colsum?, ignore_index, base, gamma,
//                   alpha, entropy) -> the logits' gradient
//
// logits (N, K, d1, ...) float32/float64 CPU read in place (positions of a spatial tensor through per-thread
// tiles, as over_rows); targets (N, d1, ...) integer labels, M = their count. A label equal to ignore_index
// has no base loss (0) and adds nothing to the column sums; any other label outside [0, K) raises. The (M)
// outputs are in the logits' dtype. The column sums are added per fixed block of rows and the blocks in
// order, so they do not depend on the thread count. The batch terms themselves are computed by the caller
// (torch, with autograd) from these; the backward takes the gradients of the outputs (None: zero).

BatchSpec batch_spec(int64_t base, double gamma, double alpha, int64_t entropy) {
  TORCH_CHECK_VALUE(base >= BB_NLL && base <= BB_LS, "`base` must be 0 (NLL), 1 (focal) or 2 (label smoothing)");
  TORCH_CHECK_VALUE(entropy >= BE_NONE && entropy <= BE_SMOOTH, "`entropy` must be 0 (none), 1 (AvUC) or 2 (S-AvUC)");
  return {base, gamma, alpha, entropy};
}

// fn(block, first row, rows, x rows, grad rows) over fixed blocks of rows in parallel: rows of a (N, K) tensor
// in place, tiles of positions of a (N, K, S) tensor gathered into (and the gradient scattered from)
// per-thread row-major buffers. The blocks depend on K and S only.
template <typename T, typename Fn>
int64_t over_blocks(const T* x, T* grad, const Layout& l, const Fn& fn, bool run = true) {
  const int64_t k = l.k, sp = l.sp;
  if (sp == 1) {
    const int64_t block = grain_rows(k), n_blocks = (l.n + block - 1) / block;
    if (run) {
      at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t r0 = b * block, w = std::min(block, l.n - r0);
          fn(b, r0, w, x + r0 * k, grad == nullptr ? nullptr : grad + r0 * k);
        }
      });
    }
    return n_blocks;
  }
  const int64_t tile = std::min<int64_t>(64, std::max<int64_t>(8, 16384 / k));
  const int64_t per_image = (sp + tile - 1) / tile, n_blocks = l.n * per_image;
  if (!run) return n_blocks;
  at::parallel_for(0, n_blocks, std::max<int64_t>(1, grain_rows(k) / tile), [&](int64_t begin, int64_t end) {
    std::vector<T> xb(static_cast<size_t>(tile * k)), gb(grad == nullptr ? 0 : static_cast<size_t>(tile * k));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t img = c / per_image, s0 = (c % per_image) * tile, w = std::min(tile, sp - s0);
      const T* src = x + img * k * sp + s0;
      transpose(src, sp, k, w, xb.data(), k);
      fn(c, img * sp + s0, w, xb.data(), grad == nullptr ? nullptr : gb.data());
      if (grad != nullptr) {
        T* dst = grad + img * k * sp + s0;
        transpose(gb.data(), k, w, k, dst, sp);
      }
    }
  });
  return n_blocks;
}

// Whether a float32 tensor takes the positions-as-lanes kernels (batch_terms.h): (N, K, S) with at least a
// vector of positions per image, or (N, K) rows of at most kRowLaneClasses classes, gathered W rows to a
// vector (a short row walked on its own is mostly scalar tails and per-row work: at K = 10 the row path's
// time was ~4 scalar exps per row)

bool positions_as_lanes(const at::Tensor& x, const Layout& l) {
  return x.scalar_type() == at::kFloat && l.k <= kLaneClasses &&
         (l.sp >= PosLanes<kWideBytes>::W || (l.sp == 1 && l.k <= kRowLaneClasses));
}

// fn(block, first row, lanes, x, stride, g) over fixed blocks of up to kLaneTile positions of one image, in
// parallel, W positions at a time. Each block's K runs of positions are copied into a per-thread buffer
// (stride kLaneTile; the last vector padded with 0): contiguous copies that the prefetchers follow, where the
// kernels' K strided streams (and as many for the gradient) stall on memory; (N, K) rows (S = 1) are one
// image of N positions, each block's rows transposed into the buffer. With ``grad``, fn writes the gradient
// into a second buffer (the same layout), copied (transposed) out to ``grad`` after the block; ``x2`` (a
// second input of the logits' layout, or null) is copied in as x is, and fn's last argument.
constexpr int64_t kLaneTile = 256;

int64_t lane_blocks(const Layout& l) {
  return l.sp == 1 ? (l.n + kLaneTile - 1) / kLaneTile : l.n * ((l.sp + kLaneTile - 1) / kLaneTile);
}

template <typename Fn>
void over_lanes(const float* x, float* grad, const Layout& l, const Fn& fn, const float* x2 = nullptr) {
  constexpr int W = PosLanes<kWideBytes>::W;
  const bool rows = l.sp == 1;
  const int64_t k = l.k, sp = rows ? l.n : l.sp, per_image = (sp + kLaneTile - 1) / kLaneTile;
  at::parallel_for(0, lane_blocks(l), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xb(static_cast<size_t>(k * kLaneTile)), gb(grad == nullptr ? 0 : xb.size());
    std::vector<float> xb2(x2 == nullptr ? 0 : xb.size());
    for (int64_t b = begin; b < end; ++b) {
      const int64_t img = b / per_image, s0 = (b % per_image) * kLaneTile, w = std::min(sp - s0, kLaneTile);
      const int64_t padded = (w + W - 1) / W * W;
      const int64_t offset = img * k * sp + s0;
      for (const auto& [in, buf] : {std::make_pair(x, &xb), std::make_pair(x2, &xb2)}) {
        if (in == nullptr) continue;
        if (rows) {
          const float* src = in + s0 * k;
          transpose(src, k, w, k, buf->data(), kLaneTile);
        }
        for (int64_t j = 0; j < k; ++j) {
          if (!rows)
            std::memcpy(buf->data() + j * kLaneTile, in + offset + j * sp, static_cast<size_t>(w) * sizeof(float));
          std::fill(buf->data() + j * kLaneTile + w, buf->data() + j * kLaneTile + padded, 0.0f);
        }
        if (!rows) prefetch_runs(in + offset + kLaneTile, sp, k, kLaneTile, false);  // the next block
      }
      for (int64_t q = 0; q < w; q += W) {
        fn(b, img * sp + s0 + q, static_cast<int>(std::min<int64_t>(W, w - q)), xb.data() + q, kLaneTile,
           grad == nullptr ? nullptr : gb.data() + q, x2 == nullptr ? nullptr : xb2.data() + q);
      }
      if (grad != nullptr && rows) {
        float* dst = grad + s0 * k;
        transpose(gb.data(), kLaneTile, k, w, dst, k);
      } else if (grad != nullptr) {
        for (int64_t j = 0; j < k; ++j)
          std::memcpy(grad + offset + j * sp, gb.data() + j * kLaneTile, static_cast<size_t>(w) * sizeof(float));
        prefetch_runs(grad + offset + kLaneTile, sp, k, kLaneTile, true);
      }
    }
  });
}

// Whether the entropy's f' can be kept between forward and backward (the whole-loss node): the layouts whose
// rows or lanes are read in place or through over_lanes (not the spatial tiles of over_blocks)
bool keeps_df(const at::Tensor& x, const Layout& l) { return positions_as_lanes(x, l) || l.sp == 1; }

// targets as a contiguous int64 tensor (itself when it is one: no dispatched call)
at::Tensor as_long(const at::Tensor& targets) {
  return targets.scalar_type() == at::kLong && targets.is_contiguous() ? targets
                                                                       : targets.to(at::kLong).contiguous();
}

// Whether the row exps can be kept between forward and backward (the whole-loss node): the rows read in place
// (the lanes' backward takes its exps in the same pass as its transposed reads, and a spatial tensor's extra
// array of its size costs more in first-touch page faults than its exps)
bool keeps_e(const at::Tensor& x, const Layout& l) { return !positions_as_lanes(x, l) && l.sp == 1; }

// batch_terms_fwd, and with df_out (where keeps_df and an entropy is asked for) f' of every entry in the
// logits' layout, which batch_terms_backward then reads instead of taking its logs again; with e_out (where
// keeps_e) the exps exp(x − max) of every entry, which it reads instead of taking its exps again
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_terms_forward(
    const at::Tensor& logits, const at::Tensor& targets, c10::optional<int64_t> ignore_index, int64_t base,
    double gamma, double alpha, int64_t entropy, bool colsum, at::Tensor* df_out, at::Tensor* e_out = nullptr) {
  const Layout l = margin_layout(logits, targets);
  const BatchSpec s = batch_spec(base, gamma, alpha, entropy);
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = as_long(targets);
  const int64_t rows = l.n * l.sp, k = l.k;
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  const auto opts = x.options();
  at::Tensor out_base = at::empty({rows}, opts), out_r = at::empty({rows}, opts), out_a = at::empty({rows}, opts);
  at::Tensor out_h = at::empty({entropy != BE_NONE ? rows : 0}, opts);
  at::Tensor saved = at::empty({rows, N_BSTAT}, opts.dtype(at::kDouble));
  const int64_t* tp = t.data_ptr<int64_t>();
  double* op = saved.data_ptr<double>();
  std::atomic<int64_t> n_bad{0};
  at::Tensor out_col;
  at::Tensor df;
  // (float32 AvUC's f' is two lane operations from the logits and the row's log-sum-exp: not kept, decision 221)
  const bool cheap_df = entropy == BE_AVUC && x.scalar_type() == at::kFloat;
  if (df_out != nullptr && entropy != BE_NONE && !cheap_df && keeps_df(x, l)) {
    df = at::empty(x.sizes(), x.options());
    *df_out = df;
  }
  at::Tensor ex;
  if (e_out != nullptr && keeps_e(x, l)) {
    ex = at::empty(x.sizes(), x.options());
    *e_out = ex;
  }
  if (positions_as_lanes(x, l)) {
    constexpr int W = PosLanes<kWideBytes>::W;
    const int64_t n_blocks = lane_blocks(l);
    std::vector<double> partial(colsum ? static_cast<size_t>(n_blocks * k) : 0, 0.0);
    float* pb = out_base.data_ptr<float>();
    float* pr = out_r.data_ptr<float>();
    float* pa = out_a.data_ptr<float>();
    float* ph = entropy != BE_NONE ? out_h.data_ptr<float>() : nullptr;
    over_lanes(
        x.data_ptr<float>(), df.defined() ? df.data_ptr<float>() : nullptr, l,
        [&](int64_t b, int64_t r0, int w, const float* xs, int64_t stride, float* dfo, const float*) {
          thread_local std::vector<float> e;
          if (static_cast<int64_t>(e.size()) < k * W) e.resize(static_cast<size_t>(k * W));
          int64_t y[W], bad = 0;
          for (int t = 0; t < W; ++t) y[t] = t < w ? margin_label(tp[r0 + t], k, has_ignore, ignore, bad) : -1;
          if (bad) n_bad += bad;
          double out[W * N_BOUT];
          batch_forward_lanes<kWideBytes>(xs, stride, k, y, w, s, e.data(), colsum ? partial.data() + b * k : nullptr,
                                          op + r0 * N_BSTAT, out, dfo);
          for (int t = 0; t < w; ++t) {
            pb[r0 + t] = static_cast<float>(out[t * N_BOUT + BO_BASE]);
            pr[r0 + t] = static_cast<float>(out[t * N_BOUT + BO_R]);
            pa[r0 + t] = static_cast<float>(out[t * N_BOUT + BO_CORRECT]);
            if (ph != nullptr) ph[r0 + t] = static_cast<float>(out[t * N_BOUT + BO_H]);
          }
        });
    out_col = at::empty({colsum ? k : 0}, opts);
    if (colsum) {
      std::vector<double> total(static_cast<size_t>(k), 0.0);
      for (int64_t b = 0; b < n_blocks; ++b)
        for (int64_t j = 0; j < k; ++j) total[j] += partial[b * k + j];
      float* pc = out_col.data_ptr<float>();
      for (int64_t j = 0; j < k; ++j) pc[j] = static_cast<float>(total[j]);
    }
  } else
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_terms_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t n_blocks = over_blocks<scalar_t>(xp, nullptr, l, [](int64_t, int64_t, int64_t, const scalar_t*, scalar_t*) {}, false);
    std::vector<double> partial(colsum ? static_cast<size_t>(n_blocks * k) : 0, 0.0);
    scalar_t* pb = out_base.data_ptr<scalar_t>();
    scalar_t* pr = out_r.data_ptr<scalar_t>();
    scalar_t* pa = out_a.data_ptr<scalar_t>();
    scalar_t* ph = entropy != BE_NONE ? out_h.data_ptr<scalar_t>() : nullptr;
    scalar_t* dfp = df.defined() ? df.data_ptr<scalar_t>() : nullptr;
    scalar_t* exp_ = ex.defined() ? ex.data_ptr<scalar_t>() : nullptr;
    over_blocks<scalar_t>(xp, nullptr, l, [&](int64_t b, int64_t r0, int64_t w, const scalar_t* xr, scalar_t*) {
      std::vector<scalar_t> e(exp_ != nullptr ? 0 : static_cast<size_t>(k));
      double* col = colsum ? partial.data() + b * k : nullptr;
      int64_t bad = 0;
      for (int64_t i = 0; i < w; ++i) {
        const int64_t row = r0 + i;
        const int64_t y = margin_label(tp[row], k, has_ignore, ignore, bad);
        double out[N_BOUT];
        batch_forward_row<scalar_t>(xr + i * k, k, y, y < 0 ? 0 : y, s,
                                    exp_ != nullptr ? exp_ + row * k : e.data(), col, op + row * N_BSTAT, out,
                                    dfp != nullptr ? dfp + row * k : nullptr, exp_ != nullptr);
        pb[row] = static_cast<scalar_t>(out[BO_BASE]);
        pr[row] = static_cast<scalar_t>(out[BO_R]);
        pa[row] = static_cast<scalar_t>(out[BO_CORRECT]);
        if (ph != nullptr) ph[row] = static_cast<scalar_t>(out[BO_H]);
      }
      if (bad) n_bad += bad;
    });
    out_col = at::empty({colsum ? k : 0}, opts);
    if (colsum) {
      std::vector<double> total(static_cast<size_t>(k), 0.0);
      for (int64_t b = 0; b < n_blocks; ++b)
        for (int64_t j = 0; j < k; ++j) total[j] += partial[b * k + j];
      scalar_t* pc = out_col.data_ptr<scalar_t>();
      for (int64_t j = 0; j < k; ++j) pc[j] = static_cast<scalar_t>(total[j]);
    }
  });
  if (n_bad.load() > 0) raise_bad_label(tp, rows, k, has_ignore, ignore);
  return {out_base, out_r, out_a, out_h, out_col, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_terms_fwd(
    const at::Tensor& logits, const at::Tensor& targets, c10::optional<int64_t> ignore_index, int64_t base,
    double gamma, double alpha, int64_t entropy, bool colsum) {
  return batch_terms_forward(logits, targets, ignore_index, base, gamma, alpha, entropy, colsum, nullptr);
}

// an incoming (M) gradient as a contiguous float64 pointer, or null (no gradient)
const double* row_gradient(const c10::optional<at::Tensor>& g, int64_t rows, at::Tensor& keep, const char* name) {
  if (!g.has_value() || !g->defined()) return nullptr;
  keep = g->to(at::kDouble).contiguous();
  TORCH_CHECK_VALUE(keep.numel() == rows, "`", name, "` must have one entry per row");
  return keep.data_ptr<double>();
}

// The incoming gradients of the per-row outputs as float64 pointers (null: none): the base's, r's and the
// entropy's (M each) and the column sums' (K)
struct RowGrads {
  const double *gb = nullptr, *gr = nullptr, *gh = nullptr, *gc = nullptr;
  double base_scale = 1.0, scale = 1.0;  // (the base's gradients times base_scale, the others times scale)
};

// rows ahead whose scattered entries batch_terms_backward_rows asks the cache for
constexpr int64_t kPrefetchRows = 4;

// batch_terms_bwd on the gradients g, reading f' from df and the exps from ex (batch_terms_forward's, or
// undefined: the logs and exps are taken again)
at::Tensor batch_terms_backward_rows(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& saved,
                                     const RowGrads& in, c10::optional<int64_t> ignore_index, int64_t base,
                                     double gamma, double alpha, int64_t entropy, const at::Tensor& df,
                                     const at::Tensor& ex) {
  const Layout l = margin_layout(logits, targets);
  const BatchSpec s = batch_spec(base, gamma, alpha, entropy);
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = as_long(targets);
  const int64_t rows = l.n * l.sp, k = l.k;
  TORCH_CHECK_VALUE(saved.scalar_type() == at::kDouble && saved.is_contiguous() && saved.dim() == 2 &&
                        saved.size(0) == rows && saved.size(1) == N_BSTAT,
                    "`saved` must be the forward's (", rows, ", ", N_BSTAT, ") float64 statistics");
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  const int64_t* tp = t.data_ptr<int64_t>();
  const double *gb = in.gb, *gr = in.gr, *gh = in.gh, scale = in.scale, base_scale = in.base_scale;
  std::vector<double> scaled_c(in.gc != nullptr ? static_cast<size_t>(k) : 0);
  for (int64_t j = 0; j < static_cast<int64_t>(scaled_c.size()); ++j) scaled_c[j] = in.gc[j] * scale;
  const double* gc = in.gc != nullptr ? scaled_c.data() : nullptr;
  at::Tensor grad = at::empty(x.sizes(), x.options());
  const double* op = saved.data_ptr<double>();
  if (positions_as_lanes(x, l)) {
    constexpr int W = PosLanes<kWideBytes>::W;
    std::vector<float> ct(gc != nullptr ? static_cast<size_t>(k) : 0);
    for (size_t j = 0; j < ct.size(); ++j) ct[j] = static_cast<float>(gc[j]);
    over_lanes(
        x.data_ptr<float>(), grad.data_ptr<float>(), l,
        [&](int64_t, int64_t r0, int w, const float* xs, int64_t stride, float* g, const float* dfi) {
          int64_t y[W];
          double b[W] = {}, rr[W] = {}, hh[W] = {};
          for (int t = 0; t < w; ++t) {
            const int64_t row = r0 + t;
            const bool keep = !(has_ignore && tp[row] == ignore);
            y[t] = keep ? tp[row] : -1;
            b[t] = keep && gb != nullptr ? gb[row] * base_scale : 0.0;
            rr[t] = gr != nullptr ? gr[row] * scale : 0.0;
            hh[t] = gh != nullptr ? gh[row] * scale : 0.0;
          }
          for (int t = w; t < W; ++t) y[t] = -1;
          thread_local std::vector<float> e;
          if (static_cast<int64_t>(e.size()) < k * W) e.resize(static_cast<size_t>(k * W));
          batch_backward_lanes<kWideBytes>(xs, stride, k, y, w, s, op + r0 * N_BSTAT, b, rr, hh,
                                           gc != nullptr ? ct.data() : nullptr, e.data(), g, dfi);
        },
        df.defined() ? df.data_ptr<float>() : nullptr);
    return grad;
  }
  // ignored rows take the column sums' gradient times 0: nothing, unless it is not finite (every row
  // ignored: the torch path's kept @ p then passes 0·NaN = NaN on, and so does this)
  std::vector<double> c0(gc != nullptr ? static_cast<size_t>(k) : 0);
  bool c_nonfinite = false;
  for (size_t j = 0; j < c0.size(); ++j) {
    c0[j] = 0.0 * gc[j];
    c_nonfinite = c_nonfinite || c0[j] != 0.0;
  }
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "batch_terms_bwd", [&] {
    std::vector<scalar_t> ct(gc != nullptr ? static_cast<size_t>(k) : 0), ct0(ct.size());
    for (size_t j = 0; j < ct.size(); ++j) {
      ct[j] = static_cast<scalar_t>(gc[j]);
      ct0[j] = static_cast<scalar_t>(c0[j]);
    }
    const scalar_t* dfp = df.defined() ? df.data_ptr<scalar_t>() : nullptr;
    const scalar_t* exp_ = ex.defined() ? ex.data_ptr<scalar_t>() : nullptr;
    over_blocks<scalar_t>(x.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), l,
                          [&](int64_t, int64_t r0, int64_t w, const scalar_t* xr, scalar_t* gr_rows) {
                            for (int64_t i = 0; i < w; ++i) {
                              const int64_t row = r0 + i;
                              // with the forward's exps the row is not read but at its label and arg-max
                              // entries (batch_backward_row's float64 recompute): two scattered loads, each a
                              // cache miss on the row's critical path unless asked for rows ahead
                              if (exp_ != nullptr && i + kPrefetchRows < w) {
                                const int64_t ahead = row + kPrefetchRows;
                                const int64_t ya = tp[ahead];
                                if (ya >= 0 && ya < k) __builtin_prefetch(xr + (i + kPrefetchRows) * k + ya);
                                __builtin_prefetch(xr + (i + kPrefetchRows) * k +
                                                   static_cast<int64_t>(op[ahead * N_BSTAT + BS_ARG]));
                              }
                              const bool keep = !(has_ignore && tp[row] == ignore);
                              const double b = keep && gb != nullptr ? gb[row] * base_scale : 0.0;
                              const double rr = gr != nullptr ? gr[row] * scale : 0.0;
                              const double hh = gh != nullptr ? gh[row] * scale : 0.0;
                              const bool col = gc != nullptr && (keep || c_nonfinite);
                              scalar_t* g = gr_rows + i * k;
                              if (b == 0.0 && rr == 0.0 && hh == 0.0 && !col) {
                                std::fill(g, g + k, scalar_t(0));
                                continue;
                              }
                              const double* c = col ? (keep ? gc : c0.data()) : nullptr;
                              const scalar_t* cs = col ? (keep ? ct.data() : ct0.data()) : nullptr;
                              batch_backward_row<scalar_t>(xr + i * k, k, keep ? tp[row] : -1, s, op + row * N_BSTAT, b,
                                                           rr, hh, c, cs, g,
                                                           dfp != nullptr ? dfp + row * k : nullptr,
                                                           exp_ != nullptr ? exp_ + row * k : nullptr);
                            }
                          });
  });
  return grad;
}

at::Tensor batch_terms_bwd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& saved,
                           const c10::optional<at::Tensor>& g_base, const c10::optional<at::Tensor>& g_r,
                           const c10::optional<at::Tensor>& g_entropy, const c10::optional<at::Tensor>& g_colsum,
                           c10::optional<int64_t> ignore_index, int64_t base, double gamma, double alpha,
                           int64_t entropy) {
  const Layout l = check_backward_labels(logits, targets, ignore_index, "batch_terms_bwd");
  const int64_t rows = l.n * l.sp;
  at::Tensor kb, kr, kh, kc;
  RowGrads in;
  in.gb = row_gradient(g_base, rows, kb, "g_base");
  in.gr = row_gradient(g_r, rows, kr, "g_r");
  in.gh = row_gradient(g_entropy, rows, kh, "g_entropy");
  if (g_colsum.has_value() && g_colsum->defined()) {
    kc = g_colsum->to(at::kDouble).contiguous();
    TORCH_CHECK_VALUE(kc.numel() == logits.size(1), "`g_colsum` must have one entry per class");
    in.gc = kc.data_ptr<double>();
  }
  return batch_terms_backward_rows(logits, targets, saved, in, ignore_index, base, gamma, alpha, entropy,
                                   at::Tensor(), at::Tensor());
}

// -- SB-ECE's label-binned term on the (M) confidences (batch_terms.h) --------------------------------------
//
//   sbece_label_fwd(conf, correct, kept, bins, temperature) -> (value, saved (3·bins + 2) float64)
//   sbece_label_bwd(grad, conf, correct, kept, saved, bins, temperature) -> the confidences' gradient
//
// conf, correct, kept: (M) float32/float64 CPU vectors of one dtype (correct and kept 0/1). The sums are
// added per fixed block of rows and the blocks in order (no dependence on the thread count).

constexpr int64_t kBinRows = 2048;
constexpr int64_t kMaxBins = 64;  // the memberships of W rows live in a stack array
constexpr int kBinLanes = Vec<float, kWideBytes>::width;

void check_bin_inputs(const at::Tensor& conf, const at::Tensor& correct, const at::Tensor& kept, int64_t bins,
                      double temperature) {
  TORCH_CHECK_VALUE(conf.dim() == 1 && correct.sizes() == conf.sizes() && kept.sizes() == conf.sizes(),
                    "`conf`, `correct` and `kept` must be vectors of one length");
  TORCH_CHECK_VALUE(conf.device().is_cpu() && (conf.scalar_type() == at::kFloat || conf.scalar_type() == at::kDouble) &&
                        correct.scalar_type() == conf.scalar_type() && kept.scalar_type() == conf.scalar_type(),
                    "sbece_label runs on CPU float32/float64 vectors of one dtype");
  TORCH_CHECK_VALUE(bins >= 1 && bins <= kMaxBins && temperature > 0,
                    "`bins` must lie in [1, 64] and `temperature` be > 0");
}

// fn(block, V tag, first row) over the rows in fixed blocks (in parallel), W rows at a time and the rest
// one by one, then done(block) on the same thread; returns the number of blocks
template <typename T, typename Fn, typename Done>
int64_t over_bin_rows(int64_t m, const Fn& fn, const Done& done) {
  const int64_t n_blocks = (m + kBinRows - 1) / kBinRows;
  at::parallel_for(0, n_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kBinRows, r1 = std::min(m, r0 + kBinRows);
      int64_t i = r0;
      if constexpr (std::is_same<T, float>::value) {
        constexpr int W = Vec<float, kWideBytes>::width;
        for (; i + W <= r1; i += W) fn(blk, std::integral_constant<int, kWideBytes>{}, i);
      }
      for (; i < r1; ++i) fn(blk, std::integral_constant<int, 0>{}, i);
      done(blk);
    }
  });
  return n_blocks;
}

template <typename T, typename Fn>
int64_t over_bin_rows(int64_t m, const Fn& fn) {
  return over_bin_rows<T>(m, fn, [](int64_t) {});
}

// The per-lane partial sums of a block of rows in the dtype (acc, `count` sums of kBinLanes lanes each,
// held per thread), added into the block's float64 partials (dst) and zeroed when the block is done: a
// vector add per sum and row in place of two float64 conversions and additions (the lanes are added across
// once per block: a horizontal sum per vector and bin had cost more than the memberships' exps). A lane sums at most
// kBinRows / kBinLanes rows (128 with 16 lanes) of memberships in [0, 1] (or their products with a or
// A_b − r): within 128·u relative of the sum of their magnitudes in float32, inside the torch path's
// bound (its float32 sums run over all M rows).
template <typename T>
struct LaneSums {
  std::vector<T>& acc;
  explicit LaneSums(std::vector<T>& storage, int64_t count) : acc(storage) {
    const size_t n = static_cast<size_t>(count * kBinLanes);
    if (acc.size() != n) acc.assign(n, T(0));
  }
  template <typename V>
  void add(int64_t c, V v) const {
    T* q = acc.data() + c * kBinLanes;
    if constexpr (std::is_floating_point<V>::value) {
      q[0] += v;
    } else {
      store(q, load<V>(q) + v);
    }
  }
  void flush(double* dst) const {
    for (size_t j = 0; j < acc.size(); ++j) {
      dst[j] += static_cast<double>(acc[j]);
      acc[j] = T(0);
    }
  }
};

// cache: where given, (M·bins) entries of the input dtype into which pass 1 writes the memberships (the W rows
// of a vector at row·bins, as soft_bins lays them out), which pass 2 and sbece_label_backward then read
// instead of taking their exps again (the whole-loss node's; the separate operators recompute them)
std::tuple<at::Tensor, at::Tensor> sbece_label_forward(const at::Tensor& conf_in, const at::Tensor& correct_in,
                                                       const at::Tensor& kept_in, int64_t bins, double temperature,
                                                       at::Tensor* cache = nullptr) {
  check_bin_inputs(conf_in, correct_in, kept_in, bins, temperature);
  const at::Tensor conf = conf_in.contiguous(), correct = correct_in.contiguous(), kept = kept_in.contiguous();
  const int64_t m = conf.numel(), n_blocks = (m + kBinRows - 1) / kBinRows;
  at::Tensor saved = at::zeros({3 * bins + 2}, conf.options().dtype(at::kDouble));
  if (cache != nullptr) *cache = at::empty({m * bins}, conf.options());
  double* sv = saved.data_ptr<double>();
  double* mass = sv;
  double* acc = sv + bins;
  double* q = sv + 2 * bins;
  double value = 0.0;
  AT_DISPATCH_FLOATING_TYPES(conf.scalar_type(), "sbece_label_fwd", [&] {
    const scalar_t* r = conf.data_ptr<scalar_t>();
    const scalar_t* a = correct.data_ptr<scalar_t>();
    const scalar_t* k = kept.data_ptr<scalar_t>();
    const scalar_t inv_t = static_cast<scalar_t>(1.0 / temperature);
    scalar_t* gc = cache != nullptr ? cache->data_ptr<scalar_t>() : nullptr;
    // per block: (2·bins + 1) sums of kBinLanes per-lane partials each
    constexpr int64_t L = kBinLanes;
    const int64_t stride = (2 * bins + 1) * L;
    std::vector<double> part(static_cast<size_t>(n_blocks * stride), 0.0);
    const auto block_sum = [&](int64_t blk, int64_t c) {
      double t = 0.0;
      for (int64_t l = 0; l < L; ++l) t += part[blk * stride + c * L + l];
      return t;
    };
    // pass 1: S_b, Σ_i g_ib a_i and the kept count (each thread's block sums in the dtype: LaneSums)
    thread_local std::vector<scalar_t> lane_storage;
    over_bin_rows<scalar_t>(
        m,
        [&](int64_t, auto tag, int64_t i) {
          using V = typename Lanes<scalar_t, decltype(tag)::value>::type;
          const LaneSums<scalar_t> sums(lane_storage, 2 * bins + 1);
          scalar_t own[kMaxBins * kBinLanes];
          scalar_t* g = gc != nullptr ? gc + i * bins : own;
          V mean;
          const V kv = lanes_load<V>(k + i);
          soft_bins<scalar_t, V>(lanes_load<V>(r + i), kv, bins, inv_t, g, nullptr, mean);
          constexpr int W = sizeof(V) / sizeof(scalar_t);
          const V av = lanes_load<V>(a + i);
          for (int64_t b = 0; b < bins; ++b) {
            const V gb = lanes_load<V>(g + b * W);
            sums.add(b, gb);
            sums.add(bins + b, gb * av);
          }
          sums.add(2 * bins, kv);
        },
        [&](int64_t blk) { LaneSums<scalar_t>(lane_storage, 2 * bins + 1).flush(part.data() + blk * stride); });
    double count = 0.0;
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      for (int64_t b = 0; b < bins; ++b) {
        mass[b] += block_sum(blk, b);
        acc[b] += block_sum(blk, bins + b);
      }
      count += block_sum(blk, 2 * bins);
    }
    std::vector<scalar_t> acc_t(static_cast<size_t>(bins));
    for (int64_t b = 0; b < bins; ++b) {
      acc[b] /= mass[b] > 0 ? mass[b] : 1.0;  // A_b
      acc_t[b] = static_cast<scalar_t>(acc[b]);
    }
    // pass 2: total and Q_b
    std::fill(part.begin(), part.end(), 0.0);
    over_bin_rows<scalar_t>(
        m,
        [&](int64_t, auto tag, int64_t i) {
          using V = typename Lanes<scalar_t, decltype(tag)::value>::type;
          constexpr int W = sizeof(V) / sizeof(scalar_t);
          const LaneSums<scalar_t> sums(lane_storage, 2 * bins + 1);
          scalar_t own[kMaxBins * kBinLanes];
          const scalar_t* g = own;
          V mean;
          const V rv = lanes_load<V>(r + i);
          if (gc != nullptr)
            g = gc + i * bins;
          else
            soft_bins<scalar_t, V>(rv, lanes_load<V>(k + i), bins, inv_t, own, nullptr, mean);
          V tot = {};
          for (int64_t b = 0; b < bins; ++b) {
            const V gb = lanes_load<V>(g + b * W);
            const V d = acc_t[b] - rv;
            tot += gb * d * d;
            sums.add(b, gb * d);
          }
          sums.add(2 * bins, tot);
        },
        [&](int64_t blk) { LaneSums<scalar_t>(lane_storage, 2 * bins + 1).flush(part.data() + blk * stride); });
    double total = 0.0;
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      for (int64_t b = 0; b < bins; ++b) q[b] += 2.0 * block_sum(blk, b);
      total += block_sum(blk, 2 * bins);
    }
    sv[3 * bins] = total;
    sv[3 * bins + 1] = count;
    const double u = std::max(total / count, 0.0);
    value = u > 0 ? std::sqrt(u) : total / count;  // (NaN with no kept row, as the torch path)
  });
  return {at::scalar_tensor(value, conf.options()), saved};
}

std::tuple<at::Tensor, at::Tensor> sbece_label_fwd(const at::Tensor& conf, const at::Tensor& correct,
                                                   const at::Tensor& kept, int64_t bins, double temperature) {
  return sbece_label_forward(conf, correct, kept, bins, temperature);
}

// cache: sbece_label_forward's memberships, or undefined (then they are recomputed)
at::Tensor sbece_label_backward(double grad, const at::Tensor& conf_in, const at::Tensor& correct_in,
                                const at::Tensor& kept_in, const at::Tensor& saved, int64_t bins, double temperature,
                                const at::Tensor& cache = at::Tensor()) {
  check_bin_inputs(conf_in, correct_in, kept_in, bins, temperature);
  TORCH_CHECK_VALUE(saved.scalar_type() == at::kDouble && saved.numel() == 3 * bins + 2,
                    "`saved` must be the forward's statistics");
  const at::Tensor conf = conf_in.contiguous(), correct = correct_in.contiguous(), kept = kept_in.contiguous();
  const at::Tensor sv_t = saved.contiguous();
  const double* sv = sv_t.data_ptr<double>();
  const int64_t m = conf.numel();
  const double total = sv[3 * bins], count = sv[3 * bins + 1], u = total / count;
  // (_safe_sqrt: 0 at 0; no kept row (count 0, u NaN): 0, where dividing by the count would be 0/0 = NaN)
  const double f = u > 0 ? grad * 0.5 / std::sqrt(u) / count : 0.0;
  at::Tensor out = at::empty_like(conf);
  AT_DISPATCH_FLOATING_TYPES(conf.scalar_type(), "sbece_label_bwd", [&] {
    const scalar_t* r = conf.data_ptr<scalar_t>();
    const scalar_t* a = correct.data_ptr<scalar_t>();
    const scalar_t* k = kept.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t inv_t = static_cast<scalar_t>(1.0 / temperature);
    std::vector<scalar_t> acc(static_cast<size_t>(bins)), qs(static_cast<size_t>(bins));
    for (int64_t b = 0; b < bins; ++b) {
      const double mass = sv[b] > 0 ? sv[b] : 1.0;
      acc[b] = static_cast<scalar_t>(sv[bins + b]);
      qs[b] = static_cast<scalar_t>(sv[2 * bins + b] / mass);
    }
    const scalar_t ft = static_cast<scalar_t>(f);
    const scalar_t* gc = cache.defined() ? cache.data_ptr<scalar_t>() : nullptr;
    over_bin_rows<scalar_t>(m, [&](int64_t, auto tag, int64_t i) {
      using V = typename Lanes<scalar_t, decltype(tag)::value>::type;
      constexpr int W = sizeof(V) / sizeof(scalar_t);
      scalar_t own[kMaxBins * kBinLanes], ds[kMaxBins * kBinLanes];
      const scalar_t* g = own;
      V mean;
      const V rv = lanes_load<V>(r + i), av = lanes_load<V>(a + i);
      if (gc != nullptr) {
        g = gc + i * bins;
        bin_slopes<scalar_t, V>(rv, bins, inv_t, g, ds, mean);
      } else {
        soft_bins<scalar_t, V>(rv, lanes_load<V>(k + i), bins, inv_t, own, ds, mean);
      }
      V d_total = {};
      for (int64_t b = 0; b < bins; ++b) {
        const V gb = lanes_load<V>(g + b * W);
        const V d = acc[b] - rv;
        const V big_g = gb * (lanes_load<V>(ds + b * W) - mean);
        d_total += big_g * (d * d + qs[b] * (av - acc[b])) - 2 * gb * d;
      }
      lanes_store(o + i, d_total * ft);
    });
  });
  return out;
}

at::Tensor sbece_label_bwd(const at::Tensor& grad, const at::Tensor& conf, const at::Tensor& correct,
                           const at::Tensor& kept, const at::Tensor& saved, int64_t bins, double temperature) {
  return sbece_label_backward(grad.item<double>(), conf, correct, kept, saved, bins, temperature);
}

// -- the batch-term losses whole: the per-row operator, the batch term and the reduction in one node --------
//
//   fused_batch_loss(logits, targets, ignore_index, base, gamma, alpha, term, params, reduction, split)
//       -> (loss, stats (5) float64)
//
// The loss of margin.py's mdca_loss, dca_loss, sbece_loss (label form), avuc_loss, soft_avuc_loss and
// esd_loss as one autograd node (decision 217): batch_terms_fwd's per-row numbers, the term (batch_terms.h,
// float64; SB-ECE by sbece_label_fwd / _bwd) with its derivatives with respect to them, and the reduction;
// the backward scales those derivatives by the incoming gradient and runs batch_terms_bwd once. term: a
// BatchTerm; params: coef, then SB-ECE's bins and temperature, AvUC's threshold, S-AvUC's temperature and
// κ. split: the first row of ESD's held-out part (M: none); the base loss covers the kept rows before it,
// the term those from it on (all kept rows without a held-out part). reduction as fused_margin ("mean": the
// base's mean over its rows + coef·term; "sum": the sum of "none", each covered row's base + coef·term).
// stats: AvUC's Σ H and count of the accurate kept rows, then of the inaccurate ones; the fifth number is 1
// when the base or the term has no row, whose limits (0/0) the caller leaves to the torch path.

// grads: the loss's derivatives with respect to the per-row outputs, one float64 tensor: the base's (M), then
// those of the outputs the term reads (term_reads, laid out by grad_parts): r's (M), the entropy's (M), the
// column sums' (K)
struct BatchLossForward {
  at::Tensor loss, stats, saved, grads, df, ex;
  double term_scale = 1.0;  // what the term's parts of `grads` are to be multiplied by (coef, or coef·n_base)
};

int64_t term_entropy(int64_t term) { return term == BT_AVUC ? BE_AVUC : (term == BT_SAVUC ? BE_SMOOTH : BE_NONE); }

struct TermReads {
  bool r, h, col;
};

TermReads term_reads(int64_t term) {
  return {term == BT_DCA || term == BT_SBECE || term == BT_AVUC || term == BT_ESD, term_entropy(term) != BE_NONE,
          term == BT_MDCA};
}

// where each part of `grads` starts: the base's at 0, then those the term has (r, H, columns; −1: none)
struct GradParts {
  int64_t r = -1, h = -1, col = -1, size = 0;
};

GradParts grad_parts(int64_t term, int64_t m, int64_t k) {
  const TermReads reads = term_reads(term);
  GradParts p;
  p.size = m;
  if (reads.r) p.r = std::exchange(p.size, p.size + m);
  if (reads.h) p.h = std::exchange(p.size, p.size + m);
  if (reads.col) p.col = std::exchange(p.size, p.size + k);
  return p;
}

BatchLossForward batch_loss_forward(const at::Tensor& logits, const at::Tensor& targets,
                                    c10::optional<int64_t> ignore_index, int64_t base, double gamma, double alpha,
                                    int64_t term, at::ArrayRef<double> params, int64_t reduction, int64_t split,
                                    bool keep_df = false) {
  TORCH_CHECK_VALUE(term >= BT_MDCA && term <= BT_ESD, "`term` must be 0 (MDCA), 1 (DCA), 2 (SB-ECE), 3 (AvUC), ",
                    "4 (S-AvUC) or 5 (ESD)");
  const size_t need[] = {1, 1, 3, 2, 3, 1};
  TORCH_CHECK_VALUE(params.size() == need[term], "`params` must hold ", need[term], " numbers for term ", term);
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "`reduction` must be 0 (none), 1 (mean) or 2 (sum)");
  const int64_t entropy = term_entropy(term);
  at::Tensor b, r, a, h, col, saved, df, ex;
  std::tie(b, r, a, h, col, saved) = batch_terms_forward(logits, targets, ignore_index, base, gamma, alpha, entropy,
                                                         term == BT_MDCA, keep_df ? &df : nullptr,
                                                         keep_df ? &ex : nullptr);
  const int64_t m = b.numel(), k = logits.size(1);
  TORCH_CHECK_VALUE(split >= 1 && split <= m, "`split` must lie in [1, ", m, "]");
  const at::Tensor t = as_long(targets);
  const int64_t* tp = t.data_ptr<int64_t>();
  const bool has_ignore = ignore_index.has_value();
  const int64_t ignore = ignore_index.value_or(0);
  std::vector<uint8_t> in_base(static_cast<size_t>(m)), in_term(static_cast<size_t>(m));
  // (blocks of rows fixed by M, in parallel; the counts as integers and the flags through local pointers: a
  // byte store may alias anything, so a count or a vector's data pointer that lives in memory was stored and
  // reloaded on every row)
  constexpr int64_t kFlagRows = int64_t{1} << 14;
  const int64_t flag_blocks = (m + kFlagRows - 1) / kFlagRows;
  std::vector<int64_t> block_counts(static_cast<size_t>(2 * flag_blocks), 0);
  at::parallel_for(0, flag_blocks, 1, [&](int64_t begin, int64_t end) {
    uint8_t* ib = in_base.data();
    uint8_t* it = in_term.data();
    const int64_t ign = ignore, cut = split, held = split == m ? 0 : split;
    const bool any_ignored = has_ignore;
    for (int64_t blk = begin; blk < end; ++blk) {
      int64_t nb_blk = 0, nt_blk = 0;
      for (int64_t i = blk * kFlagRows, stop = std::min(m, (blk + 1) * kFlagRows); i < stop; ++i) {
        const uint8_t keep = !(any_ignored & (tp[i] == ign));
        const uint8_t b = keep & (i < cut), t = keep & (i >= held);
        ib[i] = b;
        it[i] = t;
        nb_blk += b;
        nt_blk += t;
      }
      block_counts[2 * blk] = nb_blk;
      block_counts[2 * blk + 1] = nt_blk;
    }
  });
  int64_t count_base = 0, count_term = 0;
  for (int64_t blk = 0; blk < flag_blocks; ++blk) {
    count_base += block_counts[2 * blk];
    count_term += block_counts[2 * blk + 1];
  }
  const double nb = static_cast<double>(count_base), nt = static_cast<double>(count_term);
  const auto dbl = logits.options().dtype(at::kDouble);
  BatchLossForward f;
  f.saved = saved;
  f.df = df;
  f.ex = ex;
  f.stats = at::zeros({5}, dbl);
  double* st = f.stats.data_ptr<double>();
  const GradParts parts = grad_parts(term, m, k);
  f.grads = at::empty({parts.size}, dbl);  // (every part written below: the terms fill theirs)
  double* gbp = f.grads.data_ptr<double>();
  double* grp = parts.r >= 0 ? gbp + parts.r : nullptr;
  double* ghp = parts.h >= 0 ? gbp + parts.h : nullptr;
  double* gcp = parts.col >= 0 ? gbp + parts.col : nullptr;
  if (nb == 0.0 || nt == 0.0) {  // (NaN and no gradient: the caller takes the torch path's limits)
    f.grads.zero_();
    st[4] = 1.0;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    f.loss = reduction == 0 ? at::full(targets.sizes(), nan, logits.options()) : at::full({}, nan, logits.options());
    return f;
  }
  const double coef = params[0];
  double pen = 0.0;
  if (term == BT_SBECE) {
    const at::Tensor kept = at::from_blob(in_term.data(), {m}, at::kByte).to(r.scalar_type());
    const auto bins = static_cast<int64_t>(params[1]);
    at::Tensor value, sv;
    at::Tensor memberships;  // (pass 1's, read by pass 2 and the backward: one exp per row and bin)
    std::tie(value, sv) = sbece_label_forward(r, a, kept, bins, params[2], &memberships);
    pen = value.item<double>();
    const at::Tensor dr = sbece_label_backward(1.0, r, a, kept, sv, bins, params[2], memberships);
    AT_DISPATCH_FLOATING_TYPES(dr.scalar_type(), "sbece_gr", [&] {
      const scalar_t* d = dr.data_ptr<scalar_t>();
      for (int64_t i = 0; i < m; ++i) grp[i] = static_cast<double>(d[i]);
    });
  } else {
    const auto parallel = [](int64_t count, const auto& fn) {
      at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) fn(c);
      });
    };
    AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "fused_batch_loss", [&] {
      const scalar_t* rp = r.data_ptr<scalar_t>();
      const scalar_t* ap = a.data_ptr<scalar_t>();
      const uint8_t* in = in_term.data();
      if (term == BT_MDCA) {
        std::vector<double> c(static_cast<size_t>(k)), lab(static_cast<size_t>(k), 0.0);
        const scalar_t* cp = col.data_ptr<scalar_t>();
        for (int64_t j = 0; j < k; ++j) c[j] = static_cast<double>(cp[j]);
        for (int64_t i = 0; i < m; ++i)
          if (in[i]) lab[tp[i]] += 1.0;
        pen = mdca_term(k, c.data(), lab.data(), nt, gcp);
      } else if (term == BT_DCA) {
        pen = dca_term<scalar_t>(m, rp, ap, in, grp);
      } else if (term == BT_AVUC) {
        pen = avuc_term<scalar_t>(m, rp, ap, h.data_ptr<scalar_t>(), in, static_cast<scalar_t>(params[1]), grp, ghp,
                                  st, parallel);
      } else if (term == BT_SAVUC) {
        pen = savuc_term<scalar_t>(m, ap, h.data_ptr<scalar_t>(), in, k, params[1], params[2], ghp, parallel);
      } else {  // ESD: λ·sqrt(max(ESD, 0)), the sqrt's derivative 0 where ESD <= 0 (_safe_sqrt; NaN stays NaN)
        const double esd = esd_term<scalar_t>(m, rp, ap, in, grp, parallel, [](double v) {
          return v <= 0 ? 0.0 : 0.5 / std::sqrt(v);  // (the derivatives' factor)
        });
        pen = esd <= 0 ? 0.0 : std::sqrt(esd);
      }
    });
  }
  // (the term's parts are scaled in the backward, with the incoming gradient: one pass fewer over them)
  f.term_scale = reduction == 2 ? coef * nb : coef;
  const double per_row = reduction == 1 ? 1.0 / nb : 1.0;
  // the base's derivatives, the per-row losses or each block's sum of the base (blocks of rows fixed by M,
  // in parallel; the blocks' sums added in order)
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "fused_batch_loss_reduce", [&] {
    const scalar_t* bp = b.data_ptr<scalar_t>();
    scalar_t* o = nullptr;
    if (reduction == 0) {
      f.loss = at::empty(targets.sizes(), logits.options());
      o = f.loss.data_ptr<scalar_t>();
    }
    std::vector<double> block_sums(static_cast<size_t>(flag_blocks), 0.0);
    at::parallel_for(0, flag_blocks, 1, [&](int64_t begin, int64_t end) {
      const uint8_t* ib = in_base.data();
      double* gb = gbp;
      const double row_scale = per_row, add = coef * pen;
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t i0 = blk * kFlagRows, i1 = std::min(m, (blk + 1) * kFlagRows);
        for (int64_t i = i0; i < i1; ++i) gb[i] = static_cast<double>(ib[i]) * row_scale;
        if (o != nullptr) {
          for (int64_t i = i0; i < i1; ++i)
            o[i] = static_cast<scalar_t>(ib[i] ? static_cast<double>(bp[i]) + add : 0.0);
          continue;
        }
        // (8 interleaved partial sums, added in order: no chain of dependent additions)
        double part[8] = {};
        int64_t i = i0;
        for (; i + 8 <= i1; i += 8)
          for (int q = 0; q < 8; ++q) part[q] += ib[i + q] ? static_cast<double>(bp[i + q]) : 0.0;
        for (; i < i1; ++i) part[0] += ib[i] ? static_cast<double>(bp[i]) : 0.0;
        double sum = 0.0;
        for (double v : part) sum += v;
        block_sums[blk] = sum;
      }
    });
    if (reduction != 0) {
      double total = 0.0;
      for (double v : block_sums) total += v;
      const double value = reduction == 1 ? total / nb + coef * pen : total + nb * coef * pen;
      f.loss = at::scalar_tensor(value, logits.options());
    }
  });
  return f;
}

at::Tensor batch_loss_backward(const at::Tensor& grad, const variable_list& saved, c10::optional<int64_t> ignore_index,
                               int64_t base, double gamma, double alpha, int64_t term, int64_t reduction,
                               double term_scale) {
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "the fused CPU batch-term loss is differentiable once only; for higher-order gradients run it with "
              "torchcal.functional.use_cpu_extension(False)");
  const at::Tensor &logits = saved[0], &targets = saved[1], &stats = saved[2], &grads = saved[3];
  const int64_t m = stats.size(0);
  const double* g = grads.data_ptr<double>();
  const GradParts parts = grad_parts(term, m, logits.size(1));
  RowGrads in;
  in.gr = parts.r >= 0 ? g + parts.r : nullptr;
  in.gh = parts.h >= 0 ? g + parts.h : nullptr;
  in.gc = parts.col >= 0 ? g + parts.col : nullptr;
  std::vector<double> b;
  if (reduction == 0) {  // every covered row carries coef·term: its gradient is the sum of theirs
    const at::Tensor gd = grad.to(at::kDouble).contiguous();
    const double* gp = gd.data_ptr<double>();
    b.resize(static_cast<size_t>(m));
    double total = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      b[i] = gp[i] * g[i];
      total += b[i];
    }
    in.scale = total * term_scale;
  } else {
    in.base_scale = grad.item<double>();
    in.scale = in.base_scale * term_scale;
  }
  in.gb = reduction == 0 ? b.data() : g;
  return batch_terms_backward_rows(logits, targets, stats, in, ignore_index, base, gamma, alpha, term_entropy(term),
                                   saved[4], saved[5]);
}

class FusedBatchLoss : public torch::autograd::Function<FusedBatchLoss> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               c10::optional<int64_t> ignore_index, int64_t base, double gamma, double alpha,
                               int64_t term, at::ArrayRef<double> params, int64_t reduction, int64_t split,
                               bool keep_df) {
    at::AutoDispatchBelowADInplaceOrView guard;
    // (keep_df: a backward will run, for which f' of the entropy and the rows' exps are kept, each one tensor
    // of the logits' size, so that the logs and exps are not taken twice)
    BatchLossForward f =
        batch_loss_forward(logits, targets, ignore_index, base, gamma, alpha, term, params, reduction, split, keep_df);
    ctx->save_for_backward({logits, targets, f.saved, f.grads, f.df, f.ex});
    ctx->mark_non_differentiable({f.stats});
    ctx->saved_data["has_ignore"] = ignore_index.has_value();
    ctx->saved_data["ignore"] = ignore_index.value_or(0);
    ctx->saved_data["base"] = base;
    ctx->saved_data["gamma"] = gamma;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["term"] = term;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["term_scale"] = f.term_scale;
    return {f.loss, f.stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::optional<int64_t> ignore;
    if (ctx->saved_data["has_ignore"].toBool()) ignore = ctx->saved_data["ignore"].toInt();
    at::Tensor grad = batch_loss_backward(grads[0], ctx->get_saved_variables(), ignore, ctx->saved_data["base"].toInt(),
                                          ctx->saved_data["gamma"].toDouble(), ctx->saved_data["alpha"].toDouble(),
                                          ctx->saved_data["term"].toInt(), ctx->saved_data["reduction"].toInt(),
                                          ctx->saved_data["term_scale"].toDouble());
    variable_list out(11);
    out[0] = grad;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> fused_batch_loss_cpu(const at::Tensor& logits, const at::Tensor& targets,
                                                        c10::optional<int64_t> ignore_index, int64_t base, double gamma,
                                                        double alpha, int64_t term, at::ArrayRef<double> params,
                                                        int64_t reduction, int64_t split) {
  BatchLossForward f =
      batch_loss_forward(logits, targets, ignore_index, base, gamma, alpha, term, params, reduction, split);
  return {f.loss, f.stats};
}

std::tuple<at::Tensor, at::Tensor> fused_batch_loss_autograd(const at::Tensor& logits, const at::Tensor& targets,
                                                             c10::optional<int64_t> ignore_index, int64_t base,
                                                             double gamma, double alpha, int64_t term,
                                                             at::ArrayRef<double> params, int64_t reduction,
                                                             int64_t split) {
  const bool keep_df = at::GradMode::is_enabled() && logits.requires_grad();
  auto out =
      FusedBatchLoss::apply(logits, targets, ignore_index, base, gamma, alpha, term, params, reduction, split, keep_df);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY(torchcal, m) {
  m.def(
      "fused_true_class(Tensor logits, Tensor targets, Tensor params, Tensor? sample_gammas, int reduction) -> "
      "Tensor");
  m.def(
      "top_label_scan(Tensor probs, Tensor targets, int n_bins, int classwise_bins, float? threshold=None, "
      "bool row_bins=False, bool bin_vectors=False) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("sort_with_flags(Tensor values, Tensor flags) -> (Tensor, Tensor)");
  m.def("logits_top_label(Tensor logits, Tensor targets, int n_bins) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fused_true_class_fwd(Tensor logits, Tensor targets, Tensor params, Tensor? sample_gammas, int reduction, "
      "float brier) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_true_class_bwd(Tensor grad_loss, Tensor probs, Tensor targets, Tensor out, float brier, "
      "int reduction) -> Tensor");
  m.def(
      "fused_margin(Tensor logits, Tensor targets, int kind, float[] params, int? ignore_index, "
      "bool penalty_all_rows, int reduction) -> Tensor");
  m.def(
      "fused_margin_fwd(Tensor logits, Tensor targets, int kind, float[] params, int? ignore_index, "
      "bool penalty_all_rows, int reduction) -> (Tensor, Tensor)");
  m.def(
      "fused_margin_bwd(Tensor grad_loss, Tensor logits, Tensor targets, Tensor stats, int kind, float[] params, "
      "int? ignore_index, bool penalty_all_rows, int reduction) -> Tensor");
  m.def("fused_ace(Tensor logits, Tensor targets, Tensor edges, float[] params, int[] options, int? ignore_index) -> Tensor");
  m.def(
      "fused_ace_fwd(Tensor logits, Tensor targets, Tensor edges, float[] params, int[] options, int? ignore_index) "
      "-> (Tensor, Tensor)");
  m.def(
      "fused_ace_bwd(Tensor grad_loss, Tensor logits, Tensor targets, Tensor edges, Tensor stats, float[] params, "
      "int[] options, int? ignore_index) -> Tensor");
  m.def(
      "fused_margin_class(Tensor logits, Tensor targets, int kind, float[] params, Tensor? class_params, "
      "int? ignore_index, bool penalty_all_rows, int reduction, bool sums) -> (Tensor, Tensor)");
  m.def(
      "fused_margin_class_fwd(Tensor logits, Tensor targets, int kind, float[] params, Tensor? class_params, "
      "int? ignore_index, bool penalty_all_rows, int reduction, bool sums) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_margin_class_bwd(Tensor grad_loss, Tensor logits, Tensor targets, Tensor stats, int kind, "
      "float[] params, Tensor? class_params, int? ignore_index, bool penalty_all_rows, int reduction) -> Tensor");
  // the batch-term operators (batch_terms.h): autograd formula and fake implementations registered from
  // Python (torchcal/functional/_extension.py)
  m.def(
      "batch_terms_fwd(Tensor logits, Tensor targets, int? ignore_index, int base, float gamma, float alpha, "
      "int entropy, bool colsum) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "batch_terms_bwd(Tensor logits, Tensor targets, Tensor saved, Tensor? g_base, Tensor? g_r, Tensor? g_entropy, "
      "Tensor? g_colsum, int? ignore_index, int base, float gamma, float alpha, int entropy) -> Tensor");
  m.def("sbece_label_fwd(Tensor conf, Tensor correct, Tensor kept, int bins, float temperature) -> (Tensor, Tensor)");
  m.def(
      "sbece_label_bwd(Tensor grad, Tensor conf, Tensor correct, Tensor kept, Tensor saved, int bins, "
      "float temperature) -> Tensor");
  m.def(
      "fused_batch_loss(Tensor logits, Tensor targets, int? ignore_index, int base, float gamma, float alpha, "
      "int term, float[] params, int reduction, int split) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchcal, CPU, m) {
  m.impl("fused_true_class", fused_true_class_cpu);
  m.impl("top_label_scan", top_label_scan_cpu);
  m.impl("sort_with_flags", sort_with_flags_cpu);
  m.impl("logits_top_label", logits_top_label_cpu);
  m.impl("fused_true_class_fwd", fused_true_class_fwd_cpu);
  m.impl("fused_true_class_bwd", fused_true_class_bwd_cpu);
  m.impl("fused_margin", fused_margin_cpu);
  m.impl("fused_margin_fwd", fused_margin_fwd_cpu);
  m.impl("fused_margin_bwd", fused_margin_bwd_cpu);
  m.impl("fused_margin_class", fused_margin_class_cpu);
  m.impl("fused_margin_class_fwd", fused_margin_class_fwd_cpu);
  m.impl("fused_margin_class_bwd", fused_margin_class_bwd_cpu);
  m.impl("fused_ace", fused_ace_cpu);
  m.impl("fused_ace_fwd", fused_ace_fwd_cpu);
  m.impl("fused_ace_bwd", fused_ace_bwd_cpu);
  m.impl("batch_terms_fwd", batch_terms_fwd);
  m.impl("batch_terms_bwd", batch_terms_bwd);
  m.impl("sbece_label_fwd", sbece_label_fwd);
  m.impl("sbece_label_bwd", sbece_label_bwd);
  m.impl("fused_batch_loss", fused_batch_loss_cpu);
}

TORCH_LIBRARY_IMPL(torchcal, AutogradCPU, m) {
  m.impl("fused_true_class", fused_true_class_autograd);
  m.impl("fused_margin", fused_margin_autograd);
  m.impl("fused_ace", fused_ace_autograd);
  m.impl("fused_margin_class", fused_margin_class_autograd);
  m.impl("fused_batch_loss", fused_batch_loss_autograd);
}
