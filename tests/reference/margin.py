"""Float64 per-sample loop references of the margin and penalty losses (SPEC §8), written from the formulas of
the released code and the papers, not from torchcal's vectorised code.

Each position of (N, K, d1, ...) logits is visited by explicit loops over the sample and spatial indices, and
every sum is a Python loop over 0-d float64 tensors, so autograd through a reference gives the reference
gradient. Each function returns the loss with the requested reduction and the per-position shape for
``"none"``.
"""

from __future__ import annotations

import itertools
import math

import torch


def positions(logits, targets):
    """(index, [z_k as 0-d tensors], label or [q_k]) for every position of the sample and spatial dims."""
    n, k = logits.shape[:2]
    spatial = logits.shape[2:]
    soft = targets.is_floating_point()
    for i in range(n):
        for s in itertools.product(*(range(d) for d in spatial)):
            z = [logits[(i, c, *s)] for c in range(k)]
            t = [targets[(i, c, *s)] for c in range(k)] if soft else int(targets[(i, *s)])
            yield (i, *s), z, t


def log_softmax(z):
    top = max(float(v.detach()) for v in z)
    total = sum(torch.exp(v - top) for v in z)
    return [v - top - torch.log(total) for v in z]


def ce(log_p, t):
    if isinstance(t, int):
        return -log_p[t]
    return -sum(q * lp for q, lp in zip(t, log_p))


def _combine(logits, targets, per_position, reduction, ignore_index, penalty_on_ignored=False):
    """per_position(z, t) -> (ce_term, penalty_term). An ignored position's CE is left out; its penalty
    counts only when ``penalty_on_ignored``. "mean" averages each term over the positions it covers."""
    ce_terms, pen_terms, none = [], [], {}
    for idx, z, t in positions(logits, targets):
        ignored = isinstance(t, int) and ignore_index is not None and t == ignore_index
        c, pen = per_position(z, 0 if ignored else t)
        value = 0.0 * c
        if not ignored:
            ce_terms.append(c)
            value = value + c
        if not ignored or penalty_on_ignored:
            pen_terms.append(pen)
            value = value + pen
        none[idx] = value
    if reduction == "none":
        shape = (logits.shape[0], *logits.shape[2:])
        out = [none[idx] for idx in itertools.product(*(range(d) for d in shape))]
        return torch.stack(out).reshape(shape)
    if reduction == "sum":
        return sum(ce_terms) + sum(pen_terms)
    return sum(ce_terms) / len(ce_terms) + sum(pen_terms) / len(pen_terms)


def mbls(logits, targets, margin=10.0, alpha=0.1, *, ignore_index=-100, ignored_rows="reference",
         reduction="mean"):  # fmt: skip
    """CE + α·(1/K) Σ_k relu(z_max − z_k − m) per position; the released code keeps ignored rows in the
    margin term when ignore_index < 0."""

    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))  # the first arg-max, as torch.max
        hinge = sum(torch.clamp(z[j] - z[c] - margin, min=0) for c in range(k)) / k
        return ce(log_softmax(z), t), alpha * hinge

    on_ignored = ignored_rows == "reference" and (ignore_index is None or ignore_index < 0)
    return _combine(logits, targets, term, reduction, ignore_index, on_ignored)


def confidence_penalty(logits, targets, beta=1.0, *, eps=1e-6, form="sample", ignore_index=-100,
                       reduction="mean"):  # fmt: skip
    def term(z, t):
        log_p = log_softmax(z)
        p = [torch.exp(v) for v in log_p]
        k = len(z)
        if form == "mbls":
            pc = [torch.clamp(v, 1e-10, 1 - 1e-10) for v in p]
            pen = sum(v * torch.log(v) for v in pc) / k
        else:
            pen = math.log(k) + sum(v * (torch.log(v + eps) if eps else lv) for v, lv in zip(p, log_p))
        return ce(log_p, t), beta * pen

    return _combine(logits, targets, term, reduction, ignore_index)


def maxsup(logits, targets, alpha=0.1, *, ignore_index=-100, reduction="mean"):
    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))
        return ce(log_softmax(z), t), alpha * (z[j] - sum(z) / k)

    return _combine(logits, targets, term, reduction, ignore_index)


def poly1(logits, targets, epsilon=1.0, *, weight=None, label_smoothing=0.0, ignore_index=-100,
          reduction="mean"):  # fmt: skip
    """Σ_k w_k q_k(−log p_k + ε(1 − p_k)) with q the (smoothed) one-hot or soft target; "mean" divides by
    Σ w_y over the kept labels (the number of rows for soft targets)."""
    k = logits.shape[1]
    total, norm, none = 0.0, 0.0, {}
    for idx, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            none[idx] = 0.0 * z[0]
            continue
        log_p = log_softmax(z)
        if isinstance(t, int):
            q = [(1 - label_smoothing) * (c == t) + label_smoothing / k for c in range(k)]
            norm += 1.0 if weight is None else float(weight[t])
        else:
            q = [(1 - label_smoothing) * v + label_smoothing / k for v in t]
            norm += 1.0
        w = [1.0] * k if weight is None else [float(v) for v in weight]
        value = sum(w[c] * q[c] * (-log_p[c] + epsilon * (1 - torch.exp(log_p[c]))) for c in range(k))
        none[idx] = value
        total = total + value
    if reduction == "none":
        shape = (logits.shape[0], *logits.shape[2:])
        return torch.stack([none[idx] for idx in itertools.product(*(range(d) for d in shape))]).reshape(
            shape
        )
    return total if reduction == "sum" else total / norm


def _batch_combined(logits, targets, base_fn, penalty, reduction, ignore_index, weight=None):
    """base_i (times w_y) of the kept positions plus the batch's penalty: "mean" is the base's mean (over
    Σ w_y with weights) + penalty, "none" gives each kept position base_i + penalty, "sum" their sum."""
    total, norm, none = 0.0, 0.0, {}
    for idx, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            none[idx] = 0.0 * z[0]
            continue
        w = 1.0 if weight is None or not isinstance(t, int) else float(weight[t])
        value = w * base_fn(z, t)
        total, norm = total + value, norm + w
        none[idx] = value + penalty
    if reduction == "mean":
        return total / norm + penalty
    shape = (logits.shape[0], *logits.shape[2:])
    out = torch.stack([none[idx] for idx in itertools.product(*(range(d) for d in shape))]).reshape(shape)
    return out if reduction == "none" else out.sum()


def mdca_term(logits, targets, ignore_index=-100):
    """(1/K) Σ_k abs(mean_i p_ik − mean_i 1[y_i = k]) over the kept positions (soft targets: mean_i q_ik)."""
    k = logits.shape[1]
    mean_p, freq, n = [0.0] * k, [0.0] * k, 0
    for _, z, t in positions(logits, targets):
        if isinstance(t, int) and ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        n += 1
        for c in range(k):
            mean_p[c] = mean_p[c] + p[c]
            freq[c] += float(t == c) if isinstance(t, int) else float(t[c])
    return sum(torch.abs(mean_p[c] / n - freq[c] / n) for c in range(k)) / k


def mdca(logits, targets, beta=1.0, *, base="nll", gamma=1.0, smoothing=0.1, ignore_index=-100,
         reduction="mean"):  # fmt: skip
    k = logits.shape[1]

    def base_fn(z, t):
        log_p = log_softmax(z)
        if not isinstance(t, int):
            factor = [1.0 if base == "nll" else (1 - torch.exp(lp)) ** gamma for lp in log_p]
            return -sum(q * f * lp for q, f, lp in zip(t, factor, log_p))
        if base == "nll":
            return -log_p[t]
        if base == "focal":
            return -((1 - torch.exp(log_p[t])) ** gamma) * log_p[t]
        return -sum(((1 - smoothing) if c == t else smoothing / (k - 1)) * log_p[c] for c in range(k))

    penalty = beta * mdca_term(logits, targets, ignore_index)
    return _batch_combined(logits, targets, base_fn, penalty, reduction, ignore_index)


def dca(logits, targets, beta=10.0, *, weight=None, ignore_index=-100, reduction="mean"):
    """CE (weighted) + β·abs(mean_i r_i − mean_i a_i) over the kept positions; a_i is a constant."""
    conf, acc, n = 0.0, 0.0, 0
    for _, z, t in positions(logits, targets):
        if ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        j = max(range(len(p)), key=lambda c: float(p[c].detach()))
        conf, acc, n = conf + p[j], acc + float(j == t), n + 1
    penalty = beta * torch.abs(conf / n - acc / n)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index,
                           weight)  # fmt: skip


def acls(logits, targets, alpha=0.1, margin=10.0, *, lambda_pos=1.0, lambda_neg=0.1, ignore_index=-100,
         ignored_rows="reference", reduction="mean"):  # fmt: skip
    """CE + α·(λ_pos Σ_k [z_k ties the max] relu(z_max − m)² + λ_neg/(K − 1) Σ_k [z_k below the max]
    relu(sg(z_max) − z_k − m)²) per position; the released code's regulariser covers ignored positions."""

    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))  # the first arg-max, as torch.max
        top = float(z[j].detach())
        pos = sum(torch.clamp(z[j] - margin, min=0) ** 2 for c in range(k) if float(z[c].detach()) == top)
        neg = sum(torch.clamp(z[j].detach() - z[c] - margin, min=0) ** 2 for c in range(k)
                  if float(z[c].detach()) != top)  # fmt: skip
        return ce(log_softmax(z), t), alpha * (lambda_pos * pos + lambda_neg * neg / (k - 1))

    return _combine(logits, targets, term, reduction, ignore_index, ignored_rows == "reference")


def sbece_term(logits, targets, n_bins=15, temperature=0.01, form="label", ignore_index=-100):
    """Soft-binned ECE from the definitions, one position and one bin at a time."""
    rs, accs = [], []
    for _, z, t in positions(logits, targets):
        if ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        j = max(range(len(p)), key=lambda c: float(p[c].detach()))
        rs.append(p[j])
        accs.append(float(j == t))
    centres = [(b + 0.5) / n_bins for b in range(n_bins)]
    g = []
    for r in rs:
        e = [torch.exp(-((r - c) ** 2) / temperature) for c in centres]
        total = sum(e)
        g.append([v / total for v in e])
    mass = [sum(g[i][b] for i in range(len(rs))) for b in range(n_bins)]
    if form == "label":
        acc = [sum(g[i][b] * accs[i] for i in range(len(rs))) / (mass[b] if float(mass[b].detach()) > 0 else 1.0)
               for b in range(n_bins)]  # fmt: skip
        value = sum(g[i][b] * (acc[b] - rs[i]) ** 2 for i in range(len(rs)) for b in range(n_bins)) / len(rs)
        return torch.sqrt(value)
    value = 0.0
    for b in range(n_bins):
        den = torch.clamp(mass[b], min=1e-5)
        conf_b = sum(g[i][b] * rs[i] for i in range(len(rs))) / den
        acc_b = sum(g[i][b] * accs[i] for i in range(len(rs))) / den
        value = value + mass[b] / sum(mass) * (conf_b - acc_b) ** 2
    return torch.sqrt(value)


def sbece(logits, targets, lambda_=2.0, *, n_bins=15, temperature=0.01, form="label", ignore_index=-100,
          reduction="mean"):  # fmt: skip
    penalty = lambda_ * sbece_term(logits, targets, n_bins, temperature, form, ignore_index)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index)


def _kept_top_label(logits, targets, ignore_index):
    """[(p as a list of 0-d tensors, arg-max j, label)] of the kept positions."""
    out = []
    for _, z, t in positions(logits, targets):
        if ignore_index is not None and t == ignore_index:
            continue
        p = [torch.exp(v) for v in log_softmax(z)]
        j = max(range(len(p)), key=lambda c: float(p[c].detach()))
        out.append((p, j, t))
    return out


def avuc_term(logits, targets, threshold=1.0, ignore_index=-100):
    """−log(AvU + 1e-10) of the kept positions, one position at a time (IntelLabs AvULoss)."""
    n_ac = n_au = n_ic = n_iu = 0.0
    for p, j, t in _kept_top_label(logits, targets, ignore_index):
        h = -sum(v * torch.log(v + 1e-10) for v in p)
        th = torch.tanh(h)
        certain = float(h.detach()) <= threshold
        if j == t and certain:
            n_ac = n_ac + p[j] * (1 - th)
        elif j == t:
            n_au = n_au + p[j] * th
        elif certain:
            n_ic = n_ic + (1 - p[j]) * (1 - th)
        else:
            n_iu = n_iu + (1 - p[j]) * th
    avu = (n_ac + n_iu) / (n_ac + n_au + n_ic + n_iu + 1e-10)
    return -torch.log(avu + 1e-10)


def avuc(logits, targets, beta=3.0, *, threshold=1.0, ignore_index=-100, reduction="mean"):
    penalty = beta * avuc_term(logits, targets, threshold, ignore_index)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index)


def soft_avuc_term(logits, targets, temperature, kappa, ignore_index=-100):
    """log(1 + (n_AU + n_IC)/max(n_AC + n_IU, 1e-5)) with the soft uncertainty q_i (uncertainty-baselines)."""
    n_ac = n_au = n_ic = n_iu = 0.0
    for p, j, t in _kept_top_label(logits, targets, ignore_index):
        k = len(p)
        ps = [(1 - 1e-5) * v + 1e-5 / k for v in p]
        h = -sum(v * torch.log(v) for v in ps)
        e = h / math.log(k)
        q = torch.sigmoid(torch.log(e * (1 - kappa) / ((1 - e) * kappa)) / temperature)
        th = torch.tanh(h)
        if j == t:
            n_ac, n_au = n_ac + (1 - q) * (1 - th), n_au + q * th
        else:
            n_ic, n_iu = n_ic + (1 - q) * (1 - th), n_iu + q * th
    return torch.log(1 + (n_au + n_ic) / torch.clamp(n_ac + n_iu, min=1e-5))


def soft_avuc(logits, targets, beta=1.0, *, temperature=0.1, kappa=0.5, ignore_index=-100, reduction="mean"):
    penalty = beta * soft_avuc_term(logits, targets, temperature, kappa, ignore_index)
    return _batch_combined(logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index)


def esd_term(logits, targets, ignore_index=-100):
    """ESD from the paper's per-position mean and unbiased variance of x_ij = (a_j − r_j)·1[r_j <= r_i] over
    the other positions j (the reference's μ_i, v_i, d_i² = μ_i² − v_i/(n − 1))."""
    kept = _kept_top_label(logits, targets, ignore_index)
    n = len(kept)
    if n < 3:
        return torch.zeros((), dtype=logits.dtype)
    r = [p[j] for p, j, _ in kept]
    a = [float(j == t) for _, j, t in kept]
    total = 0.0
    for i in range(n):
        x = [(a[j] - r[j]) * float(float(r[j].detach()) <= float(r[i].detach())) for j in range(n) if j != i]
        mu = sum(x) / (n - 1)
        var = sum(v * v for v in x) / (n - 2) - (n - 1) / (n - 2) * mu * mu
        total = total + mu * mu - var / (n - 1)
    return total / n


def esd(logits, targets, lambda_=4.0, *, holdout=0.0, ignore_index=-100, reduction="mean"):
    n = logits.shape[0]
    held = math.ceil(holdout * n) if holdout else 0
    cal_z, cal_y = logits[n - held :] if held else logits, targets[n - held :] if held else targets
    value = esd_term(cal_z, cal_y, ignore_index)
    penalty = lambda_ * torch.sqrt(value) if float(value.detach()) > 0 else 0.0 * value
    if not held:
        return _batch_combined(
            logits, targets, lambda z, t: -log_softmax(z)[t], penalty, reduction, ignore_index
        )
    out = _batch_combined(logits[: n - held], targets[: n - held], lambda z, t: -log_softmax(z)[t], penalty,
                          reduction, ignore_index)  # fmt: skip
    if reduction == "none":
        return torch.cat([out, torch.zeros((held, *out.shape[1:]), dtype=out.dtype)])
    return out


def ace_cells(probs, targets, kept, n_bins=20, binning="hard", empty_weight=0.01):
    """mL1-ACE of one (image, class) cell from lists of 0-d probabilities, float targets and kept flags, bin by
    bin: hard bins (e_b, e_{b+1}] of linspace(0, 1 + eps32, M + 1) (0 in bin 0); soft bins: the weight of p in
    bin b is max(0, 1 − |p − c_b|/Δ) between the neighbouring centres c_b, 1 in the end bins beyond them."""
    eps = 1.1920928955078125e-07
    top = 1 + eps
    centres = [(2 * b + 1) / (2 * n_bins) * top for b in range(n_bins)]
    step = top / n_bins
    count = [0.0] * n_bins
    sp = [0.0] * n_bins
    sy = [0.0] * n_bins
    for p, y, k in zip(probs, targets, kept):
        if not k:
            continue
        v = float(p.detach())
        for b in range(n_bins):
            if binning == "hard":
                low, high = b * top / n_bins, (b + 1) * top / n_bins
                w = 1.0 if (low < v <= high or (b == 0 and v <= high)) else 0.0
            elif (b == 0 and v <= centres[0]) or (b == n_bins - 1 and v >= centres[-1]):
                w = 1.0 + 0.0 * p
            else:
                w = torch.clamp(1 - torch.abs(p - centres[b]) / step, min=0)
            count[b] = count[b] + w
            sp[b] = sp[b] + w * p
            sy[b] = sy[b] + w * y
    gaps = []
    for b in range(n_bins):
        c = float(count[b].detach()) if isinstance(count[b], torch.Tensor) else count[b]
        if (binning == "hard" and c > 0) or (binning == "soft" and c >= empty_weight):
            gaps.append(torch.abs(sp[b] / count[b] - sy[b] / count[b]))
    return sum(gaps) / len(gaps) if gaps else 0.0 * probs[0]


def ml1ace_term(logits, targets, *, n_bins=20, binning="hard", empty_weight=0.01, multilabel=False,
                per_image=None, include_background=True, ignore_empty_classes=True, ignore_index=-100):  # fmt: skip
    """(list of per-image lists of per-class ACE, list of the images covered) from explicit loops."""
    n, c = logits.shape[:2]
    spatial = logits.shape[2:]
    if per_image is None:
        per_image = len(spatial) > 0
    groups = [[i] for i in range(n)] if per_image else [list(range(n))]
    out, covered = [], []
    for members in groups:
        cells = []
        n_kept = 0
        for cls in range(0 if include_background else 1, c):
            probs, ys, kept = [], [], []
            for i in members:
                for s in itertools.product(*(range(d) for d in spatial)):
                    if multilabel:
                        probs.append(torch.sigmoid(logits[(i, cls, *s)]))
                        ys.append(float(targets[(i, cls, *s)]))
                        kept.append(True)
                        continue
                    z = [logits[(i, j, *s)] for j in range(c)]
                    p = torch.exp(log_softmax(z)[cls])
                    if targets.is_floating_point():
                        y, k = float(targets[(i, cls, *s)]), True
                    else:
                        t = int(targets[(i, *s)])
                        k = ignore_index is None or t != ignore_index
                        y = float(t == cls)
                    probs.append(p)
                    ys.append(y)
                    kept.append(k)
            n_kept = sum(kept)
            value = ace_cells(probs, ys, kept, n_bins, binning, empty_weight)
            if ignore_empty_classes and sum(y for y, k in zip(ys, kept) if k) == 0:
                value = 0.0 * value
            cells.append(value)
        out.append(cells)
        covered.append(n_kept > 0)
    return out, covered


def ml1ace(logits, targets, lambda_=1.0, *, reduction="mean", **options):
    """CE (BCE with multilabel) + λ·mL1-ACE: "mean" over the base's kept elements + λ·mean of the covered
    cells; "none": each kept element + λ·its image's mean over the classes."""
    multilabel = options.get("multilabel", False)
    ignore_index = options.get("ignore_index", -100)
    cells, covered = ml1ace_term(logits, targets, **options)
    n = logits.shape[0]
    spatial = logits.shape[2:]
    per_image = options.get("per_image")
    per_image = len(spatial) > 0 if per_image is None else per_image
    image_term = [lambda_ * sum(c) / len(c) for c in cells]
    base, count, none = 0.0, 0, {}
    if multilabel:
        for idx in itertools.product(*(range(d) for d in logits.shape)):
            z, t = logits[idx], float(targets[idx])
            value = -(t * torch.nn.functional.logsigmoid(z) + (1 - t) * torch.nn.functional.logsigmoid(-z))
            base, count = base + value, count + 1
            none[idx] = value + image_term[idx[0] if per_image else 0]
        shape = tuple(logits.shape)
    else:
        for idx, z, t in positions(logits, targets):
            if isinstance(t, int) and ignore_index is not None and t == ignore_index:
                none[idx] = 0.0 * z[0]
                continue
            value = ce(log_softmax(z), t)
            base, count = base + value, count + 1
            none[idx] = value + image_term[idx[0] if per_image else 0]
        shape = (n, *spatial)
    if reduction == "mean":
        flat = [v for cs, cov in zip(cells, covered) if cov for v in cs]
        return base / count + lambda_ * sum(flat) / len(flat)
    out = torch.stack([none[idx] for idx in itertools.product(*(range(d) for d in shape))]).reshape(shape)
    return out if reduction == "none" else out.sum()


def cals(logits, targets, lambdas, rhos, margin=10.0, *, normalize=True, ignore_index=-100,
         ignored_rows="reference", reduction="mean"):  # fmt: skip
    """CE + (1/K) Σ_k P(h_k; λ_k, ρ_k) per position, P(h) = (max(0, λ + ρh)² − λ²)/(2ρ); the released code's
    penalty covers ignored positions."""

    def term(z, t):
        k = len(z)
        j = max(range(k), key=lambda c: float(z[c].detach()))
        pen = 0.0
        for c in range(k):
            h = (z[j] - z[c] - margin) / (margin if normalize else 1.0)
            lam, rho = float(lambdas[c]), float(rhos[c])
            pen = pen + (torch.clamp(lam + rho * h, min=0) ** 2 - lam**2) / (2 * rho)
        return ce(log_softmax(z), t), pen / k

    return _combine(logits, targets, term, reduction, ignore_index, ignored_rows == "reference")
