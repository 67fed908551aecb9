"""The CPU accelerator: the optional C++ operators (``csrc/fused_losses.cpp``), built, loaded and called here.

Which implementation runs is decided in one place, :mod:`torchcal.functional._backend`; this module only
builds the library and wraps its operators. The loss operator ``torch.ops.torchcal.fused_true_class``
computes the focal-family losses of the torch path (same conventions, per-sample float64 arithmetic; the
dual loss's ties decided on the logits, see docs/decisions.md 38) with a C++ autograd node, so forward and
backward never re-enter Python (at batch sizes of a few hundred a Python round trip costs as much as
PyTorch's whole fused cross entropy).

It is compiled on request with ``torch.utils.cpp_extension`` (GCC or Clang and ninja are needed; ~20-30 s,
once per torch and Python version and CPU) by :func:`build_cpu_extension` or ``torchcal build-extension``, and
cached under ``$TORCHCAL_EXTENSION_DIR`` (default: torch's extension root, ``~/.cache/torch_extensions``). Once
built, every process picks it up without compiling.

Flags: where torch runs on GNU OpenMP (Linux wheels) the library is compiled with OpenMP, so its
``at::parallel_for`` shares torch's threads (without it the operator runs on one thread), and on x86-64 for
the CPU that builds it (``-march=native``: AVX2 or AVX-512 vectors). A native build's name includes the CPU's model and feature flags, so a cache directory
shared by different machines never hands one a library for another's ISA; it builds its own. When the compiler
refuses these flags (Clang without libomp, say), the portable flags ``-O3 -fopenmp-simd`` are used instead.

Besides the losses the library holds the metrics' top-label scan (``torch.ops.torchcal.top_label_scan``,
``csrc/scan.h``): validation, prediction, confidence, equal-width bins, classwise sums and per-sample sums in
one pass on torch's threads, and the stable radix sort of confidences with their correctness
(``torch.ops.torchcal.sort_with_flags``, ``csrc/sort.h``) of the equal-mass estimators, and the batch-term
losses' per-row numbers (``batch_terms_fwd`` / ``_bwd``, ``csrc/batch_terms.h``) and SB-ECE's label-binned
term (``sbece_label_fwd`` / ``_bwd``). ``TORCHCAL_CPP=0`` or
:func:`use_cpu_extension` turns it off; the torch path then computes everything.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch

from .._validation import label_range_error
from ._binning import ScanSums
from ._spec import LossSpec, env_enabled, switched

__all__ = ["build_cpu_extension", "cpu_extension_available", "use_cpu_extension"]

_SCAN_DTYPES = (torch.float32, torch.float64)

SOURCE = Path(__file__).with_name("csrc") / "fused_losses.cpp"
HEADERS = tuple(
    SOURCE.with_name(name)
    for name in ("true_class.h", "scan.h", "sort.h", "layout.h", "margin.h", "margin_lanes.h", "ace.h", "batch_terms.h")
)
REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}
PORTABLE_FLAGS = ["-O3", "-fopenmp-simd"]


def _torch_uses_libgomp() -> bool:
    """Whether this process runs torch on GNU OpenMP (Linux wheels do): a library built with ``-fopenmp``
    then shares torch's runtime and threads (same soname) instead of bringing a second one."""
    if not (sys.platform.startswith("linux") and torch._C.has_openmp):
        return False
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return False


def _compiler_is_clang() -> bool:
    """Whether torch's C++ compiler (``$CXX``, default ``c++``, links resolved) is Clang, whose ``-fopenmp``
    would link LLVM's libomp beside torch's libgomp: a second runtime and thread pool."""
    import shutil

    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    return "clang" in os.path.basename(os.path.realpath(path) if path else cxx)


def _native_flags() -> list[str]:
    """The preferred flags on this platform: OpenMP where torch runs on libgomp and the compiler is GCC, the
    machine's ISA on x86-64."""
    openmp = _torch_uses_libgomp() and not _compiler_is_clang()
    flags = ["-O3", "-fopenmp" if openmp else "-fopenmp-simd"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")
    return flags


# the flag sets tried in order: the first that compiles is built; loading looks for each one's library
_PREFERRED_FLAGS = _native_flags()
FLAG_SETS = [_PREFERRED_FLAGS] + ([PORTABLE_FLAGS] if _PREFERRED_FLAGS != PORTABLE_FLAGS else [])

# "ready": None until the library was looked for, then whether it is loaded (a bool that torch.compile can
# guard on; "loaded" holds its path, or False)
_state = {"enabled": env_enabled("TORCHCAL_CPP"), "loaded": None, "ready": None}
_lock = threading.Lock()


def _cpu_key() -> str:
    """The CPU model and feature flags (Linux: /proc/cpuinfo), or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        # one copy per distinct line: the same for any number of cores
        return "|".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def extension_name(flags: list[str] | None = None) -> str:
    """Name of the library for this source, these flags (default: the preferred set), torch build and Python
    version, and, for a ``-march=native`` build, this CPU (a rebuild follows any change)."""
    flags = FLAG_SETS[0] if flags is None else flags
    key = "|".join(
        (
            *(path.read_text(encoding="utf-8") for path in (SOURCE, *HEADERS)),
            " ".join(flags),
            torch.__version__,
            str(torch.version.cuda),
            str(torch.version.hip),
        )
    )
    key += f"|{sys.version_info.major}.{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    if "-march=native" in flags:
        key += "|" + _cpu_key()
    return "torchcal_fused_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_directory(flags: list[str] | None = None) -> Path:
    """Where the library is built and looked for: ``$TORCHCAL_EXTENSION_DIR/<name>`` if set, else
    ``<torch extension root>/torchcal/<name>``."""
    root = os.environ.get("TORCHCAL_EXTENSION_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.path.join(get_default_build_root(), "torchcal")
    return Path(root) / extension_name(flags)


def _library_path(flags: list[str] | None = None) -> Path:
    directory = build_directory(flags)  # named after the library
    return directory / f"{directory.name}.so"


def _load_built() -> Path | None:
    """Load an already-built library (never compiles): the first flag set's that exists; None when there is
    none. A truncated or foreign file counts as not built."""
    for flags in FLAG_SETS:
        path = _library_path(flags)
        if not path.is_file():
            continue
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:
            warnings.warn(
                f"could not load torchcal's C++ extension from {path} ({exc}); rebuild it with "
                "`torchcal build-extension` (torchcal.functional.build_cpu_extension())",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        if not hasattr(torch.ops.torchcal, "fused_true_class"):
            return None
        _register_compile_support()
        return path
    return None


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
    """Compile (once; ~20-30 s) and load the C++ operators (the fused focal-family losses and the metrics'
    scan); returns the path of the library. A no-op returning the path when it is already built and loaded.

    Needs a C++17 compiler and ninja (``pip install ninja``). Concurrent builds (several processes) wait for
    each other. The preferred flags are tried first, then the portable ones (with a warning naming the first
    failure). Raises ``RuntimeError`` with the compiler's output when no flag set builds.
    """
    with _lock:
        if _state["loaded"]:
            return _state["loaded"]
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        failures = []
        for flags in FLAG_SETS:
            directory = build_directory(flags)
            directory.mkdir(parents=True, exist_ok=True)
            try:
                load(
                    name=directory.name,
                    sources=[str(SOURCE)],
                    extra_cflags=flags,
                    extra_ldflags=[f for f in flags if f == "-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=verbose,
                )
            except RuntimeError as exc:
                failures.append(f"flags {' '.join(flags)}: {exc}")
                continue
            if failures:
                warnings.warn(
                    "torchcal's C++ extension was built with the portable flags "
                    f"{' '.join(flags)}; the preferred ones failed: {failures[0]}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if not hasattr(torch.ops.torchcal, "fused_true_class"):
                raise RuntimeError(
                    f"built {_library_path(flags)} but it registered no torchcal.fused_true_class"
                )
            _register_compile_support()
            _state["loaded"] = _library_path(flags)
            _state["ready"] = True
            return _state["loaded"]
        raise RuntimeError("could not build torchcal's C++ extension:\n" + "\n".join(failures))


def cpu_extension_available() -> bool:
    """True when the C++ operators (the fused losses and the metrics' scan) are built, loaded and enabled
    (``TORCHCAL_CPP`` unset or not 0, and not switched off with :func:`use_cpu_extension`).

    Example:
        >>> from torchcal.functional import cpu_extension_available, use_cpu_extension
        >>> with use_cpu_extension(False):
        ...     cpu_extension_available()
        False
    """
    if not _state["enabled"]:
        return False
    ready = _state["ready"]
    return _load_once() if ready is None else ready


@torch.compiler.assume_constant_result
def _load_once() -> bool:
    """Looks for the built library once per process; run as it is when ``torch.compile`` traces a first call
    (the lock and the file system are not traceable), its answer then a constant of the graph."""
    with _lock:
        if _state["loaded"] is None:
            _state["loaded"] = _load_built() or False
        _state["ready"] = bool(_state["loaded"])
    return _state["ready"]


def use_cpu_extension(enabled: bool):
    """Context manager that switches the C++ operators (losses and the metrics' scan) on or off, process-wide
    (with them off, the torch path computes). Switching them on does not build them.

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
    return switched(_state, enabled)


def fused_true_class(logits, targets, spec: LossSpec, reduction: str) -> torch.Tensor:
    """The loss described by ``spec`` through the C++ operator (checks the label range). While
    ``torch.compile`` traces, the pair of plain operators whose fake implementations and autograd formula
    are registered below (the eager operator's C++ autograd node cannot take fake tensors)."""
    params = spec.cpp_params32 if logits.dtype == torch.float32 else spec.cpp_params64
    sample = spec.sample_gammas
    if sample is not None and not sample.is_cpu:
        sample = sample.cpu()
    if torch.compiler.is_compiling():
        fwd = torch.ops.torchcal.fused_true_class_fwd.default
        return fwd(logits, targets, params, sample, REDUCTION_CODES[reduction], spec.brier)[0]
    return _op("fused_true_class")(logits, targets, params, sample, REDUCTION_CODES[reduction])


MARGIN_KINDS = {"mbls": 0, "maxsup": 1, "acls": 2, "confidence-penalty": 3, "cals": 4, "poly1": 5}
_N_STAT = 6  # columns of the margin operator's per-row statistics (``enum MarginStat`` in csrc/margin.h)


def fused_margin(logits, targets, kind: str, params: list[float], ignore_index, penalty_all_rows, reduction):
    """Cross entropy plus the row-wise penalty ``kind`` (a key of :data:`MARGIN_KINDS`; ``params`` = [coef,
    then the kind's numbers, csrc/margin.h]) through the C++ operator, for (N, K, d1, ...) CPU float32/64
    logits and integer labels (which it checks, ValueError). While ``torch.compile`` traces, the pair of plain
    operators whose fake implementations and autograd formula are registered below."""
    args = (logits, targets, MARGIN_KINDS[kind], params, ignore_index, penalty_all_rows, REDUCTION_CODES[reduction])
    if torch.compiler.is_compiling():
        return torch.ops.torchcal.fused_margin_fwd.default(*args)[0]
    return _op("fused_margin")(*args)


def fused_ace(logits, targets, edges, params: list[float], options: list[int], ignore_index):
    """Cross entropy + λ·mL1-ACE (:func:`torchcal.functional.margin.ml1ace_loss`) through the C++ operator
    (csrc/ace.h) for (N, K, d1, ...) CPU float32/64 logits and integer labels (which it checks, ValueError):
    ``edges`` the hard bins' inner edges in the logits' dtype, ``params`` [λ, empty_weight], ``options``
    [n_bins, soft, first class, ignore_empty_classes, per_image, reduction code]. While ``torch.compile``
    traces, the pair of plain operators whose fake implementations and autograd formula are registered
    below."""
    if torch.compiler.is_compiling():
        return torch.ops.torchcal.fused_ace_fwd.default(logits, targets, edges, params, options, ignore_index)[0]
    return _op("fused_ace")(logits, targets, edges, params, options, ignore_index)


def _ace_stats_size(logits, options) -> int:
    """Length of the ACE operator's float64 statistics (``Spec::stats_size`` in csrc/ace.h)."""
    n_bins, _, first, _, per_image, _ = options
    groups = logits.shape[0] if per_image else 1
    c = logits.shape[1] - first
    rows = logits.numel() // logits.shape[1]
    return groups * c * n_bins * 3 + groups * c + groups + 2 + rows


BATCH_BASES = {"nll": 0, "focal": 1, "ls": 2}
BATCH_ENTROPIES = {None: 0, "avuc": 1, "smoothed": 2}
_N_BATCH_STAT = 5  # columns of the batch-term operator's saved statistics (``enum BatchStat``, batch_terms.h)


class _BatchRows(torch.autograd.Function):
    """The batch-term operator pair as one differentiable function: (base, r, correct, entropy, column sums)
    from the logits, the backward in one C++ pass from the saved logits and per-row statistics."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, base, gamma, alpha, entropy, colsum):
        fwd = torch.ops.torchcal.batch_terms_fwd.default
        b, r, correct, h, col, saved = fwd(logits, targets, ignore_index, base, gamma, alpha, entropy, colsum)
        ctx.save_for_backward(logits, targets, saved)
        ctx.options = (ignore_index, base, gamma, alpha, entropy)
        ctx.mark_non_differentiable(correct)
        ctx.set_materialize_grads(False)
        return b, r, correct, h, col

    @staticmethod
    def backward(ctx, g_base, g_r, _g_correct, g_h, g_col):  # pyright: ignore[reportIncompatibleMethodOverride]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the fused CPU batch-term loss is differentiable once only; for higher-order gradients run it "
                "with torchcal.functional.use_cpu_extension(False)"
            )
        logits, targets, saved = ctx.saved_tensors
        _, _, _, _, entropy = ctx.options
        # (outputs not asked for are empty; torch.compile hands them an empty gradient rather than None)
        g_h = g_h if entropy else None
        g_col = g_col if g_col is not None and g_col.numel() else None
        bwd = torch.ops.torchcal.batch_terms_bwd.default
        grad = bwd(logits, targets, saved, g_base, g_r, g_h, g_col, *ctx.options)
        return grad, None, None, None, None, None, None, None


def fused_batch_rows(logits, targets, ignore_index, base: str, gamma: float, alpha: float, entropy, colsum: bool):
    """The per-row numbers of the batch-term losses by the C++ operator (csrc/batch_terms.h), for
    (N, K, d1, ...) CPU float32/64 logits and integer labels (checked: ValueError): the base loss (M) (0 on
    ignored rows; ``base`` a key of :data:`BATCH_BASES`), the top-label confidence r (M), the correctness (M,
    no gradient), the entropy (M) named by ``entropy`` (a key of :data:`BATCH_ENTROPIES`; empty for None) and
    with ``colsum`` the kept rows' column sums of p (K) (else empty), in the logits' dtype and differentiable
    once."""
    return _BatchRows.apply(
        logits, targets, ignore_index, BATCH_BASES[base], float(gamma), float(alpha), BATCH_ENTROPIES[entropy],
        bool(colsum),
    )


BATCH_TERMS = {"mdca": 0, "dca": 1, "sb-ece": 2, "avuc": 3, "s-avuc": 4, "esd": 5}


def fused_batch_loss(
    logits, targets, ignore_index, base: str, gamma: float, alpha: float, term: str, params: list[float],
    reduction: str, split: int,
):  # fmt: skip
    """A whole batch-term loss as one C++ autograd node (``fused_batch_loss``, decision 217): the per-row
    operator, the term ``term`` (a key of :data:`BATCH_TERMS`) with ``params`` (coef, then the term's) and the
    reduction; ``split`` the first row of ESD's held-out part (the number of rows: none). Returns (loss,
    stats (5) float64: AvUC's four sums, then 1 where the base or the term has no row). Eager only (no fake
    implementation: a traced loss takes :func:`fused_batch_rows`); differentiable once."""
    return _op("fused_batch_loss")(
        logits, targets, ignore_index, BATCH_BASES[base], float(gamma), float(alpha), BATCH_TERMS[term], params,
        REDUCTION_CODES[reduction], int(split),
    )


SBECE_MAX_BINS = 64  # (``kMaxBins`` in fused_losses.cpp)


class _SBECELabel(torch.autograd.Function):
    """SB-ECE's label-binned term of (M) confidences, correctness and kept mask by the C++ operator pair
    (two passes over the rows forward, one backward; no (M, bins) array); the gradient flows to ``conf``."""

    @staticmethod
    def forward(ctx, conf, correct, kept, bins, temperature):
        value, saved = torch.ops.torchcal.sbece_label_fwd.default(conf, correct, kept, bins, temperature)
        ctx.save_for_backward(conf, correct, kept, saved)
        ctx.options = (bins, temperature)
        return value

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the fused CPU SB-ECE term is differentiable once only; for higher-order gradients run it with "
                "torchcal.functional.use_cpu_extension(False)"
            )
        conf, correct, kept, saved = ctx.saved_tensors
        bwd = torch.ops.torchcal.sbece_label_bwd.default
        return bwd(grad, conf, correct, kept, saved, *ctx.options), None, None, None, None


def fused_sbece_label(conf, correct, kept, bins: int, temperature: float):
    """sqrt((1/Σ kept) Σ_b Σ_i g_bi (A_b − r_i)²), SB-ECE's label-binned term of CPU float32/64 vectors (decision
    203), differentiable once in ``conf``."""
    return _SBECELabel.apply(conf, correct.to(conf.dtype), kept.to(conf.dtype), int(bins), float(temperature))


def fused_margin_class(
    logits, targets, kind: str, params: list[float], class_params, ignore_index, penalty_all_rows, reduction,
    sums: bool,
):
    """:func:`fused_margin` for the kinds with per-class numbers (``class_params``, csrc/margin.h: CALS's
    (4, K) a, b, w, c; Poly-1's class weights (K,) or None); returns (loss, CALS's statistics (2K + 1) in the
    logits' dtype with ``sums``, else an empty tensor)."""
    args = (logits, targets, MARGIN_KINDS[kind], params, class_params, ignore_index, penalty_all_rows,
            REDUCTION_CODES[reduction], sums)  # fmt: skip
    if torch.compiler.is_compiling():
        return torch.ops.torchcal.fused_margin_class_fwd.default(*args)[:2]
    return _op("fused_margin_class")(*args)


_N_OUT = 6  # columns of the operator's per-sample output (``enum Out`` in csrc/true_class.h)


def _register_compile_support() -> None:
    """Fake implementations (output shapes for tracing) of ``fused_true_class_fwd`` / ``_bwd`` and the
    forward's autograd formula, registered once after the library is loaded."""
    if _state.get("compile_support") or not hasattr(torch.ops.torchcal, "fused_true_class_fwd"):
        return
    _state["compile_support"] = True

    @torch.library.register_fake("torchcal::fused_true_class_fwd")
    def _fwd_fake(logits, targets, params, sample_gammas, reduction, brier):
        n = logits.shape[0]
        loss = logits.new_empty((n,) if reduction == 0 else ())
        out = logits.new_empty((n, _N_OUT), dtype=torch.float64)
        return loss, torch.empty_like(logits, memory_format=torch.contiguous_format), out

    @torch.library.register_fake("torchcal::fused_true_class_bwd")
    def _bwd_fake(grad_loss, probs, targets, out, brier, reduction):
        return torch.empty_like(probs)

    def setup_context(ctx, inputs, output):
        _, targets, _, _, reduction, brier = inputs
        _, probs, out = output
        ctx.save_for_backward(probs, targets, out)
        ctx.reduction, ctx.brier = reduction, brier

    def backward(ctx, grad_loss, _grad_probs, _grad_out):
        probs, targets, out = ctx.saved_tensors
        bwd = torch.ops.torchcal.fused_true_class_bwd.default
        return bwd(grad_loss, probs, targets, out, ctx.brier, ctx.reduction), None, None, None, None, None

    torch.library.register_autograd("torchcal::fused_true_class_fwd", backward, setup_context=setup_context)

    if not hasattr(torch.ops.torchcal, "fused_margin_fwd"):
        return

    @torch.library.register_fake("torchcal::fused_margin_fwd")
    def _margin_fwd_fake(logits, targets, kind, params, ignore_index, penalty_all_rows, reduction):
        loss = logits.new_empty(targets.shape if reduction == 0 else ())
        return loss, logits.new_empty((targets.numel(), _N_STAT), dtype=torch.float64)

    @torch.library.register_fake("torchcal::fused_margin_bwd")
    def _margin_bwd_fake(grad_loss, logits, targets, stats, kind, params, ignore_index, penalty_all_rows, reduction):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    def margin_setup_context(ctx, inputs, output):
        logits, targets, *options = inputs
        ctx.save_for_backward(logits, targets, output[1])
        ctx.options = options

    def margin_backward(ctx, grad_loss, _grad_stats):
        logits, targets, stats = ctx.saved_tensors
        grad = torch.ops.torchcal.fused_margin_bwd.default(grad_loss, logits, targets, stats, *ctx.options)
        return grad, None, None, None, None, None, None

    torch.library.register_autograd(
        "torchcal::fused_margin_fwd", margin_backward, setup_context=margin_setup_context
    )

    _register_batch_terms()

    if not hasattr(torch.ops.torchcal, "fused_ace_fwd"):
        return

    @torch.library.register_fake("torchcal::fused_ace_fwd")
    def _ace_fwd_fake(logits, targets, edges, params, options, ignore_index):
        loss = logits.new_empty(targets.shape if options[-1] == 0 else ())
        return loss, logits.new_empty((_ace_stats_size(logits, options),), dtype=torch.float64)

    @torch.library.register_fake("torchcal::fused_ace_bwd")
    def _ace_bwd_fake(grad_loss, logits, targets, edges, stats, params, options, ignore_index):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    def ace_setup_context(ctx, inputs, output):
        logits, targets, edges, *options = inputs
        ctx.save_for_backward(logits, targets, edges, output[1])
        ctx.options = options

    def ace_backward(ctx, grad_loss, _grad_stats):
        logits, targets, edges, stats = ctx.saved_tensors
        grad = torch.ops.torchcal.fused_ace_bwd.default(grad_loss, logits, targets, edges, stats, *ctx.options)
        return grad, None, None, None, None, None

    torch.library.register_autograd("torchcal::fused_ace_fwd", ace_backward, setup_context=ace_setup_context)

    if not hasattr(torch.ops.torchcal, "fused_margin_class_fwd"):
        return

    @torch.library.register_fake("torchcal::fused_margin_class_fwd")
    def _class_fwd_fake(logits, targets, kind, params, class_params, ignore_index, penalty_all_rows, reduction, sums):
        loss = logits.new_empty(targets.shape if reduction == 0 else ())
        n_sums = 2 * logits.shape[1] + 1 if sums else 0
        stats = logits.new_empty((targets.numel(), _N_STAT), dtype=torch.float64)
        return loss, logits.new_empty((n_sums,)), stats

    @torch.library.register_fake("torchcal::fused_margin_class_bwd")
    def _class_bwd_fake(grad_loss, logits, targets, stats, kind, params, class_params, ignore_index,
                        penalty_all_rows, reduction):  # fmt: skip
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    def class_setup_context(ctx, inputs, output):
        logits, targets, kind, params, class_params, *options = inputs
        ctx.save_for_backward(logits, targets, output[2], class_params)
        ctx.kind, ctx.params, ctx.options = kind, params, options[:3]
        ctx.mark_non_differentiable(output[1], output[2])

    def class_backward(ctx, grad_loss, _grad_sums, _grad_stats):
        logits, targets, stats, class_params = ctx.saved_tensors
        bwd = torch.ops.torchcal.fused_margin_class_bwd.default
        grad = bwd(grad_loss, logits, targets, stats, ctx.kind, ctx.params, class_params, *ctx.options)
        return grad, None, None, None, None, None, None, None, None

    torch.library.register_autograd(
        "torchcal::fused_margin_class_fwd", class_backward, setup_context=class_setup_context
    )


def _register_batch_terms() -> None:
    """Fake implementations of ``batch_terms_fwd`` / ``_bwd`` (output shapes for tracing)."""
    if not hasattr(torch.ops.torchcal, "batch_terms_fwd"):
        return

    @torch.library.register_fake("torchcal::batch_terms_fwd")
    def _fwd_fake(logits, targets, ignore_index, base, gamma, alpha, entropy, colsum):
        m = targets.numel()
        vector = logits.new_empty((m,))
        return (
            vector,
            torch.empty_like(vector),
            torch.empty_like(vector),
            logits.new_empty((m if entropy else 0,)),
            logits.new_empty((logits.shape[1] if colsum else 0,)),
            logits.new_empty((m, _N_BATCH_STAT), dtype=torch.float64),
        )

    @torch.library.register_fake("torchcal::sbece_label_fwd")
    def _sbece_fwd_fake(conf, correct, kept, bins, temperature):
        return conf.new_empty(()), conf.new_empty((3 * bins + 2,), dtype=torch.float64)

    @torch.library.register_fake("torchcal::sbece_label_bwd")
    def _sbece_bwd_fake(grad, conf, correct, kept, saved, bins, temperature):
        return torch.empty_like(conf)

    @torch.library.register_fake("torchcal::batch_terms_bwd")
    def _bwd_fake(logits, targets, saved, g_base, g_r, g_entropy, g_colsum, ignore_index, base, gamma, alpha, entropy):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _op(name: str):
    """The C++ callable of operator ``torchcal::<name>``, looked up once: the overload's Python ``__call__``
    and the ``torch.ops`` lookups cost ~1.5 µs a call."""
    ops = _state.setdefault("ops", {})
    op = ops.get(name)
    if op is None:
        overload = getattr(torch.ops.torchcal, name).default
        op = ops[name] = getattr(overload, "_op", overload)
    return op


def scan_applies(probs: torch.Tensor) -> bool:
    """Whether the C++ top-label scan takes these probabilities (built and enabled; contiguous float32/64
    CPU tensor)."""
    return (
        probs.dtype in _SCAN_DTYPES and probs.is_cpu and probs.is_contiguous() and cpu_extension_available()
    )


def top_label_scan(
    probs, targets, n_bins=None, classwise_bins=None, threshold=None, row_bins=False, bin_vectors=False
):
    """One pass over contiguous CPU ``probs`` (N, K) and integer ``targets`` (N,) (the pass checks their range)
    on torch's threads, summed in an order that does not depend on the thread count.

    Returns ``(conf, correct, worst, lowest, nonfinite, top, classwise, sum_sq, bins, sums, vectors)``: top-label
    confidence (in the input dtype) and correctness (bool); the largest |row sum − 1|, the most negative entry
    (0.0 if none) and whether any row sum is not finite; the top-label equal-width (count, conf sum, correct
    sum) float64 tensors of shape (n_bins,) (None without ``n_bins``); the classwise (count, p sum, [y = k]
    sum), each (K, classwise_bins) float64 (None without ``classwise_bins``); Σ_ik p_ik² in float64; with
    ``row_bins`` and ``n_bins`` each row's top-label bin, int64 (N,) (else None); with a ``threshold`` the
    per-sample sums (:class:`~torchcal.functional._binning.ScanSums`, else None); with ``bin_vectors`` and
    ``n_bins`` the per-bin K-vectors Σ P_i and Σ onehot(y_i), float64 (2, n_bins, K), of the decompositions
    (:func:`torchcal.metrics.top_bin_vector_sums`, here in the same pass; else None)."""
    conf, correct, top, cw, stats, bins, vectors = _op("top_label_scan")(
        probs.detach(),
        targets.detach(),
        n_bins or 0,
        classwise_bins or 0,
        threshold,
        bool(row_bins),
        bool(bin_vectors),
    )
    worst, lowest, nonfinite, sum_sq, n_bad, *sums = stats.tolist()
    if n_bad:
        raise label_range_error(targets, probs.shape[1])
    return (
        conf,
        correct,
        worst,
        lowest,
        bool(nonfinite),
        tuple(top.unbind(0)) if n_bins else None,
        tuple(cw.unbind(0)) if classwise_bins else None,
        sum_sq,
        bins if row_bins and n_bins else None,
        None if threshold is None else ScanSums(*sums),
        vectors if bin_vectors and n_bins else None,
    )


def sort_applies(values: torch.Tensor) -> bool:
    """Whether the C++ radix sort takes these values (built and enabled; 1-D float32/64 CPU tensor)."""
    return values.dtype in _SCAN_DTYPES and values.is_cpu and values.dim() == 1 and cpu_extension_available()


def sort_with_flags(values: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable ascending sort of non-negative ``values`` carrying the bool ``flags`` along: (sorted values,
    their flags), by the C++ radix sort (ties keep their input order; −0.0 sorts as 0.0; negative or NaN
    values raise ValueError)."""
    return _op("sort_with_flags")(values.detach(), flags.detach())


def logits_top_label(logits, targets, n_bins=None):
    """The top label of contiguous CPU ``logits`` (N, K) without the probability matrix, by the C++ operator:
    (conf in the input dtype, correct (bool), top-label equal-width (count, conf sum, correct sum) float64
    tensors of shape (n_bins,) or None without ``n_bins``). conf = 1 / Σ_j exp(z_j − max_j z_j); ties in the
    maximum predict the lowest class. Raises ValueError for a label outside [0, K) or a non-finite row."""
    conf, correct, top, stats = _op("logits_top_label")(logits.detach(), targets.detach(), n_bins or 0)
    nonfinite, n_bad = stats.tolist()
    if n_bad:
        raise label_range_error(targets, logits.shape[1])
    if nonfinite:
        raise ValueError("`probs` contains NaN or infinite values")
    return conf, correct, (tuple(top.unbind(0)) if n_bins else None)
