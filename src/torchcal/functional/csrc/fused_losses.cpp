// torchcal's fused CPU focal-family loss as a PyTorch operator with a C++ autograd node.
//
// Built on request by torchcal.functional._extension (torch.utils.cpp_extension, ~20-30 s once, cached).
// It computes the losses of the numba kernels true_class_forward / true_class_backward of _numba_kernels.py
// (same conventions and per-sample float64 arithmetic; log p from its own fused log-softmax for float32 rows,
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

#include "true_class.h"

#include <atomic>

namespace {

using namespace torchcal;

// float32 rows take the fused two-pass pipeline with its own vectorised exp: up to 64 classes always, any
// length when the library is built for 32- or 64-byte vectors (AVX, AVX-512). On 16-byte vectors only (SSE2,
// NEON) longer rows are faster with torch's log_softmax and exp.
constexpr int64_t kFusedMaxClasses = kWideBytes >= 32 ? std::numeric_limits<int64_t>::max() : 64;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Forward {
  at::Tensor loss;   // the reduced (or per-sample) loss, in the dtype of the logits
  at::Tensor probs;  // exp(x − row max), unnormalised for float32 (undefined when the backward does not run)
  at::Tensor out;    // (N, N_OUT) float64 per-sample loss, coefficients and 1 / Σ exp(x − max)
};

// params (float64 vector): the 7 flags (upper_on_tie, dual, margin, nll, cal, cal_lambda, brier), the number
// of thresholds T, the T thresholds, then the γ schedule (T + 1 values; none with per-sample γ)
Forward fused_forward(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& params,
                      const c10::optional<at::Tensor>& sample_gammas, int64_t reduction, bool keep_probs) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "`logits` must have shape (N, K), got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.device().is_cpu() && targets.device().is_cpu(), "fused_true_class runs on CPU");
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble,
                    "`logits` must be float32 or float64, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == logits.size(0),
                    "`targets` must have shape (", logits.size(0), ",), got ", targets.sizes());
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
  if (n_bad.load() > 0) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (tp[i] < 0 || tp[i] >= k) {
        bad = tp[i];
        break;
      }
    }
    TORCH_CHECK_VALUE(false, "`targets` must lie in [0, ", k, "), found label ", bad);
  }
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
                "run it with torchcal.functional.use_cpu_kernels(False)");
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

}  // namespace

TORCH_LIBRARY(torchcal, m) {
  m.def(
      "fused_true_class(Tensor logits, Tensor targets, Tensor params, Tensor? sample_gammas, int reduction) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(torchcal, CPU, m) { m.impl("fused_true_class", fused_true_class_cpu); }

TORCH_LIBRARY_IMPL(torchcal, AutogradCPU, m) { m.impl("fused_true_class", fused_true_class_autograd); }
