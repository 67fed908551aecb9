"""Optional C++ operator for the fused focal-family losses on CPU (``csrc/fused_losses.cpp``).

The numba path (:mod:`._kernels`) already fuses the per-sample arithmetic, but it runs inside a Python
``torch.autograd.Function``: at batch sizes of a few hundred, that round trip through Python costs as much as
PyTorch's whole fused cross entropy. The C++ operator ``torch.ops.torchcal.fused_true_class`` computes the
same losses (same conventions, per-sample float64 arithmetic; the dual loss's ties decided on the logits, see
docs/decisions.md 38) with a C++ autograd node, so forward and backward never re-enter Python.

It is compiled on request with ``torch.utils.cpp_extension`` (GCC or Clang and ninja are needed; ~20-30 s,
once per torch and Python version) by :func:`build_cpu_extension` or ``torchcal build-extension``, and cached
under ``$TORCHCAL_EXTENSION_DIR`` (default: torch's extension root, ``~/.cache/torch_extensions``). Once built,
every process picks it up without compiling. ``TORCHCAL_CPP=0`` or :func:`use_cpu_extension` turns it off;
:func:`~torchcal.functional.use_cpu_kernels` (False) turns off both it and numba.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from . import _kernels

__all__ = ["build_cpu_extension", "cpu_extension_available", "use_cpu_extension"]

SOURCE = Path(__file__).with_name("csrc") / "fused_losses.cpp"
HEADERS = (SOURCE.with_name("true_class.h"),)
REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}
CFLAGS = ["-O3", "-fopenmp-simd"]

_state = {"enabled": _kernels.env_enabled("TORCHCAL_CPP"), "loaded": None}
_lock = threading.Lock()


def extension_name() -> str:
    """Name of the library for this source, torch build and Python version (a rebuild follows any change)."""
    key = "|".join(
        (
            *(path.read_text(encoding="utf-8") for path in (SOURCE, *HEADERS)),
            " ".join(CFLAGS),
            torch.__version__,
            str(torch.version.cuda),
            str(torch.version.hip),
        )
    )
    key += f"|{sys.version_info.major}.{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return "torchcal_fused_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_directory() -> Path:
    """Where the library is built and looked for: ``$TORCHCAL_EXTENSION_DIR/<name>`` if set, else
    ``<torch extension root>/torchcal/<name>``."""
    root = os.environ.get("TORCHCAL_EXTENSION_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.path.join(get_default_build_root(), "torchcal")
    return Path(root) / extension_name()


def _library_path() -> Path:
    return build_directory() / f"{extension_name()}.so"


def _load_built() -> bool:
    """Load an already-built library (never compiles). A truncated or foreign file counts as not built."""
    path = _library_path()
    if not path.is_file():
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        warnings.warn(
            f"could not load torchcal's C++ loss extension from {path} ({exc}); rebuild it with "
            "`torchcal build-extension` (torchcal.functional.build_cpu_extension())",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return hasattr(torch.ops.torchcal, "fused_true_class")


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's binary (the ``fast`` extra) is not there when a
    virtual environment's Python is run without activating it."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # torch's own message says that ninja is missing
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_cpu_extension(verbose: bool = False) -> Path:
    """Compile (once; ~20-30 s) and load the C++ operator of the fused focal-family losses; returns the path
    of the library. A no-op returning the path when it is already built and loaded.

    Needs a C++17 compiler and ninja (``pip install ninja``). Concurrent builds (several processes) wait for
    each other. Raises ``RuntimeError`` with the compiler's output when the build fails.
    """
    with _lock:
        if _state["loaded"]:
            return _library_path()
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        load(
            name=extension_name(),
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
        _state["loaded"] = hasattr(torch.ops.torchcal, "fused_true_class")
        if not _state["loaded"]:
            raise RuntimeError(f"built {_library_path()} but it registered no torchcal.fused_true_class")
        return _library_path()


def cpu_extension_available() -> bool:
    """True when the C++ loss operator is built, loaded and enabled (``TORCHCAL_CPP`` unset or not 0, and
    CPU kernels not switched off with :func:`~torchcal.functional.use_cpu_kernels`).

    Example:
        >>> from torchcal.functional import cpu_extension_available, use_cpu_extension
        >>> with use_cpu_extension(False):
        ...     cpu_extension_available()
        False
    """
    if not (_state["enabled"] and _kernels._state["enabled"]):
        return False
    if _state["loaded"] is None:
        with _lock:
            if _state["loaded"] is None:
                _state["loaded"] = _load_built()
    return bool(_state["loaded"])


def use_cpu_extension(enabled: bool):
    """Context manager that switches the C++ loss operator on or off, process-wide (with it off, the numba
    kernels or the torch path compute the losses). Switching it on does not build it.

    Example:
        >>> import torch
        >>> from torchcal.functional import use_cpu_extension
        >>> from torchcal.functional.losses import focal_loss
        >>> logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
        >>> with use_cpu_extension(False):
        ...     without = focal_loss(logits, targets, gamma=2.0)
        >>> torch.allclose(without, focal_loss(logits, targets, gamma=2.0))
        True
    """
    return _kernels.switched(_state, enabled)


def fused_true_class(logits, targets, spec: _kernels.LossSpec, reduction: str) -> torch.Tensor:
    """The loss described by ``spec`` through the C++ operator (checks the label range)."""
    params = spec.cpp_params32 if logits.dtype == torch.float32 else spec.cpp_params64
    sample = spec.sample_gammas
    if sample is not None and not sample.is_cpu:
        sample = sample.cpu()
    return torch.ops.torchcal.fused_true_class.default(logits, targets, params, sample, REDUCTION_CODES[reduction])
