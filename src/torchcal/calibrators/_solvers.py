"""Convex solvers for the softmax-regression calibrators (vector/matrix scaling, SVS, SMS, BCTS, NBVS,
Dirichlet): objectives with analytic gradients and Hessians, a damped Newton method for small parameter
counts and L-BFGS with a strong-Wolfe line search for large ones. Everything stays on the input's device.

The models are affine in their parameters: logits ``o = offset + f ⊙ w + b`` (the diagonal family) or
``o = offset + f Wᵀ + b`` (the full family), scored by mean cross-entropy plus a quadratic penalty.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import torch

__all__ = ["DiagModel", "FullModel", "minimize", "minimize_nonnegative", "newton", "lbfgs"]

# Hessians cost N·P² multiply-adds; above this many (or this many parameters) L-BFGS is cheaper.
NEWTON_MAX_WORK = 2.5e9
NEWTON_MAX_PARAMS = 600
# from this many feature entries on, value and gradient are computed in cache-sized row blocks
CHUNKED_MIN_ELEMENTS = 1 << 21


def _ce_terms(o: torch.Tensor, y: torch.Tensor):
    """Mean cross-entropy of softmax(o), probabilities p and residual r = p − onehot(y) (in place on p)."""
    n = o.shape[0]
    lse = torch.logsumexp(o, dim=1)
    loss = (lse.sum() - o.gather(1, y[:, None]).sum()) / n
    p = o.sub_(lse[:, None]).exp_()  # o is a private buffer: reuse it
    return loss, p


def _residual(p, y):
    r = p.clone()
    r[torch.arange(len(y), device=y.device), y] -= 1.0
    return r


class DiagModel:
    """Logits ``o = offset + f ⊙ w + b`` for features f (N, K), the scale w per class (``scale="class"``),
    shared (``"shared"``: one θ entry for all classes) or absent (``"none"``), plus ``scale0``; the bias b
    on all classes (``bias=True``), on all but the last (``"all_but_last"``: b_K = 0) or absent.
    θ = [scale entries, bias entries]. ``penalty(θ, order)`` returns (value, gradient, Hessian or None)."""

    def __init__(self, f, y, scale: str, bias, offset=None, penalty=None, scale0=None):
        self.f, self.y, self.offset = f, y, offset
        self.k = f.shape[1]
        self.scale = scale
        self.n_scale = {"class": self.k, "shared": 1, "none": 0}[scale]
        self.n_bias = {True: self.k, "all_but_last": self.k - 1, False: 0}[bias]
        self.n_params = self.n_scale + self.n_bias
        self.scale0 = scale0  # added to the scale (e.g. 1 for v = 1 + δ)
        self.penalty = penalty

    def to(self, dtype):
        """The same objective with features in ``dtype``."""
        self.f = self.f.to(dtype)
        self.offset = None if self.offset is None else self.offset.to(dtype)
        return self

    def split(self, theta):
        """(w (K,), b (K,) or None) for θ."""
        k = self.k
        w = theta[: self.n_scale]
        if self.scale == "shared":
            w = w.expand(k)
        if self.scale0 is not None:
            w = w + self.scale0
        b = theta[self.n_scale :] if self.n_bias else None
        if b is not None and self.n_bias < k:
            b = torch.cat([b, b.new_zeros(k - self.n_bias)])
        return w, b

    def logits(self, theta):
        w, b = self.split(theta.to(self.f.dtype))
        o = self.f * w if self.scale != "none" else torch.zeros_like(self.f)
        if b is not None:
            o += b
        if self.offset is not None:
            o += self.offset
        return o

    def __call__(self, theta, order: int):
        f, y, n, k = self.f, self.y, self.f.shape[0], self.k
        if order <= 1 and self.offset is None and f.numel() >= CHUNKED_MIN_ELEMENTS:
            return self._chunked(theta, order)
        loss, p = _ce_terms(self.logits(theta), y)
        value = loss.to(theta.dtype)
        grad = hess = None
        a = f * p if order >= 1 and self.scale != "none" else None
        if order >= 1:
            # Σ_i (p_ik − 1[y_i = k]) x_ik as Σ_i p_ik x_ik minus the sums over each class's rows, in
            # float64 (f ⊙ p is the Hessian's too, and no residual copy is made)
            parts = []
            if a is not None:
                fy = f.gather(1, y[:, None])[:, 0].double()
                label_sums = torch.zeros(k, dtype=torch.float64, device=f.device).index_add_(0, y, fy)
                gw = (a.sum(0, dtype=torch.float64) - label_sums) / n
                parts.append(gw.sum(0, keepdim=True) if self.scale == "shared" else gw)
            if self.n_bias:
                counts = torch.bincount(y, minlength=k).to(torch.float64)
                parts.append(((p.sum(0, dtype=torch.float64) - counts) / n)[: self.n_bias])
            grad = torch.cat(parts).to(theta.dtype)
        if order >= 2:
            # H over [w (K), b (K)] = diag blocks of mean f²p, fp, p minus the Gram matrix of [f ⊙ p, p]
            # (formed in float32: Newton needs only an approximate Hessian, the gradient stays exact)
            width = (k if a is not None else 0) + (k if self.n_bias else 0)
            m = torch.empty(n, width, dtype=torch.float32, device=f.device)
            if a is not None:
                m[:, :k] = a
            if self.n_bias:
                m[:, width - k :] = p
            big = -(m.T @ m).to(f.dtype) / n
            if a is not None:
                big[:k, :k] += torch.diag((a * f).sum(0) / n)
            if self.n_bias:
                o = k if self.scale != "none" else 0
                big[o:, o:] += torch.diag(p.sum(0) / n)
                if a is not None:
                    d_wb = torch.diag(a.sum(0) / n)
                    big[:k, k:] += d_wb
                    big[k:, :k] += d_wb
                if self.n_bias < k:  # drop the fixed last bias
                    keep = torch.arange(o + self.n_bias, device=f.device)
                    big = big[keep][:, keep]
            if self.scale == "shared":  # θ's first entry drives all K scales: sum their rows and columns
                head = big[:k].sum(0, keepdim=True)
                big = torch.cat([head, big[k:]], 0)
                head = big[:, :k].sum(1, keepdim=True)
                big = torch.cat([head, big[:, k:]], 1)
            hess = big.to(theta.dtype)
        return _add_penalty(self.penalty, theta, order, value, grad, hess)

    def _chunked(self, theta, order):
        """Value and gradient in row blocks that stay in cache (about 64k entries each), with one exp per
        entry and no N×K temporaries: large inputs are memory-bound, and this halves the traffic."""
        f, y, n, k = self.f, self.y, self.f.shape[0], self.k
        w, b = self.split(theta.to(f.dtype))
        if self.scale == "none":
            w = torch.zeros_like(f[0])
        if b is None:
            b = torch.zeros_like(f[0])
        rows = max(1, min(n, (1 << 16) // k))
        buf = torch.empty(rows, k, dtype=f.dtype, device=f.device)
        tmp = torch.empty(rows, k, dtype=f.dtype, device=f.device)
        loss = torch.zeros((), dtype=torch.float64, device=f.device)
        sum_pf = torch.zeros(k, dtype=torch.float64, device=f.device)
        sum_p = torch.zeros(k, dtype=torch.float64, device=f.device)
        for s in range(0, n, rows):
            fc = f[s : s + rows]
            m = fc.shape[0]
            o, t = buf[:m], tmp[:m]
            torch.addcmul(b, fc, w, out=o)
            mx = o.amax(1, keepdim=True)
            o.sub_(mx).exp_()
            se = o.sum(1, keepdim=True)
            loss += (mx + se.log()).sum(dtype=torch.float64)
            if order >= 1:  # Σ_i p_ik and Σ_i p_ik f_ik as products with 1/se: no division pass, and the
                # block's float32 sums (≤ 64k / K rows) go to float64 as K-vectors, not entry by entry
                inv = se.reciprocal_()
                sum_p += (o.T @ inv)[:, 0]
                sum_pf += (torch.mul(o, fc, out=t).T @ inv)[:, 0]
        fy = f.gather(1, y[:, None])[:, 0]
        loss -= (fy * w[y] + b[y]).sum(dtype=torch.float64)
        value = (loss / n).to(theta.dtype)
        grad = None
        if order >= 1:
            counts = torch.bincount(y, minlength=k).to(torch.float64)
            gw = (sum_pf - torch.zeros_like(sum_pf).index_add_(0, y, fy.double())) / n
            gb = (sum_p - counts) / n
            parts = []
            if self.scale != "none":
                parts.append(gw.sum(0, keepdim=True) if self.scale == "shared" else gw)
            if self.n_bias:
                parts.append(gb[: self.n_bias])
            grad = torch.cat(parts).to(theta.dtype)
        return _add_penalty(self.penalty, theta, order, value, grad, None)

    def _sub_probs(self, theta, stride):
        """(p (1 − p), p, f, n) on every ``stride``-th row, p the softmax probabilities at θ."""
        sub = copy.copy(self)  # the same model on every stride-th row
        sub.f, sub.y = self.f[::stride], self.y[::stride]
        sub.offset = None if self.offset is None else self.offset[::stride]
        _, p = _ce_terms(sub.logits(theta), sub.y)
        return p * (1 - p), p, sub.f, sub.f.shape[0]

    def diag_hessian(self, theta, stride: int = 1):
        """Diagonal of the Hessian of the cross-entropy part at θ, from every ``stride``-th row (for
        preconditioning)."""
        return self._diag_parts(*self._sub_probs(theta, stride), theta)

    def block_hessian(self, theta, stride: int = 1):
        """(:meth:`diag_hessian`, mean_i p_ik (1 − p_ik) f_ik per class: the Hessian entry coupling w_k and
        b_k), from one softmax pass."""
        v, p, f, n = self._sub_probs(theta, stride)
        return self._diag_parts(v, p, f, n, theta), ((v * f).sum(0) / n).to(theta.dtype)

    def _diag_parts(self, v, p, f, n, theta):
        parts = []
        if self.scale == "class":
            parts.append((v * f * f).sum(0) / n)
        elif self.scale == "shared":
            fp = (f * p).sum(1)
            parts.append(((f * f * p).sum(1) - fp * fp).sum(0, keepdim=True) / n)
        if self.n_bias:
            parts.append(v.sum(0)[: self.n_bias] / n)
        return torch.cat(parts).to(theta.dtype)


def _add_penalty(penalty, theta, order, value, grad, hess):
    if penalty is not None:
        pv, pg, ph = penalty(theta, order)
        value = value + pv
        if grad is not None:
            grad = grad + pg
        if hess is not None:
            hess = hess + ph
    return value, grad, hess


class FullModel:
    """Logits ``o = offset + f Wᵀ + b`` with θ = [W (R, K) row-major, b (R)]: the first ``rows`` = R rows
    of [W | b] are free and the others are 0 (R = K − 1 fixes the last class's logit at 0, the
    reference-row parametrisation of Dirichlet calibration). W is measured from ``weight0`` (K, K), e.g.
    the identity for W = I + Δ."""

    def __init__(self, f, y, offset=None, penalty=None, weight0=None, rows=None):
        self.f, self.y, self.offset = f, y, offset
        self.k = f.shape[1]
        self.rows = self.k if rows is None else rows
        self.n_params = self.rows * (self.k + 1)
        self.weight0 = weight0
        self.penalty = penalty

    to = DiagModel.to

    def split(self, theta):
        """(W (K, K), b (K,)) for θ."""
        k, r = self.k, self.rows
        w, b = theta[: r * k].view(r, k), theta[r * k :]
        if r < k:
            w = torch.cat([w, w.new_zeros(k - r, k)])
            b = torch.cat([b, b.new_zeros(k - r)])
        if self.weight0 is not None:
            w = w + self.weight0.to(w.dtype)
        return w, b

    def logits(self, theta):
        w, b = self.split(theta.to(self.f.dtype))
        o = torch.addmm(b, self.f, w.T)
        if self.offset is not None:
            o += self.offset
        return o

    def __call__(self, theta, order: int):
        f, y, n, k, rows = self.f, self.y, self.f.shape[0], self.k, self.rows
        loss, p = _ce_terms(self.logits(theta), y)
        value = loss.to(theta.dtype)
        grad = hess = None
        if order >= 1:
            r = _residual(p, y)[:, :rows]
            grad = torch.cat([(r.T @ f).reshape(-1), r.sum(0)]).div_(n).to(theta.dtype)
        if order >= 2:
            x = torch.cat([f, torch.ones_like(f[:, :1])], 1)  # (N, K+1)
            # H[(k,a),(j,c)] = mean_i (p_ik δ_kj − p_ik p_ij) x_ia x_ic over the free rows k, j, in the
            # layout (W row-major, then b). Formed in float32 (half the cost; Newton needs only an
            # approximate Hessian, the gradient stays exact); Σ_i p_ik x_i x_iᵀ by one matrix product.
            p32, x32 = p[:, :rows].float(), x.float()
            px = (p32[:, :, None] * x32[:, None, :]).reshape(n, -1)
            h = -(px.T @ px)
            blocks = (px.T @ x32).view(rows, k + 1, k + 1)
            h4 = h.view(rows, k + 1, rows, k + 1)
            idx = torch.arange(rows, device=f.device)
            h4[idx, :, idx, :] += blocks
            h = h4.div_(n)
            # reorder from (k, a) with a = K being the bias, into [W (k, j<K)..., b (k)]
            ar, ak = torch.arange(rows, device=f.device), torch.arange(k, device=f.device)
            perm = torch.cat([(ar[:, None] * (k + 1) + ak).reshape(-1), ar * (k + 1) + k])
            size = rows * (k + 1)
            hess = h.reshape(size, size)[perm][:, perm].to(theta.dtype)
        return _add_penalty(self.penalty, theta, order, value, grad, hess)

    def diag_hessian(self, theta, stride: int = 1):
        """Diagonal of the Hessian of the cross-entropy part at θ, from every ``stride``-th row (for
        preconditioning)."""
        f, y, k = self.f[::stride], self.y[::stride], self.k
        n = f.shape[0]
        w, b = self.split(theta.to(f.dtype))
        o = torch.addmm(b, f, w.T)
        if self.offset is not None:
            o += self.offset[::stride]
        _, p = _ce_terms(o, y)
        v = (p * (1 - p))[:, : self.rows]
        x2 = torch.cat([f * f, torch.ones_like(f[:, :1])], 1)
        d = (v.T @ x2) / n  # (R, K+1)
        return torch.cat([d[:, :k].reshape(-1), d[:, k]]).to(theta.dtype)


def ridge(weights: torch.Tensor, center: torch.Tensor | None = None):
    """Penalty Σ_j weights_j (θ_j − center_j)² as (value, gradient, Hessian) of θ."""

    def penalty(theta, order=2):
        if order == "diag":
            return 2 * weights.to(theta.dtype)
        d = theta if center is None else theta - center.to(theta.dtype)
        w = weights.to(theta.dtype)
        return (w * d * d).sum(), 2 * w * d, (torch.diag(2 * w) if order >= 2 else None)

    return penalty


def newton(
    fun: Callable, x0: torch.Tensor, max_iter: int = 100, tol: float = 1e-12
) -> tuple[torch.Tensor, float, int, bool]:
    """Damped Newton on a convex, twice differentiable ``fun(θ, order) -> (f, g, H)``.

    Each step solves H d = −g by Cholesky (a singular H, e.g. a bias whose common shift leaves the softmax
    unchanged, gets a tiny ridge), then backtracks from t = 1 by halving until Armijo's condition holds.
    Stops when the Newton decrement gᵀH⁻¹g / 2 falls below ``tol`` (in units of the objective) or when a
    step no longer decreases it. Returns (θ, f, iterations, converged).
    """
    x = x0.clone()
    f, g, h = fun(x, 2)
    eye = torch.eye(len(x), dtype=x.dtype, device=x.device)
    scale = h.diagonal().abs().max().clamp_min(1e-30)
    for it in range(1, max_iter + 1):
        jitter = 0.0
        while True:
            chol, info = torch.linalg.cholesky_ex(h + jitter * scale * eye)
            if int(info) == 0:
                break
            jitter = 1e-12 if jitter == 0.0 else jitter * 100
            if jitter > 1:
                chol = None
                break
        d = -torch.cholesky_solve(g[:, None], chol)[:, 0] if chol is not None else -g / scale
        decrement = float(-(g @ d))
        if decrement / 2 <= tol:
            return x, float(f), it - 1, True
        # the full step is tried with its gradient and Hessian (it is nearly always accepted, and its
        # softmax then serves both); shorter steps by value alone
        t, trial = 1.0, fun(x + d, 2)
        while not float(trial[0]) <= float(f) - 1e-4 * t * decrement:  # (a NaN value is not accepted)
            t *= 0.5
            if t <= 1e-10:
                return x, float(f), it, abs(decrement) < 1e-8
            trial = fun(x + t * d, 0)
        x = x + t * d
        f, g, h = trial if t == 1.0 else fun(x, 2)
    return x, float(f), max_iter, False


def lbfgs(
    fun: Callable,
    x0: torch.Tensor,
    max_iter: int = 1000,
    gtol: float = 1e-6,
    ftol: float | None = None,
    history: int = 20,
) -> tuple[torch.Tensor, float, int, bool]:
    """L-BFGS (two-loop recursion, ``history`` pairs) with a strong-Wolfe line search (torch's cubic
    interpolating search, c1 = 1e-4, c2 = 0.9) on ``fun(θ, 1) -> (f, g, _)``, with the analytic gradient
    (no autograd graph, no optimizer object). The first step is scaled to unit length. Stops when max |g| ≤
    ``gtol`` or the objective changes by less than ``ftol`` relative to max(1, |f|) (default 1e-11 in
    float64, 1e-7 in float32). Returns (θ, f, iterations, converged)."""
    from torch.optim.lbfgs import _strong_wolfe  # a plain function: no optimizer (and no dynamo) import

    if ftol is None:
        ftol = 1e-11 if x0.dtype == torch.float64 else 1e-7
    x = x0.clone()
    f, g, _ = fun(x, 1)
    s_hist, y_hist, rho_hist = [], [], []
    h_diag = 1.0

    def obj(x_base, t, d):
        value, grad, _ = fun(x_base + t * d, 1)
        return float(value), grad

    for it in range(1, max_iter + 1):
        if float(g.abs().max()) <= gtol:
            return x, float(f), it - 1, True
        q = -g
        alphas = []
        for s_, y_, r_ in zip(reversed(s_hist), reversed(y_hist), reversed(rho_hist)):
            a = r_ * (s_ @ q)
            q = q - a * y_
            alphas.append(a)
        d = q * h_diag
        for (s_, y_, r_), a in zip(zip(s_hist, y_hist, rho_hist), reversed(alphas)):
            d = d + s_ * (a - r_ * (y_ @ d))
        gtd = float(g @ d)
        if gtd > -1e-30:  # not a descent direction (round-off): restart from the gradient
            s_hist, y_hist, rho_hist, h_diag = [], [], [], 1.0
            d, gtd = -g, float(-(g @ g))
        if -gtd / 2 < _ulp(f, x.dtype):
            # the best decrease along d (−gᵀd / 2 on the quadratic model) is below one unit in the last
            # place of f: no step can show Armijo's decrease, and the line search would spend its ~10-25
            # evaluations to return t = 0 (a zero change, which the ftol test below accepts)
            return x, float(f), it, True
        t = 1.0  # the variables are scaled by the Hessian's diagonal (see minimize): a unit step is natural
        f_new, g_new, t, _ = _strong_wolfe(obj, x, t, d, float(f), g, gtd, tolerance_change=1e-12, max_ls=25)
        step = t * d
        yv = g_new - g
        ys = float(yv @ step)
        if ys > 1e-10 * float(yv @ yv) ** 0.5 * float(step @ step) ** 0.5:
            if len(s_hist) == history:
                s_hist.pop(0)
                y_hist.pop(0)
                rho_hist.pop(0)
            s_hist.append(step)
            y_hist.append(yv)
            rho_hist.append(1.0 / ys)
            h_diag = ys / float(yv @ yv)
        x = x + step
        change = abs(float(f) - f_new)
        f, g = f_new, g_new
        if change <= ftol * max(1.0, abs(f_new)):
            return x, float(f), it, True
    return x, float(f), max_iter, float(g.abs().max()) <= gtol


def _ulp(value, dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``value``: the resolution of an objective stored in ``dtype``."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(value)), 1e-300)))


def _preconditioner(model, x0, stride):
    """Linear maps θ = T u, u = T⁻¹ θ and g_u = Tᵀ g with TᵀHT ≈ I. For a per-class scale and bias, T
    inverts the 2×2 Hessian block of (w_k, b_k) (their coupling is strong: both move class k's logit);
    otherwise the diagonal."""
    blocks = isinstance(model, DiagModel) and model.scale == "class" and model.n_bias == model.k
    c = None  # mean p(1 − p) f per class: the (w_k, b_k) coupling
    if blocks:
        d, c = model.block_hessian(x0, stride=stride)
    else:
        d = model.diag_hessian(x0, stride=stride)
    if model.penalty is not None:
        d = d + model.penalty(x0, "diag")
    floor = 1e-12 * float(d.max().clamp_min(1e-30))
    if c is not None:
        k = model.k
        a, dd = d[:k].clamp_min(floor), d[k:].clamp_min(floor)
        l11 = a.sqrt()
        l21 = c / l11
        l22 = (dd - l21 * l21).clamp_min(1e-6 * dd).sqrt()
        m = -l21 / (l11 * l22)  # T = L⁻ᵀ = [[1/l11, m], [0, 1/l22]] per class

        def to_theta(u):
            return torch.cat([u[:k] / l11 + m * u[k:], u[k:] / l22])

        def to_u(theta):
            ub = theta[k:] * l22
            return torch.cat([(theta[:k] - m * ub) * l11, ub])

        def grad_u(g):
            return torch.cat([g[:k] / l11, m * g[:k] + g[k:] / l22])

        return to_theta, to_u, grad_u
    scale = d.clamp_min(floor).rsqrt()
    return (lambda u: u * scale), (lambda theta: theta / scale), (lambda g: g * scale)


def minimize(
    model, x0: torch.Tensor, solver: str = "auto", max_iter: int = 1000
) -> tuple[torch.Tensor, float, int, bool, str]:
    """Minimises ``model`` (a :class:`DiagModel` or :class:`FullModel`) from ``x0``: Newton when the
    Hessian is cheap (P ≤ 600 parameters and N·P² ≤ 2.5e9), else L-BFGS. Returns (θ, f, iters, converged,
    solver used)."""
    n, p = model.f.shape[0], len(x0)
    if solver == "auto":
        solver = "newton" if p <= NEWTON_MAX_PARAMS and n * p * p <= NEWTON_MAX_WORK else "lbfgs"
    out: tuple[torch.Tensor, float, int, bool]  # (θ, f, iters, converged)
    if solver == "newton":  # in float64: the Hessian is small, and Newton's end game needs the precision
        out = newton(model.to(torch.float64), x0.double(), max_iter=min(max_iter, 200))
    else:  # L-BFGS on θ = T u, T ≈ H^(-1/2) from the Hessian's (block) diagonal at x0 (8k rows suffice)
        to_theta, to_u, grad_u = _preconditioner(model, x0, stride=max(1, n // 8192))

        def scaled(u, order):
            value, grad, _ = model(to_theta(u), order)
            return value, (None if grad is None else grad_u(grad)), None

        u, value, n_iter, converged = lbfgs(scaled, to_u(x0), max_iter=max_iter)
        out = (to_theta(u), value, n_iter, converged)
    return (*out, solver)


class _Restricted:
    """``model`` with the entries of θ outside ``free`` (a boolean mask) held at 0: a function of θ[free]
    for :func:`minimize` (value, gradient and Hessian restricted to the free entries)."""

    def __init__(self, model, free: torch.Tensor):
        self.model, self.free = model, free
        self.penalty = None  # the model's own penalty is inside __call__ and diag_hessian

    @property
    def f(self):
        return self.model.f

    def to(self, dtype):
        self.model.to(dtype)
        return self

    def full(self, u):
        return u.new_zeros(self.free.shape).masked_scatter_(self.free, u)

    def __call__(self, u, order: int):
        value, grad, hess = self.model(self.full(u), order)
        grad = None if grad is None else grad[self.free]
        hess = None if hess is None else hess[self.free][:, self.free]
        return value, grad, hess

    def diag_hessian(self, u, stride: int = 1):
        theta = self.full(u)
        d = self.model.diag_hessian(theta, stride=stride)
        if self.model.penalty is not None:
            d = d + self.model.penalty(theta, "diag")
        return d[self.free]


def minimize_nonnegative(
    model, x0: torch.Tensor, bounded: torch.Tensor, solver: str = "auto", max_iter: int = 1000
) -> tuple[torch.Tensor, float, int, bool, str]:
    """Minimises ``model`` subject to θ_j ≥ 0 where ``bounded`` (a boolean mask) is set, from ``x0``,
    which must lie strictly inside that box (the box of L-BFGS-B in the references).

    The unconstrained optimum (:func:`minimize`) is returned as it is when it lies in the box. Otherwise an
    active set (Lawson and Hanson's, for a convex objective): from a point of the box, move towards the
    minimiser over the entries not held at 0, stopping at the first bound that would be crossed and holding
    that entry at 0; once the minimiser lies in the box, take it, and release the held entry whose gradient
    is most negative, if holding it costs more than the solver's own tolerance on the objective (g_j² / 2H_jj
    above 1e-12, Newton's stopping decrement, or L-BFGS's relative change); stop when none does (the KKT
    conditions). Each step lowers the objective, so no set of held entries recurs. Returns (θ, f, total
    iterations, converged, solver used), as :func:`minimize`."""
    theta, value, n_iter, converged, used = minimize(model, x0, solver, max_iter)
    if not bool((theta[bounded] < 0).any()):
        return theta, value, n_iter, converged, used
    x = x0.to(theta.dtype).clone()
    step_to = theta  # the minimiser over the free entries, from x
    held = torch.zeros_like(bounded)
    kkt = False
    for _ in range(4 * int(bounded.sum()) + 4):
        crossing = bounded & ~held & (step_to < 0)
        if bool(crossing.any()):  # step to the first bound crossed, and hold the entries that reach it
            ratio = torch.where(crossing, x / (x - step_to), torch.inf)
            alpha = ratio.min()
            x = torch.where(ratio <= alpha, 0.0, x + alpha * (step_to - x))
            x = torch.where(bounded, x.clamp(min=0), x)
            held |= ratio <= alpha
        else:
            x = step_to
            _, grad, _ = model(x, 1)
            curvature = model.diag_hessian(x).clamp_min(torch.finfo(x.dtype).tiny)
            if used == "newton":
                tol = 1e-12
            else:
                tol = (1e-11 if x.dtype == torch.float64 else 1e-7) * max(1.0, abs(value))
            gain = torch.where(held & (grad < 0), grad * grad / (2 * curvature), 0.0)
            if not bool((gain > tol).any()):
                kkt = True
                break
            held &= torch.arange(len(held), device=held.device) != gain.argmax()
        restricted = _Restricted(model, ~held)
        u, value, iters, sub_converged, _ = minimize(restricted, x[~held], used, max_iter)
        step_to = restricted.full(u.to(x.dtype))
        n_iter += iters
        converged = converged and sub_converged
    return x, float(model(x, 0)[0]), n_iter, converged and kkt, used


def warn_if_not_converged(name: str, converged: bool, n_iter: int, solver: str, hint: str = "", stacklevel=3):
    """The calibrators' one warning for a solve that stopped short: it names the iterations the solver ran
    (Newton stops at 200, whatever ``max_iter`` says). ``stacklevel`` counts from the caller of this
    function, as for ``warnings.warn``."""
    if not converged:
        more = f"; {hint}" if hint else ""
        warnings.warn(
            f"{name} did not converge (stopped after {n_iter} {solver} iterations{more})",
            stacklevel=stacklevel + 1,
        )
