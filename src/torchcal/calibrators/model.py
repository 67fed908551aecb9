"""A model and its fitted calibrator as one ``nn.Module`` (PyTorch's counterpart of scikit-learn's
``CalibratedClassifierCV`` with a prefit model)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._namespace import only_public as _only_public
from .._validation import check_choice, check_positive_int
from .base import Calibrator

__all__ = ["CalibratedModel"]


class CalibratedModel(nn.Module):
    """``model`` followed by ``calibrator``: returns calibrated probabilities (``output="probs"``) or
    calibrated logits (``output="logits"``: ln of the calibrated probabilities, floored at ln of the dtype's
    tiny, so softmax gives the probabilities back).

    The calibrator's state (its name, arguments and fitted values) is part of the module's ``state_dict``
    (as extra state), so ``torch.save(m.state_dict())`` / ``load_state_dict`` move model and calibration
    together, and ``torch.load(..., weights_only=True)`` reads it. ``forward`` checks the logits' shape and
    dtype only (no finiteness check, which needs a host sync), so the module traces: ``torch.export.export``
    works for the parametric calibrators (temperature and vector/matrix scaling, SVS, SMS, BCTS, NBVS,
    Dirichlet, beta, ...). float16 and bfloat16 logits are calibrated in float32, as
    ``calibrator.transform`` does, and the output is float32.

    Args:
        model: any module returning logits (N, K).
        calibrator: a fitted calibrator, or an unfitted one to fit with :meth:`fit`.
        output: ``"probs"`` or ``"logits"``.

    Example:
        >>> import torch
        >>> from torchcal.calibrators import CalibratedModel, TemperatureScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> net = torch.nn.Linear(4, 3)
        >>> x = torch.randn(600, 4, generator=g)
        >>> y = torch.multinomial(torch.softmax(net(x).detach() / 2, 1), 1, generator=g)[:, 0]  # T = 2
        >>> cm = CalibratedModel(net, TemperatureScaling()).fit(x, y)
        >>> 1.0 < cm.calibrator.temperature_ < 4.0
        True
        >>> probs = cm(x[:5])
        >>> probs.shape, bool(torch.allclose(probs.sum(1), torch.ones(5)))
        (torch.Size([5, 3]), True)
        >>> again = CalibratedModel(torch.nn.Linear(4, 3), TemperatureScaling())
        >>> _ = again.load_state_dict(cm.state_dict())
        >>> bool(torch.equal(again(x[:5]), probs))
        True
    """

    def __init__(self, model: nn.Module, calibrator: Calibrator, output: str = "probs"):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(calibrator, Calibrator):
            raise TypeError(f"`calibrator` must be a torchcal Calibrator, got {type(calibrator).__name__}")
        self.model = model
        self.calibrator = calibrator
        self.output = check_choice(output, "output", ("probs", "logits"))

    @torch.no_grad()
    def fit(self, inputs, targets, batch_size: int | None = None) -> CalibratedModel:
        """Fits the calibrator on the model's logits for validation ``inputs`` (a tensor, run in batches of
        ``batch_size`` rows, or an iterable of input batches) and ``targets``; the model is put in eval mode
        and left there. Returns self."""
        if batch_size is not None:
            batch_size = check_positive_int(batch_size, "batch_size")
        self.model.eval()
        if isinstance(inputs, torch.Tensor):
            step = batch_size or max(1, len(inputs))
            batches = (inputs[i : i + step] for i in range(0, len(inputs), step))
        else:
            batches = iter(inputs)
        logits = torch.cat([self.model(b) for b in batches])
        self.calibrator.fit(logits, targets)
        return self

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self.calibrator._check_fitted()
        logits = self.model(*args, **kwargs)
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise TypeError(f"`model` must return floating logits (N, K), got {_describe(logits)}")
        k = self.calibrator.num_classes_
        if logits.ndim != 2 or logits.shape[1] != k:
            raise ValueError(
                f"`model` returned logits of shape {tuple(logits.shape)}, but the calibrator was fitted on "
                f"(N, {k})"
            )
        if logits.dtype in (torch.float16, torch.bfloat16):  # computed in float32, as transform does
            logits = logits.float()
        probs = self.calibrator._transform(logits)
        if self.output == "probs":
            return probs
        return torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))

    def get_extra_state(self) -> dict[str, Any]:
        return self.calibrator.state_dict()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.calibrator.load_state_dict(state)

    def extra_repr(self) -> str:
        return f"output={self.output!r}, calibrator={self.calibrator!r}"


def _describe(x) -> str:
    return f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


_only_public(__name__)
