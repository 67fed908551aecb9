"""The calibrator contract (scikit-learn estimator conventions) shared by every post-hoc calibrator."""

from __future__ import annotations

import inspect
import json
from typing import Any, ClassVar

import torch

from .._validation import as_data, check_logits, check_targets

__all__ = ["Calibrator", "NotFittedError"]


_LOGITS_ADVICE = "calibrators take logits (for probabilities pass torch.log(probs))"


class NotFittedError(RuntimeError):
    """Raised when ``transform`` is called before ``fit``."""


def _encode(value):
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


class Calibrator:
    """Base class: ``fit(logits, targets) -> self``, ``transform(logits) -> probs``, ``fit_transform``.

    ``__init__`` only stores its arguments (``get_params`` reads them back); everything learned by ``fit``
    is an attribute ending in ``_`` and is listed in ``fitted_attributes``. ``num_classes_`` is always set,
    and a fitted calibrator refuses logits with another number of classes. ``state_dict()`` holds only
    tensors and plain Python values (loadable with ``torch.load(weights_only=True)``) and ``to_json()``
    gives the same state as text.

    Subclasses implement ``_fit(logits, targets)`` and ``_transform(logits)``; both receive validated
    tensors (float32 or float64, on any device).

    Calibrators follow scikit-learn's estimator protocol (``get_params``, ``set_params``, ``clone``,
    ``predict_proba``):

    Example:
        >>> import torch
        >>> from sklearn.base import clone
        >>> from torchcal.calibrators import TemperatureScaling
        >>> g = torch.Generator().manual_seed(0)
        >>> logits, targets = 3 * torch.randn(500, 4, generator=g), torch.randint(0, 4, (500,), generator=g)
        >>> ts = TemperatureScaling().set_params(objective="ece").fit(logits, targets)
        >>> ts.temperature_ >= 1.0, clone(ts).is_fitted, clone(ts).objective
        (True, False, 'ece')
        >>> torch.equal(ts.predict_proba(logits), ts.transform(logits))
        True
    """

    name: ClassVar[str] = ""
    fitted_attributes: ClassVar[tuple[str, ...]] = ()

    # -- parameters ----------------------------------------------------------------------------------

    @classmethod
    def _param_names(cls) -> list[str]:
        params = inspect.signature(cls.__init__).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return [p.name for p in params if p.name != "self" and p.kind in kinds]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Constructor arguments, read back from attributes of the same name (scikit-learn's estimator
        protocol; calibrators hold no nested estimators, so ``deep`` changes nothing)."""
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params) -> Calibrator:
        """Sets constructor arguments by name (scikit-learn's protocol); unknown names raise ``ValueError``.
        A fitted calibrator keeps its fitted values until the next ``fit``. Returns self."""
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(
                    f"{type(self).__name__} has no parameter {name!r}; valid parameters: {valid}"
                )
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -- fitting -------------------------------------------------------------------------------------

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "num_classes_")

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise NotFittedError(
                f"this {type(self).__name__} is not fitted yet: call fit(logits, targets) first"
            )

    def _check_input(self, logits) -> torch.Tensor:
        logits = check_logits(as_data(logits, "logits"), "logits", warn_if_probs=_LOGITS_ADVICE)
        if logits.shape[1] != self.num_classes_:
            raise ValueError(
                f"`logits` has {logits.shape[1]} classes but this {type(self).__name__} was fitted on "
                f"{self.num_classes_}"
            )
        return logits

    def fit(self, logits, targets) -> Calibrator:
        """Learns the calibration map from validation ``logits`` (N, K) and integer ``targets`` (N,).

        Inputs are data: a tensor that carries gradients is detached, and fitting works the same inside
        ``torch.no_grad()`` or ``torch.inference_mode()`` (the optimisers that need autograd enable it on
        private copies)."""
        logits = check_logits(as_data(logits, "logits"), "logits", warn_if_probs=_LOGITS_ADVICE)
        targets = check_targets(targets, logits.shape[0], logits.shape[1]).to(logits.device)
        for attr in self.fitted_attributes:  # a refit starts from scratch
            self.__dict__.pop(attr, None)
        self.__dict__.pop("num_classes_", None)
        with torch.inference_mode(False), torch.enable_grad():
            if logits.is_inference():  # inference tensors cannot be saved for backward: use normal copies
                logits, targets = logits.clone(), targets.clone()
            self._fit(logits, targets)
        self.num_classes_ = int(logits.shape[1])
        return self

    def transform(self, logits) -> torch.Tensor:
        """Calibrated probabilities (N, K) for ``logits`` (N, K); rows sum to one. The result carries no
        gradient (the input is treated as data)."""
        self._check_fitted()
        with torch.no_grad():
            return self._transform(self._check_input(logits))

    def predict_proba(self, logits) -> torch.Tensor:
        """Alias of :meth:`transform` (scikit-learn's name for calibrated class probabilities)."""
        return self.transform(logits)

    def fit_transform(self, logits, targets) -> torch.Tensor:
        return self.fit(logits, targets).transform(logits)

    def _fit(self, logits: torch.Tensor, targets: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError  # abstract

    def _transform(self, logits: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError  # abstract

    # -- persistence ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Name, constructor arguments and fitted values (tensors and plain Python values only)."""
        fitted = {}
        if self.is_fitted:
            fitted = {a: getattr(self, a) for a in ("num_classes_", *self.fitted_attributes)}
            fitted = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in fitted.items()}
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.get_params().items()}
        return {"name": self.name, "params": params, "fitted": fitted}

    def load_state_dict(self, state: dict[str, Any]) -> Calibrator:
        """Restores parameters and fitted values saved by :meth:`state_dict`; returns self."""
        if not isinstance(state, dict) or {"name", "params", "fitted"} - set(state):
            raise ValueError(
                "`state` must be a dict with keys 'name', 'params' and 'fitted' (from state_dict())"
            )
        if state["name"] != self.name:
            raise ValueError(f"`state` belongs to calibrator {state['name']!r}, not {self.name!r}")
        for k, v in state["params"].items():
            setattr(self, k, v)
        missing = set(self.fitted_attributes) - set(state["fitted"])
        if state["fitted"] and ("num_classes_" not in state["fitted"] or missing):
            raise ValueError(f"`state` lacks fitted values {sorted(missing | {'num_classes_'})}")
        for k, v in state["fitted"].items():
            setattr(self, k, v)
        return self

    def to_json(self) -> str:
        """The state as a JSON string (tensors as nested lists with their dtype)."""
        return json.dumps(_encode(self.state_dict()))

    @classmethod
    def from_json(cls, text: str) -> Calibrator:
        """Rebuilds a calibrator from :meth:`to_json` output."""
        state = _decode(json.loads(text))
        params = state.get("params", {}) if isinstance(state, dict) else {}
        obj = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()})
        return obj.load_state_dict(state)
