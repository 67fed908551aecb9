"""The calibrator contract (scikit-learn estimator conventions) shared by every post-hoc calibrator."""

from __future__ import annotations

import inspect
import json
import math
from typing import Any, ClassVar

import torch

from .._validation import as_data, check_logits, check_targets

__all__ = ["Calibrator", "NotFittedError"]


_LOGITS_ADVICE = "calibrators take logits (for probabilities pass torch.log(probs))"


class NotFittedError(RuntimeError):
    """Raised when ``transform`` is called before ``fit``."""


# JSON has no NaN or infinities: a non-finite float is written as one of these strings (the tokens Python's
# json module would emit, which strict parsers reject), in a tensor's nested lists or as {"__float__": name}
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_name(x: float) -> str | float:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _encode(value):
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        items = data.tolist()
        if data.is_floating_point() and not bool(torch.isfinite(data).all()):
            items = _map_nested(items, _float_name)
        return {"__tensor__": items, "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": _float_name(value)}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _map_nested(items, fn):
    """``fn`` applied to every number of a nested list (a tensor's ``tolist()``), or to a scalar."""
    if isinstance(items, list):
        return [_map_nested(v, fn) for v in items]
    return fn(items)


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        items = _map_nested(value["__tensor__"], lambda v: _NONFINITE[v] if isinstance(v, str) else v)
        return torch.tensor(items, dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return _NONFINITE[value["__float__"]]
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


class Calibrator:
    """Base class: ``fit(logits, targets) -> self``, ``transform(logits) -> probs``, ``fit_transform``.

    ``__init__`` only stores its arguments (``get_params`` reads them back); everything learned by ``fit``
    is an attribute ending in ``_`` and is listed in ``fitted_attributes`` (always set by ``fit``) or in
    ``optional_fitted_attributes`` (records that only some settings produce, such as the grid record
    ``search_``). ``num_classes_`` is always set, and a fitted calibrator refuses logits with another number
    of classes. ``state_dict()`` holds only tensors and plain Python values (loadable with
    ``torch.load(weights_only=True)``) and ``to_json()`` gives the same state as strict JSON text
    (non-finite numbers written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``).

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
    optional_fitted_attributes: ClassVar[tuple[str, ...]] = ()

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

    def check_params(self) -> Calibrator:
        """Checks the constructor arguments as ``fit`` does, without data (``__init__`` only stores them, as
        scikit-learn's contract asks): a ``ValueError`` names the first value ``fit`` would refuse. Returns
        self. :func:`~torchcal.calibrators.from_spec` calls it, so a spec's wrong argument fails when the spec
        is read, before anything is fitted."""
        return self

    # -- fitting -------------------------------------------------------------------------------------

    @property
    def is_fitted(self) -> bool:
        return hasattr(self, "num_classes_")

    def _clear_fitted(self) -> None:
        """Removes every fitted value (``num_classes_`` and the fitted attributes, optional ones included)."""
        for attr in ("num_classes_", *self.fitted_attributes, *self.optional_fitted_attributes):
            self.__dict__.pop(attr, None)

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
        self._clear_fitted()  # a refit starts from scratch
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
            fitted.update({a: getattr(self, a) for a in self.optional_fitted_attributes if hasattr(self, a)})
            fitted = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in fitted.items()}
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.get_params().items()}
        return {"name": self.name, "params": params, "fitted": fitted}

    def load_state_dict(self, state: dict[str, Any]) -> Calibrator:
        """Restores parameters and fitted values saved by :meth:`state_dict`; returns self. The fitted
        values held before are dropped first, so an unfitted state gives an unfitted calibrator."""
        if not isinstance(state, dict) or {"name", "params", "fitted"} - set(state):
            raise ValueError(
                "`state` must be a dict with keys 'name', 'params' and 'fitted' (from state_dict())"
            )
        if state["name"] != self.name:
            raise ValueError(f"`state` belongs to calibrator {state['name']!r}, not {self.name!r}")
        missing = set(self.fitted_attributes) - set(state["fitted"])
        if state["fitted"] and ("num_classes_" not in state["fitted"] or missing):
            raise ValueError(f"`state` lacks fitted values {sorted(missing | {'num_classes_'})}")
        self._clear_fitted()
        for k, v in state["params"].items():
            setattr(self, k, v)
        for k, v in state["fitted"].items():
            setattr(self, k, v)
        return self

    def to_json(self) -> str:
        """The state as a strict JSON string (tensors as nested lists with their dtype; NaN and infinities as
        the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, restored by :meth:`from_json`)."""
        return json.dumps(_encode(self.state_dict()), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Calibrator:
        """Rebuilds a calibrator from :meth:`to_json` output."""
        state = _decode(json.loads(text))
        params = state.get("params", {}) if isinstance(state, dict) else {}
        obj = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()})
        return obj.load_state_dict(state)
