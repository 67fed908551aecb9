"""Calibrators with a small neural network, trained by Adam on the input's device (SPEC §7): parameterized
temperature scaling (PTS, Tomani et al. 2022) and intra order-preserving calibration (IOP, Rahimi et al.
2020). Both keep the argmax. Training is seeded (``seed``): the same data, seed, device and dtype give the
same fit."""

from __future__ import annotations

import math

import torch

from .._namespace import only_public as _only_public
from .._validation import check_bool, check_float, check_positive_int
from .base import Calibrator

__all__ = ["IntraOrderPreserving", "ParameterizedTemperatureScaling", "iop_logits", "pts_temperature"]


def _mlp(x, weights, biases):
    """ReLU MLP: x @ W_1ᵀ + b_1, ReLU, …, the last layer linear."""
    for i, (w, b) in enumerate(zip(weights, biases)):
        x = torch.nn.functional.linear(x, w, b)
        if i < len(weights) - 1:
            x = torch.relu(x)
    return x


def _check_sizes(value, name: str) -> tuple[int, ...]:
    if isinstance(value, int | list | tuple) and not isinstance(value, bool):
        sizes = (value,) if isinstance(value, int) else tuple(value)
        if all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
            return sizes
    raise ValueError(f"`{name}` must be a sequence of positive layer widths, got {value!r}")


def _adam(loss_fn, params, n: int, batch_size: int, steps: int, lr: float, weight_decay: float, generator):
    """Minibatch Adam over row indices: ``steps`` updates on batches of ``batch_size`` rows drawn by epochs of
    a seeded permutation (the last, smaller batch of an epoch included); ``loss_fn(rows)`` is the batch loss.
    ``weight_decay`` is torch's coupled L2 (added to the gradient). Returns the last batch loss."""
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    device = params[0].device
    done, loss = 0, torch.tensor(float("nan"))
    while done < steps:
        perm = torch.randperm(n, generator=generator, device=device)
        for start in range(0, n, batch_size):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(perm[start : start + batch_size])
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return loss.detach()


def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------- PTS

#: PTS clips the logits to [−100, 100] for its network's input (the reference implementation).
PTS_LOGIT_CLIP = 100.0


def pts_temperature(logits, weights, biases, top_k: int) -> torch.Tensor:
    """PTS's per-sample temperature T(z) = |MLP(top-k of sort(clip(z, ±100), descending))|, clipped to
    [1e-12, 1e12]; (N,)."""
    z = logits.clamp(-PTS_LOGIT_CLIP, PTS_LOGIT_CLIP)
    top = torch.topk(z, top_k, dim=1, sorted=True).values
    return _mlp(top, weights, biases)[:, 0].abs().clamp(1e-12, 1e12)


def _pts_softmax(logits, temperature) -> torch.Tensor:
    """softmax(z / T) for logits (N, K) and per-sample temperatures (N,), as softmax((z − max z) / T): the
    shift does not change the result, and the scaled logits stay finite for any z and T."""
    shifted = logits - logits.amax(dim=1, keepdim=True)
    return torch.softmax(shifted / temperature[:, None], dim=1)


def _glorot(fan_in, fan_out, dtype, device, generator):
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(fan_out, fan_in, dtype=dtype, device=device, generator=generator) * 2 - 1) * bound


class ParameterizedTemperatureScaling(Calibrator):
    """Parameterized temperature scaling (PTS, Tomani, Cremers, Buettner 2022): softmax(z / T(z)) with a
    per-sample temperature T(z) = |MLP(t)| predicted from the ``top_k`` largest logits t (sorted,
    descending) by an MLP with ``hidden_sizes`` ReLU layers and one linear output; the network's input is
    clipped to [−100, 100] and T to [1e-12, 1e12] (:func:`pts_temperature`). The unclipped logits are
    divided by T, and T > 0, so the argmax is kept. The reference divides the clipped logits, which ties
    the classes whose logits exceed 100; where every |z| ≤ 100 both give the same probabilities.

    Training follows the reference implementation (tochris/pts-uncertainty, TensorFlow): the loss is the
    mean squared error between softmax(z / T) and the one-hot label, averaged over rows and classes (the
    Brier score / K), plus ``weight_decay`` · Σ ‖W‖² over the hidden layers' kernels; Glorot-uniform
    kernels and zero biases; Adam with learning rate ``lr`` on batches of ``batch_size`` rows for
    ``steps`` updates. The reference sets none of these by default; the defaults here (2 × 5 hidden units,
    top 10, lr 5e-5, batch 1000, 100,000 steps, no weight decay) are those of the PyTorch ports that
    attribute them to the paper (SPEC §7). With fewer than ``top_k`` classes all K logits are used.
    Fitting takes some 25 s on one CPU thread at the defaults (N = 5,000, K = 10; docs/decisions.md,
    decision 173).

    The fitted network is ``weights_`` and ``biases_`` (lists of tensors, torch's ``(out, in)`` layout).

    References:
        C. Tomani, D. Cremers, F. Buettner, "Parameterized temperature scaling for boosting the expressive
        power in post-hoc uncertainty calibration", ECCV 2022, arXiv:2102.12182.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import ParameterizedTemperatureScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 2 * torch.randn(2000, 10, generator=g)
        >>> y = torch.multinomial(torch.softmax(z / 2, 1), 1, generator=g)[:, 0]
        >>> pts = ParameterizedTemperatureScaling(steps=500, lr=1e-2).fit(z, y)
        >>> t = pts.temperature(z)
        >>> bool((t > 1).float().mean() > 0.9)  # the logits are twice too sharp
        True
        >>> torch.equal(pts.predict_proba(z).argmax(1), z.argmax(1))
        True
    """

    name = "pts"
    fitted_attributes = ("weights_", "biases_", "top_k_", "loss_")

    def __init__(
        self,
        hidden_sizes: tuple[int, ...] = (5, 5),
        top_k: int = 10,
        lr: float = 5e-5,
        batch_size: int = 1000,
        steps: int = 100_000,
        weight_decay: float = 0.0,
        seed: int = 0,
    ):
        self.hidden_sizes = hidden_sizes
        self.top_k = top_k
        self.lr = lr
        self.batch_size = batch_size
        self.steps = steps
        self.weight_decay = weight_decay
        self.seed = seed

    def check_params(self) -> ParameterizedTemperatureScaling:
        _check_sizes(self.hidden_sizes, "hidden_sizes")
        check_positive_int(self.top_k, "top_k")
        check_float(self.lr, "lr", low=0.0, low_open=True)
        check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.steps, "steps")
        check_float(self.weight_decay, "weight_decay", low=0.0)
        check_positive_int(self.seed, "seed", minimum=0)
        return self

    def _fit(self, logits, targets):
        sizes = _check_sizes(self.hidden_sizes, "hidden_sizes")
        top_k = min(check_positive_int(self.top_k, "top_k"), logits.shape[1])
        lr = check_float(self.lr, "lr", low=0.0, low_open=True)
        batch_size = check_positive_int(self.batch_size, "batch_size")
        steps = check_positive_int(self.steps, "steps")
        decay = check_float(self.weight_decay, "weight_decay", low=0.0)
        seed = check_positive_int(self.seed, "seed", minimum=0)
        z = logits.detach()
        dtype, device = z.dtype, z.device
        g = _generator(seed, device)
        widths = (top_k, *sizes, 1)
        weights = [_glorot(a, b, dtype, device, g).requires_grad_() for a, b in zip(widths[:-1], widths[1:])]
        biases = [torch.zeros(b, dtype=dtype, device=device, requires_grad=True) for b in widths[1:]]
        # the network's input (clipped) and the row-max-shifted logits of _pts_softmax, both fixed
        top = torch.topk(z.clamp(-PTS_LOGIT_CLIP, PTS_LOGIT_CLIP), top_k, dim=1, sorted=True).values
        shifted = z - z.amax(dim=1, keepdim=True)
        onehot = torch.nn.functional.one_hot(targets, z.shape[1]).to(dtype)

        def loss_fn(rows):
            t = _mlp(top[rows], weights, biases)[:, 0].abs().clamp(1e-12, 1e12)
            p = torch.softmax(shifted[rows] / t[:, None], dim=1)
            loss = (p - onehot[rows]).square().mean()
            if decay:
                loss = loss + decay * sum(w.square().sum() for w in weights[:-1])
            return loss

        loss = _adam(loss_fn, weights + biases, z.shape[0], batch_size, steps, lr, 0.0, g)
        self.weights_ = [w.detach() for w in weights]
        self.biases_ = [b.detach() for b in biases]
        self.top_k_ = top_k
        self.loss_ = float(loss)

    def _network(self, device, dtype):
        return [w.to(device, dtype) for w in self.weights_], [b.to(device, dtype) for b in self.biases_]

    def _transform(self, logits):
        weights, biases = self._network(logits.device, logits.dtype)
        t = pts_temperature(logits, weights, biases, self.top_k_)
        return _pts_softmax(logits, t)

    def temperature(self, logits) -> torch.Tensor:
        """The per-sample temperatures T(z), (N,), for ``logits`` (N, K)."""
        self._check_fitted()
        with torch.no_grad():
            logits = self._check_input(logits)
            weights, biases = self._network(logits.device, logits.dtype)
            return pts_temperature(logits, weights, biases, self.top_k_)


# ----------------------------------------------------------------------------- IOP

#: IOP's input: log-probabilities clipped below at ln(1e-15), as the reference takes ln clip(p, 1e-15, 1).
IOP_LOG_FLOOR = math.log(1e-15)


def iop_logits(log_probs, weights, biases, invariant: bool = True) -> torch.Tensor:
    """The intra order-preserving map of Rahimi et al. (2020) on x = ``log_probs`` (N, K): with s = sort(x,
    descending), the gaps g_j = s_j − s_{j+1} and m = MLP(s) (or MLP(x) when ``invariant`` is False), the
    calibrated logit of rank r (r = 0 the top) is Σ_{j=r}^{K−2} softplus(m_{K−1−j}) · g_j, so the smallest is
    0, every other is a positive combination of the gaps above it, and the order (ties included) is kept.
    The logits are returned at the classes' original positions."""
    s, order = torch.sort(log_probs, dim=1, descending=True, stable=True)
    m = _mlp(s if invariant else log_probs, weights, biases)
    gaps = s[:, :-1] - s[:, 1:]  # (N, K − 1), g_0 = s_0 − s_1 first
    # the reference's u = flip([g, 1]) and m_0 = 0: entry j of flip(u) pairs g_j with softplus(m_{K−1−j})
    terms = gaps * torch.nn.functional.softplus(m[:, 1:]).flip(1)
    ranked = torch.cat([terms.flip(1).cumsum(1).flip(1), torch.zeros_like(s[:, :1])], 1)
    return torch.empty_like(ranked).scatter_(1, order, ranked)


def _torch_linear_init(fan_in, fan_out, dtype, device, generator):
    """torch.nn.Linear's default initialisation (kaiming-uniform with a = √5 for the weight, which is
    U(±1/√fan_in), and U(±1/√fan_in) for the bias), drawn from ``generator``."""
    bound = 1.0 / math.sqrt(fan_in)
    w = (torch.rand(fan_out, fan_in, dtype=dtype, device=device, generator=generator) * 2 - 1) * bound
    b = (torch.rand(fan_out, dtype=dtype, device=device, generator=generator) * 2 - 1) * bound
    return w, b


def _iop_train(x, targets, layers, invariant, lr, weight_decay, batch, epochs, generator):
    """Train IOP's network as ``torch.optim.Adam`` on the autograd graph of :func:`iop_logits` and mean
    cross entropy would (decision 214), on log-probabilities ``x`` (N, K) from the initial ``layers`` [(W,
    b), …]: ``epochs`` epochs of a seeded permutation cut into batches of ``batch`` rows, torch's coupled L2
    and its single-tensor Adam update, element for element, on one flat buffer of all the weights and
    biases. The forward and backward passes are written out, into buffers allocated once. Each row is
    sorted once, not at every step. The calibrated logits are built in ascending order, where they are a
    plain cumulative sum [0, c_1, …, c_(K−1)] with c_l = Σ_(i≤l) softplus(m_i) · (a_i − a_(i−1)) over the
    ascending a, and cross entropy takes the label's ascending rank (it does not depend on the order of the
    classes; among tied entries the logits are equal, so any of the tied ranks gives the same loss and
    gradient). The gradient of that sum, the suffix sums of p − onehot, is computed as −cumsum(p −
    onehot), equal because a row of p − onehot sums to 0. Returns the weights, the biases and the last
    batch's loss."""
    n, k = x.shape
    dtype, device = x.dtype, x.device
    # the rows sorted ascending, a = flip(sort(x, descending)); the network reads them through its first
    # kernel with the columns reversed (the same products as on the descending s, summed in another order)
    ascending = torch.sort(x, dim=1, descending=True, stable=True).values.flip(1)
    if invariant:
        layers = [(layers[0][0].flip(1), layers[0][1]), *layers[1:]]
    # a first layer that is not the last is kept as its transpose (in, out): with few inputs (K = 10) the
    # product for its gradient, inputsᵀ · d, is several times faster into that layout
    first_t = len(layers) > 1
    if first_t:
        layers = [(layers[0][0].t().contiguous(), layers[0][1]), *layers[1:]]
    # the label's ascending rank: K − 1 minus the number of classes above it
    target_up = (k - 1) - (x > x.gather(1, targets[:, None])).sum(1)
    # the parameters (and their gradients and moments) as views of flat buffers, layer by layer (w, b)
    shapes = [t.shape for layer in layers for t in layer]
    flat = torch.cat([t.reshape(-1) for layer in layers for t in layer])
    grad = torch.zeros_like(flat)

    def views(buffer):
        out, at = [], 0
        for shape in shapes:
            size = math.prod(shape)
            out.append(buffer[at : at + size].view(shape))
            at += size
        return out[0::2], out[1::2]

    weights, biases = views(flat)
    grad_w, grad_b = views(grad)
    # m_0 of the network is unused (the reference sets it to 0): the last layer's row 0 gets no gradient
    last_w, last_b, last_gw, last_gb = weights[-1][1:], biases[-1][1:], grad_w[-1][1:], grad_b[-1][1:]
    exp_avg, exp_avg_sq, work = torch.zeros_like(flat), torch.zeros_like(flat), torch.empty_like(flat)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    # per-batch buffers (allocating them at every step costs more than the arithmetic at K = 1000)
    acts_buf = [torch.empty(batch, k, dtype=dtype, device=device)]
    acts_buf += [torch.empty(batch, len(bias), dtype=dtype, device=device) for bias in biases[:-1]]
    back_buf = [torch.empty(batch, len(bias), dtype=dtype, device=device) for bias in biases[:-1]]
    asc_buf = acts_buf[0] if invariant else torch.empty(batch, k, dtype=dtype, device=device)
    gaps_buf, m_buf, d_buf, sig_buf, sp_buf = (
        torch.empty(batch, k - 1, dtype=dtype, device=device) for _ in "12345"
    )
    terms_buf = torch.zeros(batch, k, dtype=dtype, device=device)  # column 0 stays 0
    o_buf, p_buf = (torch.empty(batch, k, dtype=dtype, device=device) for _ in "12")
    label_buf = torch.empty(batch, dtype=target_up.dtype, device=device)
    rows_all, minus_one = torch.arange(batch, device=device), torch.tensor(-1.0, dtype=dtype, device=device)
    softplus = torch.ops.aten.softplus.out
    relu_backward = torch.ops.aten.threshold_backward.grad_input
    step, loss = 0, torch.tensor(float("nan"))
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=generator, device=device)
        for start in range(0, n, batch):
            rows = perm[start : start + batch]
            b = min(batch, n - start)
            asc = torch.index_select(ascending, 0, rows, out=asc_buf[:b])
            acts = [asc if invariant else torch.index_select(x, 0, rows, out=acts_buf[0][:b])]
            # column l − 1: the gap a_l − a_(l−1), l = 1 … K − 1
            gaps = torch.sub(asc[:, 1:], asc[:, :-1], out=gaps_buf[:b])
            label = torch.index_select(target_up, 0, rows, out=label_buf[:b])
            for i, (w, bias, buf) in enumerate(zip(weights[:-1], biases[:-1], acts_buf[1:])):
                acts.append(torch.addmm(bias, acts[-1], w if i == 0 else w.t(), out=buf[:b]).clamp_min_(0))
            m = torch.addmm(last_b, acts[-1], last_w.t(), out=m_buf[:b])
            # (softplus into a contiguous buffer: into the strided columns it takes a slower loop)
            torch.mul(softplus(m, 1, 20, out=sp_buf[:b]), gaps, out=terms_buf[:b, 1:])
            o = torch.cumsum(terms_buf[:b], 1, out=o_buf[:b])
            if epoch == epochs - 1 and start + batch >= n:
                loss = torch.nn.functional.cross_entropy(o, label)
            # softmax: o is non-decreasing along the row (a cumulative sum of terms >= 0), so its maximum is
            # the last column; exp(o − max) / Σ as torch's softmax computes it, without the search for the max
            p = torch.sub(o, o[:, -1:], out=p_buf[:b]).exp_()
            p.div_(p.sum(1, keepdim=True))
            p.index_put_((rows_all[:b], label), minus_one, accumulate=True)
            # d loss / d m_l = −(1/b) Σ_(i<l) (p − onehot)_i · gap_l · softplus'(m_l), l = 1 … K − 1
            d = torch.cumsum(p[:, :-1], 1, out=d_buf[:b])
            d.mul_(torch.sigmoid(m, out=sig_buf[:b]).mul_(gaps)).mul_(-1.0 / b)
            torch.mm(d.t(), acts[-1], out=last_gw)
            torch.sum(d, 0, out=last_gb)
            w_above = last_w
            for i in range(len(weights) - 2, -1, -1):
                d = torch.mm(d, w_above, out=back_buf[i][:b])
                d = relu_backward(d, acts[i + 1], 0, grad_input=d)
                if i == 0:
                    torch.mm(acts[0].t(), d, out=grad_w[0])
                else:
                    torch.mm(d.t(), acts[i], out=grad_w[i])
                torch.sum(d, 0, out=grad_b[i])
                w_above = weights[i]
            # torch.optim.Adam's single-tensor update (coupled L2), on the flat buffers
            step += 1
            g = torch.add(grad, flat, alpha=weight_decay, out=work) if weight_decay != 0 else grad
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size = lr / (1 - beta1**step)
            denom = torch.sqrt(exp_avg_sq, out=work).div_((1 - beta2**step) ** 0.5).add_(eps)
            flat.addcdiv_(exp_avg, denom, value=-step_size)
    weights = [w.clone() for w in weights]
    if first_t:
        weights[0] = weights[0].t().contiguous()
    if invariant:
        weights[0] = weights[0].flip(1)
    return weights, [bias.clone() for bias in biases], float(loss)


class IntraOrderPreserving(Calibrator):
    """Intra order-preserving calibration (IOP, Rahimi et al. 2020), the order-invariant variant: calibrated
    logits o = :func:`iop_logits` of x = ln max(softmax(z), 1e-15), where an MLP of the sorted x
    (``hidden_sizes`` ReLU layers, K outputs) sets positive weights on the gaps between consecutive sorted
    log-probabilities. Output softmax(o); the order of the classes is kept, so the argmax is too.
    ``invariant=False`` feeds the MLP the unsorted x (the paper's order-preserving, not order-invariant,
    variant; the map is then not permutation-equivariant). The "diagonal" variant of the paper is an
    element-wise monotone map; it is not implemented here.

    Training follows the reference (AmirooR/IntraOrderPreservingCalibration, as probmetrics ports it): mean
    cross-entropy, Adam with learning rate ``lr`` and torch's L2 ``weight_decay``, batches of
    ``batch_size`` rows (all rows when N ≤ ``batch_size``), shuffled every epoch, ``epochs`` epochs, torch's
    default ``nn.Linear`` initialisation; with ``seed`` for the initialisation and the shuffling (the
    reference is unseeded). The training step is written out rather than taped by autograd (each row
    sorted once, the gradient formed by hand, Adam on one flat buffer; docs/decisions.md, decision 214):
    it computes what autograd and ``torch.optim.Adam`` compute, in another order of the same arithmetic.

    The fitted network is ``weights_`` and ``biases_`` (lists of tensors, torch's ``(out, in)`` layout).

    References:
        A. Rahimi, A. Shaban, C.-A. Cheng, R. Hartley, B. Boots, "Intra order-preserving functions for
        calibration of multi-class neural networks", NeurIPS 2020.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import IntraOrderPreserving
        >>> g = torch.Generator().manual_seed(0)
        >>> z = 3 * torch.randn(2000, 5, generator=g)
        >>> y = torch.multinomial(torch.softmax(z / 3, 1), 1, generator=g)[:, 0]
        >>> iop = IntraOrderPreserving(epochs=10).fit(z, y)
        >>> probs = iop.predict_proba(z)
        >>> torch.equal(probs.argmax(1), z.argmax(1))
        True
        >>> bool(probs.max(1).values.mean() < torch.softmax(z, 1).max(1).values.mean())  # less confident
        True
    """

    name = "iop"
    fitted_attributes = ("weights_", "biases_", "loss_")

    def __init__(
        self,
        hidden_sizes: tuple[int, ...] = (150, 150),
        invariant: bool = True,
        lr: float = 5e-3,
        weight_decay: float = 5e-4,
        batch_size: int = 256,
        epochs: int = 40,
        seed: int = 0,
    ):
        self.hidden_sizes = hidden_sizes
        self.invariant = invariant
        self.lr = lr
        self.weight_decay = weight_decay
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed

    @staticmethod
    def _features(logits):
        return torch.log_softmax(logits, dim=1).clamp_min(IOP_LOG_FLOOR)

    def check_params(self) -> IntraOrderPreserving:
        _check_sizes(self.hidden_sizes, "hidden_sizes")
        check_bool(self.invariant, "invariant")
        check_float(self.lr, "lr", low=0.0, low_open=True)
        check_float(self.weight_decay, "weight_decay", low=0.0)
        check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.epochs, "epochs")
        check_positive_int(self.seed, "seed", minimum=0)
        return self

    def _fit(self, logits, targets):
        sizes = _check_sizes(self.hidden_sizes, "hidden_sizes")
        check_bool(self.invariant, "invariant")
        lr = check_float(self.lr, "lr", low=0.0, low_open=True)
        decay = check_float(self.weight_decay, "weight_decay", low=0.0)
        batch_size = check_positive_int(self.batch_size, "batch_size")
        epochs = check_positive_int(self.epochs, "epochs")
        seed = check_positive_int(self.seed, "seed", minimum=0)
        x = self._features(logits.detach())
        n, k = x.shape
        g = _generator(seed, x.device)
        widths = (k, *sizes, k)
        layers = [_torch_linear_init(a, b, x.dtype, x.device, g) for a, b in zip(widths[:-1], widths[1:])]
        weights, biases, loss = _iop_train(
            x, targets, layers, self.invariant, lr, decay, min(batch_size, n), epochs, g
        )
        self.weights_ = weights
        self.biases_ = biases
        self.loss_ = float(loss)

    def transform_logits(self, logits) -> torch.Tensor:
        """The calibrated logits o (N, K) (the smallest of each row is 0)."""
        self._check_fitted()
        with torch.no_grad():
            return self._logits(self._check_input(logits))

    def _logits(self, logits):
        weights = [w.to(logits.device, logits.dtype) for w in self.weights_]
        biases = [b.to(logits.device, logits.dtype) for b in self.biases_]
        return iop_logits(self._features(logits), weights, biases, self.invariant)

    def _transform(self, logits):
        return torch.softmax(self._logits(logits), dim=1)


_only_public(__name__)
