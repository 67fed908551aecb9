"""Leaf helpers of the backend seam: the description of a fused p_t-only loss (:class:`LossSpec`) that the
C++ operator executes, the reductions shared by every loss, and the environment / context-manager switches.
Imports nothing of torchcal."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

__all__ = ["LossSpec", "REDUCTIONS", "env_enabled", "ordered_softmax", "ordered_sum", "reduce_loss", "switched"]


def env_enabled(name: str) -> bool:
    """False when the environment variable ``name`` is 0, false, no or off (any case); True otherwise."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def switched(state: dict, enabled: bool):
    """Sets ``state["enabled"]`` for the duration of a ``with`` block (the body of
    :func:`~torchcal.functional.use_cpu_extension`)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool, got {type(enabled).__name__}")
    previous = state["enabled"]
    state["enabled"] = enabled
    try:
        yield
    finally:
        state["enabled"] = previous


class LossSpec:
    """What a fused p_t-only loss computes (``csrc/losses.h`` of the C++ operator; the torch path of :mod:`._true_class` computes the same from the per-loss weight functions).

    γ_i is ``gammas[j]`` with j the number of ``thresholds`` below the selection value (at or below with
    ``upper_on_tie``), or one γ per sample (``sample_gammas``, a tensor); negative γ means the inverse focal
    form with |γ| (the AdaFocal convention). The selection value is p_t, or p_t − p_j with ``margin``; with
    ``cal_lambda`` γ = exp(λ(p_t − gammas[j])) (CalFocal eq. 2). ``dual``: the dual focal base; ``nll=False``:
    no likelihood term; ``brier``: λ of an added Σ_k (p_k − onehot_k)² term.
    """

    __slots__ = ("sample_gammas", "brier", "cpp_params32", "cpp_params64")

    def __init__(
        self,
        gammas,
        thresholds=(),
        upper_on_tie=True,
        sample_gammas=None,
        *,
        dual=False,
        margin=False,
        nll=True,
        cal_lambda=None,
        brier=0.0,
    ):
        gammas = np.asarray(gammas, dtype=np.float64).reshape(-1)
        # the torch path compares with thresholds in the input dtype: float32-rounded copies for float32
        thresholds64 = np.asarray(thresholds, dtype=np.float64).reshape(-1)
        thresholds32 = thresholds64.astype(np.float32).astype(np.float64)
        self.sample_gammas = sample_gammas
        self.brier = float(brier)
        # P_UPPER, P_DUAL, P_MARGIN, P_NLL, P_CAL, P_CAL_LAMBDA, P_BRIER (P_ROUND32, P_TINY are per call), packed
        # with the number of thresholds, the thresholds and the γs into one float64 vector per input dtype for
        # the C++ operator (``_extension``)
        cal = cal_lambda is not None
        flags = (upper_on_tie, dual, margin, nll, cal, cal_lambda if cal else 0.0, float(brier))
        head = np.array([*flags, len(thresholds64)], dtype=np.float64)
        self.cpp_params32 = torch.from_numpy(np.concatenate([head, thresholds32, gammas]))
        self.cpp_params64 = torch.from_numpy(np.concatenate([head, thresholds64, gammas]))


REDUCTIONS = ("none", "mean", "sum")

_ONE_THREAD = 32_768  # torch's CPU reductions of fewer entries run on one thread (at::internal::GRAIN_SIZE)
_BLOCK = 4096


def ordered_sum(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ of every entry of ``x`` (``dim=None``) or over its first dimension (``dim=0``), added in an order
    fixed by the shape alone.

    torch's CPU sum of more than 32,768 entries splits the reduction between its threads (and a matrix
    product splits its inner dimension), so the last bits depend on the thread count. Here blocks of 4096
    rows are summed each on one thread (torch splits a reduction along a dimension by the other dimensions),
    then the blocks' sums the same way: the same bits on any number of threads. float16 and bfloat16 add in
    float32, as torch's sum, and return their dtype. Integer and bool tensors (exact sums) and other devices
    than the CPU take ``x.sum(dim)``. Differentiable.
    """
    if dim is None:
        x, dim = x.reshape(-1), 0
    if dim != 0:
        raise ValueError(f"`dim` must be None or 0, got {dim}")
    n = x.shape[0]
    if x.numel() <= _ONE_THREAD or x.device.type != "cpu" or not x.is_floating_point():
        return x.sum(0)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    full = n - n % _BLOCK
    parts = x[:full].unflatten(0, (-1, _BLOCK)).sum(1, dtype=acc)
    if full < n:
        parts = torch.cat([parts, x[full:].sum(0, dtype=acc)[None]])
    return ordered_sum(parts, 0).to(x.dtype)


class _RowSoftmax(torch.autograd.Function):
    """softmax over dimension 1 whose backward is p ⊙ (g − Σ_j g_j p_j) in elementwise operations and a sum
    along the row: torch's own CPU softmax backward can differ in the last bit with the thread count (seen on
    an AVX2 CPU for rows of 10 to 15 classes). Twice differentiable (the backward is made of torch operations
    on the saved output), with the same formula as its forward-mode rule and a generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(z):
        return torch.softmax(z, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]
        (p,) = ctx.saved_tensors
        return p * (grad - (grad * p).sum(1, keepdim=True))

    @staticmethod
    def jvp(ctx, tangent):  # pyright: ignore[reportIncompatibleMethodOverride]
        (p,) = ctx.saved_tensors
        return p * (tangent - (tangent * p).sum(1, keepdim=True))


def ordered_softmax(z: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(z, 1)``, the same values, with a gradient that does not depend on the number of threads
    for rows of fewer than 32,768 entries (torch's one-thread limit, under which each row's sum is one
    thread's): float32 and float64 on the CPU outside ``torch.compile``; elsewhere torch's softmax.

    Example:
        >>> z = torch.tensor([[0.0, 1.0, 2.0], [3.0, 3.0, 3.0]], requires_grad=True)
        >>> p = ordered_softmax(z)
        >>> torch.equal(p, torch.softmax(z, 1))
        True
        >>> p[:, 0].sum().backward()
        >>> z.grad
        tensor([[ 0.0819, -0.0220, -0.0599],
                [ 0.2222, -0.1111, -0.1111]])
    """
    if (
        z.device.type != "cpu"
        or z.dtype not in (torch.float32, torch.float64)
        or not z.requires_grad
        or torch.compiler.is_compiling()
    ):
        return torch.softmax(z, 1)
    return _RowSoftmax.apply(z)


def reduce_loss(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-sample ``loss`` reduced by ``reduction`` ("none" | "mean" | "sum", already checked), summed by
    :func:`ordered_sum` (the same bits on any number of threads)."""
    if reduction == "mean":
        return ordered_sum(loss) / loss.numel()
    if reduction == "sum":
        return ordered_sum(loss)
    return loss
