# Doctest collection imports every module; the numba kernels module needs the optional numba.
import importlib.util

collect_ignore = []
if importlib.util.find_spec("numba") is None:
    collect_ignore.append("src/torchcal/functional/_numba_kernels.py")
