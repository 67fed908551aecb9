"""A fused linear head + calibration loss that never holds the N × V logits (language-model vocabularies).

:func:`fused_linear_loss` computes ``loss(hidden @ weight.T + bias, targets)`` for the losses of
:mod:`torchcal.functional.losses` chunk by chunk over tokens: each chunk's logits (c × V) are made by one
matmul, turned into the chunk's loss and its gradient with respect to the logits in place, and pushed through
the head at once (``grad_hidden = G @ W``, ``grad_weight += G.T @ h``, ``grad_bias += G.sum(0)``), so the
forward pass returns the value with every gradient already computed and the backward pass only scales them by
the incoming gradient. Peak memory is one chunk buffer next to the weight gradient, instead of the
logits, their log-softmax and their gradient over all tokens. With ``vocab_chunk_size`` the vocabulary is
split too: a first pass keeps an online log-sum-exp (running max and rescaled sums) and the other per-token
statistics, a second pass recomputes each block's logits for its gradient (decision 126).

The per-token loss is the unfused loss's by construction: the same weight functions (loss and c = p·∂loss/∂p
for the true class and the runner-up) as :class:`~torchcal.functional._true_class.TrueClassLoss`, and the same
gradient form −(c_t + c_j)·p + c_t e_t + c_j e_j (+ the squared-error and label-smoothing terms), so the value
and gradients equal ``loss(hidden @ weight.T + bias, targets)`` up to rounding.

Tokens labelled ``ignore_index`` are dropped before the matmul (they cost nothing). Half-precision inputs are
computed in float32 (logits, softmax, gradient accumulation) and the gradients returned in the inputs' dtypes.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch

from .._namespace import only_public as _only_public
from .._validation import as_tensor, check_choice, check_float, check_label_range, check_positive_int
from . import losses as L
from ._loss_inputs import IGNORE_INDEX, _check_soft_targets, check_class_weight, check_ignore_index
from ._spec import REDUCTIONS

__all__ = ["FUSED_LOSSES", "fused_linear_loss"]

# tokens per chunk when ``chunk_size`` is not given: as many as make 2^23 logits (32 MiB in float32), and at
# least 256 (fewer rows would make the accumulation into the V × H weight gradient dominate)
_CHUNK_ELEMENTS = 1 << 23
_MIN_CHUNK_ROWS = 256
# elements of the small row buffers (runner-up search, squared-error gradient)
_BUFFER_ELEMENTS = 1 << 21


class _Recipe(NamedTuple):
    """What a fused loss computes per token: ``weight(log_pt[, p_j], extra) -> (loss, c_t[, c_j])`` (None for
    cross entropy), the runner-up (dual focal form), λ of the squared-error term, ε of label smoothing, the
    elementwise weight for soft targets (None: the loss refuses them, for ``soft_refusal``), a per-token
    tensor (AdaFocal-style γ per sample) handed to ``weight`` chunk by chunk, and the class weights (V,) in
    the compute dtype (None: none)."""

    weight: object
    runner_up: bool = False
    brier: float = 0.0
    smoothing: float = 0.0
    soft_weight: object = None
    soft_refusal: str | None = None
    per_token: torch.Tensor | None = None
    class_weight: torch.Tensor | None = None


def _static(weight_fn):
    """A weight function of (log_pt[, p_j]) as a recipe weight (which also receives the per-token extra)."""
    return lambda *args: weight_fn(*args[:-1])


def _cross_entropy(*, label_smoothing: float = 0.0):
    eps = check_float(label_smoothing, "label_smoothing", low=0, high=1)
    return _Recipe(None, smoothing=eps, soft_weight="ce")


def _label_smoothing(*, epsilon: float = 0.05):
    return _cross_entropy(label_smoothing=epsilon)


def _brier():
    def no_nll(log_pt):
        zero = torch.zeros_like(log_pt)
        return zero, zero

    return _Recipe(_static(no_nll), brier=1.0, soft_weight=no_nll)


def _focal(*, gamma: float = 3.0):
    gamma, _, _ = L._gamma_spec(gamma)
    return _Recipe(_static(L._focal_weight(gamma)), soft_weight=L._focal_weight(gamma))


def _inverse_focal(*, gamma: float = 1.0):
    gamma, _, _ = L._gamma_spec(gamma, "inverse")
    return _Recipe(_static(L._inverse_focal_weight(gamma)), soft_weight=L._inverse_focal_weight(gamma))


def _sample_dependent_focal(*, gammas=(5.0, 3.0), thresholds=(0.2,)):
    gammas, thresholds, _ = L._schedule_spec(tuple(gammas), tuple(thresholds))

    def weight(log_pt):
        return L._focal_weight(L._pick_gamma(log_pt.exp(), thresholds, gammas))(log_pt)

    return _Recipe(_static(weight), soft_weight=weight)


def _dual_focal(*, gamma: float = 5.0):
    gamma, _, _ = L._gamma_spec(gamma, "dual")
    return _Recipe(_static(L._dual_weight(gamma)), runner_up=True, soft_refusal=_RUNNER_UP_NEEDS_LABELS)


def _dual_sample_dependent_focal(*, gammas=(5.0, 3.0), thresholds=(0.2,)):
    gammas, thresholds, _ = L._schedule_spec(tuple(gammas), tuple(thresholds), True)

    def weight(log_pt, p_j, _extra):
        return L._dual_weight(L._pick_gamma(log_pt.exp() - p_j, thresholds, gammas))(log_pt, p_j)

    return _Recipe(weight, runner_up=True, soft_refusal=_RUNNER_UP_NEEDS_LABELS)


def _focal_calibration(*, gamma: float = 4.0, lambda_: float = 1.5):
    gamma, lam, _ = L._gamma_spec(gamma, "fcl", lambda_)
    return _Recipe(_static(L._focal_weight(gamma)), brier=lam, soft_weight=L._focal_weight(gamma))


def _varying_focal(*, gamma):
    gamma = as_tensor(gamma, "gamma").detach()
    if not gamma.is_floating_point():
        gamma = gamma.double()

    def weight(log_pt, extra):
        return L._signed_gamma_weight(extra)(log_pt)

    return _Recipe(weight, soft_refusal="γ is given per sample, for its true class", per_token=gamma)


def _adafocal(*, bin_edges, bin_gammas, dual: bool = False):
    edges = as_tensor(bin_edges, "bin_edges").detach()
    gammas = as_tensor(bin_gammas, "bin_gammas").detach()
    if edges.ndim != 1 or gammas.shape != (edges.shape[0] - 1,) or gammas.numel() < 1:
        raise ValueError(
            f"`bin_edges` must have M + 1 entries and `bin_gammas` M (M >= 1), got {tuple(edges.shape)} and "
            f"{tuple(gammas.shape)}"
        )

    def gamma_of(log_pt):  # AdaFocalLoss's lookup: the bin of the detached p_t, right-closed bins
        p_t = log_pt.exp().detach()
        bins = torch.bucketize(p_t, edges[1:-1].to(p_t.device, p_t.dtype), right=False)
        return gammas.to(p_t.device, p_t.dtype)[bins]

    if not dual:

        def weight(log_pt, _extra):
            return L._signed_gamma_weight(gamma_of(log_pt))(log_pt)

        return _Recipe(weight, soft_refusal=L._BINS_NEED_LABELS)

    def dual_weight(log_pt, p_j, _extra):  # AdaDualFocal: the dual base for γ >= 0, inverse focal below
        gamma = gamma_of(log_pt)
        d_loss, d_ct, d_cj = L._dual_weight(gamma.clamp(min=0))(log_pt, p_j)
        i_loss, i_ct = L._inverse_focal_weight((-gamma).clamp(min=0))(log_pt)
        positive = gamma >= 0
        return (
            torch.where(positive, d_loss, i_loss),
            torch.where(positive, d_ct, i_ct),
            torch.where(positive, d_cj, torch.zeros_like(d_cj)),
        )

    return _Recipe(dual_weight, runner_up=True, soft_refusal=L._BINS_NEED_LABELS)


_RUNNER_UP_NEEDS_LABELS = "the dual focal loss is defined by the true class and the runner-up below it"

# name -> builder of the recipe from the loss's keyword arguments (the functional loss's names and defaults)
_BUILDERS = {
    "cross_entropy": _cross_entropy,
    "label_smoothing": _label_smoothing,
    "brier": _brier,
    "focal": _focal,
    "inverse_focal": _inverse_focal,
    "sample_dependent_focal": _sample_dependent_focal,
    "dual_focal": _dual_focal,
    "dual_sample_dependent_focal": _dual_sample_dependent_focal,
    "focal_calibration": _focal_calibration,
    "varying_focal": _varying_focal,
    "adafocal": _adafocal,
}
_ALIASES = {
    "ce": "cross_entropy",
    "ls": "label_smoothing",
    "flsd": "sample_dependent_focal",
    "fcl": "focal_calibration",
}
FUSED_LOSSES = tuple(sorted(_BUILDERS))


def _recipe(loss: str, kwargs: dict) -> _Recipe:
    if not isinstance(loss, str):
        raise TypeError(f"`loss` must be a loss name, one of {list(FUSED_LOSSES)}, got {type(loss).__name__}")
    name = _ALIASES.get(loss, loss)
    if name not in _BUILDERS:
        raise ValueError(f"`loss` must be one of {list(FUSED_LOSSES)} (or {sorted(_ALIASES)}), got {loss!r}")
    builder = _BUILDERS[name]
    params = inspect.signature(builder).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(
            f"loss {name!r} takes the keyword arguments {sorted(params) or 'none'}, got {unknown}"
        )
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in kwargs]
    if missing:
        raise TypeError(f"loss {name!r} needs the keyword arguments {missing}")
    return builder(**kwargs)


# ----------------------------------------------------------------------------- the chunked computation


class _Stats(NamedTuple):
    """Per-token statistics of a chunk's logit rows: log p_t, log p_j and j (runner-up; −inf and 0 when none),
    Σ_k p_k², Σ_k w_k log p_k (label smoothing; w = 1 without class weights) and the log-sum-exp."""

    log_pt: torch.Tensor
    log_pj: torch.Tensor | None
    j: torch.Tensor | None
    sq: torch.Tensor | None
    sum_log_p: torch.Tensor | None
    lse: torch.Tensor


def _masked_max(z, excluded_from, t_local=None):
    """Max and argmax per row of ``z`` over the entries strictly below ``excluded_from`` (and, with
    ``t_local``, not at that column), through a small row buffer so that no (c, V) temporary is allocated."""
    n, k = z.shape
    rows = min(n, max(1, _BUFFER_ELEMENTS // k))
    buf = torch.empty(rows, k, dtype=z.dtype, device=z.device)
    below = torch.empty(rows, k, dtype=torch.bool, device=z.device)
    minus_inf = torch.tensor(-math.inf, dtype=z.dtype, device=z.device)
    values = torch.empty(n, dtype=z.dtype, device=z.device)
    index = torch.empty(n, dtype=torch.long, device=z.device)
    for s in range(0, n, rows):
        m = min(rows, n - s)
        block = z[s : s + m]
        torch.lt(block, excluded_from[s : s + m, None], out=below[:m])
        chunk = torch.where(below[:m], block, minus_inf, out=buf[:m])
        if t_local is not None:  # the true class's own column (when it lies in this block)
            local = t_local[s : s + m]
            inside = (local >= 0) & (local < k)
            cols = local.clamp(0, k - 1)[:, None]
            here = chunk.gather(1, cols)
            chunk.scatter_(1, cols, torch.where(inside[:, None], -math.inf, here))
        torch.max(chunk, dim=1, out=(values[s : s + m], index[s : s + m]))
    return values, index


def _row_stats(z, t, recipe):
    """Statistics of whole logit rows ``z`` (c, V), which are overwritten with the probabilities p."""
    m = z.amax(dim=1, keepdim=True)
    z.sub_(m)  # shifted logits z − max
    zt = z.gather(1, t[:, None]).squeeze(1)
    zj = j = sum_z = None
    if recipe.runner_up:  # the largest class strictly below the true one (ties with it excluded)
        zj, j = _masked_max(z, zt)
    if recipe.smoothing:  # Σ_k w_k (z_k − max), w = 1 without class weights
        sum_z = z.sum(dim=1) if recipe.class_weight is None else z @ recipe.class_weight
    s = z.exp_().sum(dim=1)
    log_s = s.log()
    z.div_(s[:, None])
    sq = torch.linalg.vector_norm(z, dim=1).square() if recipe.brier else None
    k = _weight_total(recipe, z.shape[1])
    return _Stats(
        zt - log_s,
        None if zj is None else zj - log_s,
        j,
        sq,
        None if sum_z is None else sum_z - k * log_s,
        m.squeeze(1) + log_s,
    )


def _logits(h, weight, bias, start=0, stop=None):
    """Logits of the rows ``h`` for the classes [start, stop) of the head."""
    w = weight[start:stop]
    if bias is None:
        return h @ w.T
    return torch.addmm(bias[start:stop], h, w.T)


def _block_stats(h, weight, bias, t, recipe, vchunk):
    """Statistics of the rows ``h`` over the vocabulary in blocks of ``vchunk`` classes: an online
    log-sum-exp (running max m, Σ exp(z − m) and Σ exp(2(z − m)) rescaled when m grows). The true-class logit
    is h·w_t + b_t; the runner-up is the largest logit strictly below it, the true class's column excluded."""
    n, v = h.shape[0], weight.shape[0]
    dtype, device = h.dtype, h.device
    zt = (h * weight[t]).sum(dim=1)
    if bias is not None:
        zt = zt + bias[t]
    m = torch.full((n,), -math.inf, dtype=dtype, device=device)
    s = torch.zeros(n, dtype=dtype, device=device)
    s2 = torch.zeros(n, dtype=dtype, device=device) if recipe.brier else None
    sum_z = torch.zeros(n, dtype=dtype, device=device) if recipe.smoothing else None
    zj = torch.full((n,), -math.inf, dtype=dtype, device=device) if recipe.runner_up else None
    j = torch.zeros(n, dtype=torch.long, device=device) if recipe.runner_up else None
    for start in range(0, v, vchunk):
        z = _logits(h, weight, bias, start, start + vchunk)
        if recipe.runner_up:
            assert zj is not None and j is not None  # made above with recipe.runner_up
            value, index = _masked_max(z, zt, t - start)
            better = value > zj
            zj = torch.where(better, value, zj)
            j = torch.where(better, index + start, j)
        if sum_z is not None:
            cw = recipe.class_weight
            sum_z += z.sum(dim=1) if cw is None else z @ cw[start : start + vchunk]
        new_m = torch.maximum(m, z.amax(dim=1))
        scale = torch.exp(m - new_m)
        z.sub_(new_m[:, None]).exp_()
        s = s * scale + z.sum(dim=1)
        if s2 is not None:
            s2 = s2 * scale.square() + torch.linalg.vector_norm(z, dim=1).square()
        m, z = new_m, None  # the block's buffer is freed before the next one is made
    log_s = s.log()
    lse = m + log_s
    return _Stats(
        zt - lse,
        None if zj is None else zj - lse,
        j,
        None if s2 is None else s2 / s.square(),
        None if sum_z is None else sum_z - _weight_total(recipe, v) * lse,
        lse,
    )


def _weight_total(recipe, v):
    """Σ_k w_k over the vocabulary (V without class weights)."""
    return v if recipe.class_weight is None else recipe.class_weight.sum()


class _Coefficients(NamedTuple):
    """The gradient of a row's loss with respect to its logits: p ⊙ (a + b·p) + c·w (w: the class weights, 1
    without them), plus ``at_t`` at the true class and ``at_j`` at the runner-up (each already multiplied by
    the row's scale)."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor | None
    at_t: torch.Tensor
    at_j: torch.Tensor | None


def _coefficients(stats, recipe, extra, scale, t, v):
    """Per-token loss and gradient coefficients from the statistics (the unfused loss's weight functions).

    loss = w_t·(F(p_t, p_j) + λ(Σp² − 2p_t + 1)) + ε(−Σ_k w_k log p_k / V) with F = (1 − ε)(−log p_t) for
    cross entropy and w the class weights (1 without them); ∂loss/∂z = p ⊙ (w_t(−(c_t + c_j) + 2λ(p_t − Σp²)
    + 2λ·p) + εΣ_k w_k / V) + w_t(c_t − 2λ p_t) e_t + w_t c_j e_j − (ε/V)·w with c = p·∂F/∂p."""
    log_pt = stats.log_pt
    c_j = None
    if recipe.weight is None:  # cross entropy (and label smoothing's (1 − ε) share)
        loss = -(1 - recipe.smoothing) * log_pt
        c_t = torch.full_like(log_pt, -(1 - recipe.smoothing))
    elif recipe.runner_up:
        loss, c_t, c_j = recipe.weight(log_pt, stats.log_pj.exp(), extra)
    else:
        loss, c_t = recipe.weight(log_pt, extra)
    a = -c_t if c_j is None else -(c_t + c_j)
    at_t = c_t
    b = c = None
    lam = recipe.brier
    if lam:
        p_t = log_pt.exp()
        loss = loss + lam * (stats.sq - 2 * p_t + 1)
        a = a + (2 * lam) * (p_t - stats.sq)
        b = torch.full_like(log_pt, 2 * lam) * scale
        at_t = at_t - (2 * lam) * p_t
    if recipe.class_weight is not None:  # the label's weight scales the row (F.cross_entropy's convention)
        w_t = recipe.class_weight[t]
        loss, a, at_t = loss * w_t, a * w_t, at_t * w_t
        b = None if b is None else b * w_t
        c_j = None if c_j is None else c_j * w_t
    if recipe.smoothing:  # −(ε/V)·Σ_k w_k log p_k, every class weighted by its own weight
        loss = loss - recipe.smoothing / v * stats.sum_log_p
        a = a + recipe.smoothing / v * _weight_total(recipe, v)
        c = torch.full_like(log_pt, -recipe.smoothing / v) * scale
    return loss, _Coefficients(a * scale, b, c, at_t * scale, None if c_j is None else c_j * scale)


def _grad_in_place(p, coef, t_local, j_local, class_weight=None):
    """Overwrites the probabilities ``p`` (c, Vb) of a vocabulary block with the loss gradient; ``t_local`` and
    ``j_local`` are the true class and the runner-up relative to the block (outside it: not added),
    ``class_weight`` the block's class weights (None: none)."""
    if coef.b is None:
        p.mul_(coef.a[:, None])
    else:  # p ⊙ (a + b·p), through a small row buffer rather than a (c, Vb) temporary
        rows = max(1, _BUFFER_ELEMENTS // p.shape[1])
        for s in range(0, p.shape[0], rows):
            block = p[s : s + rows]
            block.mul_(torch.addcmul(coef.a[s : s + rows, None], block, coef.b[s : s + rows, None]))
    if coef.c is not None:
        if class_weight is None:
            p.add_(coef.c[:, None])
        else:
            p.addr_(coef.c, class_weight)
    k = p.shape[1]
    for local, value in ((t_local, coef.at_t), (j_local, coef.at_j)):
        if local is None or value is None:
            continue
        inside = (local >= 0) & (local < k)
        p.scatter_add_(1, local.clamp(0, k - 1)[:, None], torch.where(inside, value, 0)[:, None])
    return p


def _soft_rows(z, q, recipe, scale):
    """Loss and gradient (written into ``z``) of whole logit rows against class probabilities ``q``:
    −Σ_k w_k q'_k log p_k with q' = (1 − ε)q + ε/V for cross entropy; Σ_k w_k q_k f(p_k) +
    λ(Σ_k w_k q_k)Σ_k (p_k − q_k)² otherwise, w the class weights (1 without them;
    :class:`~torchcal.functional._true_class.SoftTargetLoss`'s value and gradient)."""
    log_p = torch.log_softmax(z, dim=1)
    cw = recipe.class_weight
    if recipe.soft_weight == "ce":
        eps = recipe.smoothing
        if eps:
            q = q * (1 - eps) + eps / z.shape[1]
        if cw is not None:
            q = q * cw
        loss = -(q * log_p).sum(dim=1)
        grad = torch.exp(log_p, out=z).mul_(q.sum(dim=1, keepdim=True)).sub_(q)
        return loss, grad.mul_(scale[:, None])
    f, c = recipe.soft_weight(log_p)
    qw = q if cw is None else q * cw
    qc = qw * c
    loss = (qw * f).sum(dim=1)
    p = torch.exp(log_p, out=z)
    grad = qc - p * qc.sum(dim=1, keepdim=True)
    if recipe.brier:
        lam = recipe.brier if cw is None else recipe.brier * (q @ cw)[:, None]
        pq = (p - q).square().sum(dim=1, keepdim=True)
        loss = loss + (lam * pq).squeeze(1)
        pd = p * (p - q)
        grad = grad + (2 * lam) * (pd - p * pd.sum(dim=1, keepdim=True))
    return loss, grad.mul_(scale[:, None])


def _run(hidden, index, weight, bias, targets, recipe, extra, chunk, vchunk, row_scale, want):
    """Loss per kept token and, for ``want`` = (hidden, weight, bias) flags, the gradients of
    Σ_i row_scale_i·loss_i, chunk by chunk. ``hidden`` (N, H) holds every token; ``index`` (M,) the kept ones
    (None: all), which ``targets``, ``extra`` and ``row_scale`` follow. Each chunk's rows are gathered and
    brought to the compute dtype of ``weight`` (and ``bias``) on their own, so neither the kept rows nor a
    zero-filled gradient for the dropped ones is ever copied whole."""
    m, v = targets.shape[0], weight.shape[0]
    compute = weight.dtype
    grads = any(want)
    loss = torch.empty(m, dtype=compute, device=weight.device)
    g_h = torch.zeros(hidden.shape, dtype=compute, device=hidden.device) if want[0] else None
    g_w = torch.zeros_like(weight) if want[1] else None
    g_b = torch.zeros(v, dtype=compute, device=weight.device) if want[2] else None
    soft = targets.is_floating_point()
    for start in range(0, m, chunk):
        stop = min(m, start + chunk)
        rows = None if index is None else index[start:stop]
        h = (hidden[start:stop] if rows is None else hidden.index_select(0, rows)).to(compute)
        t = targets[start:stop]
        scale = row_scale[start:stop]
        ext = None if extra is None else extra[start:stop]
        if soft:
            z = _logits(h, weight, bias)
            loss[start:stop], g = _soft_rows(z, t.to(compute), recipe, scale)
            blocks = [(0, v, g)]
        elif vchunk >= v:
            z = _logits(h, weight, bias)
            stats = _row_stats(z, t, recipe)
            loss[start:stop], coef = _coefficients(stats, recipe, ext, scale, t, v)
            blocks = [(0, v, _grad_in_place(z, coef, t, stats.j, recipe.class_weight))] if grads else []
        else:
            stats = _block_stats(h, weight, bias, t, recipe, vchunk)
            loss[start:stop], coef = _coefficients(stats, recipe, ext, scale, t, v)
            grad_of = (h, weight, bias, vchunk, stats, coef, t, recipe)
            blocks = (
                ((b0, min(v, b0 + vchunk), _block_grad(b0, *grad_of)) for b0 in range(0, v, vchunk))
                if grads
                else []
            )
        g_rows = None
        if g_h is not None:
            g_rows = g_h[start:stop] if rows is None else torch.zeros_like(h)
        for b0, b1, g in blocks:
            if g_rows is not None:
                g_rows.addmm_(g, weight[b0:b1])
            if g_w is not None:
                g_w[b0:b1].addmm_(g.T, h)
            if g_b is not None:
                g_b[b0:b1] += g.sum(dim=0)
        if g_h is not None and g_rows is not None and rows is not None:  # (g_rows is made only with g_h)
            g_h.index_copy_(0, rows, g_rows)
        z = g = blocks = g_rows = None  # this chunk's buffer is freed before the next one is made
    return loss, (g_h, g_w, g_b)


def _block_grad(start, h, weight, bias, vchunk, stats, coef, t, recipe):
    """The loss gradient of one vocabulary block, its logits recomputed (second pass)."""
    z = _logits(h, weight, bias, start, start + vchunk)
    p = z.sub_(stats.lse[:, None]).exp_()
    cw = None if recipe.class_weight is None else recipe.class_weight[start : start + vchunk]
    return _grad_in_place(p, coef, t - start, None if stats.j is None else stats.j - start, cw)


class _FusedLinearLoss(torch.autograd.Function):
    """Σ or mean over the kept tokens of loss(hidden @ weight.T + bias): the gradients are computed in the
    forward pass and scaled in the backward (reduction "none" keeps the inputs and recomputes them with the
    per-token incoming gradients). The backward is differentiable once only: its gradients are not functions
    of the inputs that autograd could differentiate again, so a backward with ``create_graph=True`` raises."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, index, extra, recipe, chunk, vchunk, reduction, want):
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.reduction = reduction
        w, b = _compute(weight, bias)
        m = targets.shape[0]
        run = (hidden, index, w, b, targets, recipe, extra, chunk, vchunk)
        if reduction == "none":
            loss, _ = _run(*run, torch.ones(m, dtype=w.dtype, device=w.device), (False, False, False))
            ctx.save_for_backward(hidden, weight, bias, targets, index, extra)
            ctx.args = (recipe, chunk, vchunk, want)
            return loss
        count = m
        if reduction == "mean" and recipe.class_weight is not None and not targets.is_floating_point():
            count = recipe.class_weight[targets].sum()  # F.cross_entropy's Σ w_y over the kept labels
        scale = torch.full((m,), 1.0, dtype=w.dtype, device=w.device)
        if reduction == "mean":
            scale /= count
        loss, grads = _run(*run, scale, want)
        del w, b
        total = loss.sum()
        value = total / count if reduction == "mean" else total
        ctx.save_for_backward(*(None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)))
        return value

    # one gradient argument per output, as in torch's own Functions (the base declares *grad_outputs)
    @staticmethod
    def backward(ctx, grad_out):  # pyright: ignore[reportIncompatibleMethodOverride]
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # (create_graph=True: the gradients were made in the forward pass and are not functions of the
            # inputs here, so a graph of them would miss the second derivative; refused rather than wrong)
            raise RuntimeError(
                "fused_linear_loss is differentiable once only (its gradients are made in the forward pass): "
                "second-order gradients (create_graph=True) are not available; use the unfused loss for them"
            )
        with torch.autocast(grad_out.device.type, enabled=False):
            return _FusedLinearLoss._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        if ctx.reduction == "none":
            hidden, weight, bias, targets, index, extra = ctx.saved_tensors
            recipe, chunk, vchunk, want = ctx.args
            w, b = _compute(weight, bias)
            _, grads = _run(
                hidden, index, w, b, targets, recipe, extra, chunk, vchunk, grad_out.to(w.dtype), want
            )
            grads = [None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)]
        elif grad_out.device.type == "cpu" and bool(grad_out == 1):  # no copy of the weight's gradient
            grads = list(ctx.saved_tensors)
        else:
            grads = [None if g is None else g * grad_out.to(g.dtype) for g in ctx.saved_tensors]
        return (*grads, None, None, None, None, None, None, None, None)


def _compute(weight, bias):
    """The head in the compute dtype: float64 stays, everything else is computed in float32."""
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return weight.to(compute), None if bias is None else bias.to(compute)


# ----------------------------------------------------------------------------- the public function


def fused_linear_loss(
    hidden,
    weight,
    targets,
    loss: str = "cross_entropy",
    *,
    bias=None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    ignore_index: int | None = IGNORE_INDEX,
    reduction: str = "mean",
    class_weight=None,
    **loss_kwargs,
):
    r"""``loss(hidden @ weight.T + bias, targets)`` without materialising the N × V logits.

    The head's matmul, the loss and its gradients with respect to ``hidden``, ``weight`` and ``bias`` are
    computed chunk by chunk over tokens (``chunk_size`` rows at a time) and, with ``vocab_chunk_size``, over
    the vocabulary too (an online log-sum-exp; each block's logits are recomputed for the gradient, so it
    trades a fourth matmul for a smaller buffer). Value and gradients equal the unfused loss's up to rounding.

    Losses (``loss``; keyword arguments as their functional forms in :mod:`torchcal.functional.losses`):
    ``"cross_entropy"`` (``label_smoothing``), ``"label_smoothing"`` (``epsilon``), ``"brier"``, ``"focal"``
    (``gamma``), ``"inverse_focal"`` (``gamma``), ``"sample_dependent_focal"`` (FLSD: ``gammas``,
    ``thresholds``; FLSD-53 by default), ``"dual_focal"`` (``gamma``), ``"dual_sample_dependent_focal"``,
    ``"focal_calibration"`` (``gamma``, ``lambda_``), ``"varying_focal"`` (``gamma``: one γ per token, of
    the targets' shape; negative: inverse focal) and ``"adafocal"`` (``bin_edges``, ``bin_gammas``,
    ``dual``: AdaFocal's γ of the bin holding each token's detached p_t; :class:`torchcal.losses.FusedLinearLoss`
    reads them from an :class:`~torchcal.adafocal.AdaFocalLoss`). Aliases: ``"ce"``, ``"ls"``, ``"flsd"``,
    ``"fcl"``.

    Args:
        hidden: (..., H) floating-point features (float32, float64, or half precision: computed in float32).
        weight: (V, H) weight of the head (``nn.Linear.weight``), of ``hidden``'s dtype and device.
        targets: (...) integer labels in [0, V), or soft targets (..., V) (class probabilities) for the losses
            that accept them (all but the dual focal ones, ``varying_focal`` and ``adafocal``).
        bias: optional (V,) bias of the head.
        chunk_size: tokens per chunk (default: as many as make 2^23 logits, at least 256).
        vocab_chunk_size: classes per vocabulary block (default: the whole vocabulary). Integer labels only:
            soft targets already hold N × V values.
        ignore_index: label of tokens to leave out (None: none); they are dropped before the matmul.
        reduction: "mean" over the kept tokens (NaN when none is kept, as ``F.cross_entropy``), "sum" or
            "none" (per-token losses of the targets' shape, 0 at ignored tokens).
        class_weight: optional (V,) non-negative class weights w, ``F.cross_entropy``'s ``weight``: a labelled
            token's loss is multiplied by w_y and "mean" divides by Σ w_y over the kept tokens; label
            smoothing's ε/V term weights each class by its own w_k; soft targets give Σ_k w_k q_k f(p_k)
            (+ λ·(Σ_k w_k q_k)·Σ_k (p_k − q_k)²) and "mean" divides by the token count, as the unfused losses.

    Returns:
        The loss; differentiable with respect to ``hidden``, ``weight`` and ``bias``, once: the gradients are
        made in the forward pass, so they carry no graph of their own and a backward with
        ``create_graph=True`` (a gradient penalty, second-order methods) raises. ``loss.backward()`` hands
        them over without a copy, so a second backward pass through the same graph (``retain_graph=True``)
        raises if the first one's gradients were changed in place in the meantime (autograd's check of saved
        tensors). No gradient flows to ``targets`` or ``class_weight``.

    Raises:
        ValueError: soft ``targets`` or ``class_weight`` that require grad (detach them: the fused loss gives
            them no gradient), and the argument errors named in the message.
        RuntimeError: from the backward pass, with ``create_graph=True``.

    Example:
        >>> import torch
        >>> from torchcal.functional import fused_linear_loss, sample_dependent_focal_loss
        >>> g = torch.Generator().manual_seed(0)
        >>> hidden = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> weight = torch.randn(10, 4, generator=g, dtype=torch.float64, requires_grad=True)
        >>> targets = torch.tensor([1, 4, -100, 9, 0, 2])  # the third token is padding
        >>> fused = fused_linear_loss(hidden, weight, targets, "sample_dependent_focal", chunk_size=4)
        >>> unfused = sample_dependent_focal_loss(hidden @ weight.T, targets)
        >>> torch.allclose(fused, unfused, rtol=1e-12, atol=0)
        True
        >>> grads = torch.autograd.grad(fused, (hidden, weight))
        >>> unfused_grads = torch.autograd.grad(unfused, (hidden, weight))
        >>> all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(grads, unfused_grads))
        True
    """
    recipe = _recipe(loss, loss_kwargs)
    check_choice(reduction, "reduction", REDUCTIONS)
    ignore_index = check_ignore_index(ignore_index)
    hidden, weight, bias = _check_head(hidden, weight, bias)
    v, width = weight.shape
    lead = tuple(hidden.shape[:-1])
    targets = as_tensor(targets, "targets")
    for value, arg in ((targets, "targets"), (class_weight, "class_weight")):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(
                f"`{arg}` requires grad, but the fused loss gives it no gradient: detach it ({arg}.detach())"
            )
    if class_weight is not None:
        compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
        logits_like = torch.empty(0, v, dtype=compute, device=hidden.device)  # the dtype and device it takes
        recipe = recipe._replace(class_weight=check_class_weight(class_weight, logits_like))
    if targets.device != hidden.device:
        raise ValueError(f"`targets` is on {targets.device} but `hidden` is on {hidden.device}")
    rows = hidden.reshape(-1, width)
    soft = targets.is_floating_point()
    extra = recipe.per_token
    if soft:
        if recipe.soft_weight is None:
            raise TypeError(f"soft (floating) `targets` are not accepted: {recipe.soft_refusal}")
        if tuple(targets.shape) != (*lead, v):
            raise ValueError(
                f"soft `targets` (class probabilities) must have shape {(*lead, v)}, got {tuple(targets.shape)}; "
                f"integer labels have shape {lead}"
            )
        if vocab_chunk_size is not None:
            raise ValueError(
                "`vocab_chunk_size` needs integer labels: soft `targets` already hold N × V values, so the "
                "vocabulary is processed whole"
            )
        if targets.device.type == "cpu":
            _check_soft_targets(targets.reshape(-1, v))
        flat = targets.reshape(-1, v)
        keep = None
    else:
        if targets.dtype == torch.bool or targets.is_complex():
            raise TypeError(
                f"`targets` must hold integer labels (or class probabilities), got {targets.dtype}"
            )
        if tuple(targets.shape) != lead:
            raise ValueError(
                f"`targets` must have shape {lead} to match `hidden`, got {tuple(targets.shape)}"
            )
        flat = targets.reshape(-1).long()
        check_label_range(flat, v, ignore_index)
        keep = None if ignore_index is None else flat != ignore_index
    if extra is not None:
        if tuple(extra.shape) != lead:
            raise ValueError(f"`gamma` must have shape {lead}, one γ per token, got {tuple(extra.shape)}")
        extra = extra.to(hidden.device).reshape(-1)
    index = None
    if keep is not None:  # padding tokens cost nothing: only the kept rows enter the matmuls
        index = keep.nonzero().squeeze(1)
        flat = flat.index_select(0, index)
        extra = None if extra is None else extra.index_select(0, index)
    n = flat.shape[0]
    vchunk = v if vocab_chunk_size is None else check_positive_int(vocab_chunk_size, "vocab_chunk_size")
    if chunk_size is None:
        chunk = max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // min(vchunk, v))
    else:
        chunk = check_positive_int(chunk_size, "chunk_size")
    chunk = max(1, min(chunk, n))
    if extra is not None:
        extra = extra.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    if n == 0:  # every token ignored: 0 (sum, none) or NaN (mean), with zero gradients
        value = (rows[:0] @ weight.T).sum(dim=1) * 0 + rows.sum() * 0
        if bias is not None:
            value = value + bias.sum() * 0
        per_token = value
    else:
        grad_on = torch.is_grad_enabled()
        want = tuple(grad_on and x is not None and x.requires_grad for x in (rows, weight, bias))
        with torch.autocast(rows.device.type, enabled=False):  # the dtypes above, not autocast's
            per_token = _FusedLinearLoss.apply(
                rows, weight, bias, flat, index, extra, recipe, chunk, vchunk, reduction, want
            )
    if reduction == "none":
        if keep is None:
            return per_token.reshape(lead)
        out = per_token.new_zeros(keep.shape)
        return (
            out.index_put((index,), per_token).reshape(lead) if n else (out + per_token.sum()).reshape(lead)
        )
    if n:
        return per_token  # the reduced loss
    return per_token.sum() / 0.0 if reduction == "mean" else per_token.sum()


def _check_head(hidden, weight, bias):
    hidden = as_tensor(hidden, "hidden")
    weight = as_tensor(weight, "weight")
    if not hidden.is_floating_point():
        raise TypeError(f"`hidden` must be a floating-point tensor, got dtype {hidden.dtype}")
    if hidden.ndim < 1 or hidden.numel() == 0 and hidden.shape[-1:] == (0,):
        raise ValueError(f"`hidden` must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"`weight` must have shape (V, H) with H = {hidden.shape[-1]} (hidden's last dimension), "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 2:
        raise ValueError(f"`weight` must have at least 2 classes (rows), got {weight.shape[0]}")
    _check_dtype(weight, hidden, "weight")
    if weight.device != hidden.device:
        raise ValueError(f"`weight` is on {weight.device} but `hidden` is on {hidden.device}")
    if bias is not None:
        bias = as_tensor(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"`bias` must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        _check_dtype(bias, hidden, "bias")
        if bias.device != hidden.device:
            raise ValueError(f"`bias` is on {bias.device} but `hidden` is on {hidden.device}")
    return hidden, weight, bias


_FLOAT32_COMPUTED = frozenset((torch.float32, torch.bfloat16, torch.float16))


def _check_dtype(x, hidden, name):
    """``x`` of hidden's dtype, or both among float32 / bfloat16 / float16 (an autocast region hands
    half-precision hidden states to a float32 head): those are all computed in float32."""
    if x.dtype != hidden.dtype and not (x.dtype in _FLOAT32_COMPUTED and hidden.dtype in _FLOAT32_COMPUTED):
        raise TypeError(
            f"`{name}` must have hidden's dtype {hidden.dtype} (or, for half-precision or float32 hidden states, "
            f"float32 / bfloat16 / float16), got {x.dtype}"
        )


_only_public(__name__)
