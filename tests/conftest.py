import socket

import pytest
import torch

# tests/data/*.py write golden values with peer libraries installed in their own environment (each says how
# to run it); they are scripts, not tests, and import packages the test environment does not have
collect_ignore_glob = ["data/*.py"]


def make_probs(n, k, seed=0, sharpness=3.0, dtype=torch.float64):
    """Random softmax probabilities and targets drawn from a *different* (blunter) model."""
    g = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(n, k, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1)
    targets = torch.multinomial(torch.softmax(logits / 2, dim=1), 1, generator=g).squeeze(1)
    return probs.to(dtype), targets


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["cpp", "torch"])
def cpu_backend(request):
    """Runs a metric test on each CPU path of the scan: the C++ operator and plain torch."""
    from torchcal.functional import use_cpu_extension

    if request.param == "cpp":
        request.getfixturevalue("cpp_extension")
    with use_cpu_extension(request.param == "cpp"):
        yield request.param


@pytest.fixture(scope="session")
def cpp_extension():
    """Builds (once; a no-op when built) and loads the C++ loss operator. Skips only where no C++ compiler
    exists; a failing build fails the test."""
    import shutil

    from torchcal.functional import build_cpu_extension

    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("no C++ compiler: the C++ loss operator cannot be built here")
    build_cpu_extension()


@pytest.fixture(params=["cpp", "torch"])
def loss_backend(request):
    """Runs a loss test on each CPU path: the C++ operator and plain torch."""
    from torchcal.functional import use_cpu_extension

    if request.param == "cpp":
        request.getfixturevalue("cpp_extension")
    with use_cpu_extension(request.param == "cpp"):
        yield request.param


def for_thread_counts(fn, *args, counts=(1, 3)):
    """fn(*args) once under each of torch's thread counts in ``counts``, the caller's count restored
    afterwards: the results in that order (the thread-count invariance tests compare them bitwise)."""
    before = torch.get_num_threads()
    results = []
    try:
        for n_threads in counts:
            torch.set_num_threads(n_threads)
            results.append(fn(*args))
    finally:
        torch.set_num_threads(before)
    return results


def free_port() -> int:
    """A free TCP port on localhost for a test's torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_weights_match_up_to_sum_order(a: dict, b: dict, steps: int, ulps_per_step: int = 8) -> None:
    """Weights of two runs that took the same SGD steps from the same start, with every gradient a float32
    sum of the same terms in another order (one process against DDP ranks that each sum a half and then
    all-reduce; kernels that block a sum by the CPU's vector width (AVX2, AVX-512) and thread count).

    Two orders of one float32 sum differ by a few units in the last place of the sum's scale; plain SGD
    passes that on linearly (w -= lr·g), one step at a time, so after ``steps`` steps the weights differ by at
    most ``steps · ulps_per_step`` units of 2^-23 relative to the tensor's largest weight (8 per step: the
    gradient's reordering, the weight's own rounding, with margin). A real fault (an unaveraged gradient, a
    sample on the wrong rank) moves weights by a whole step, ~lr·|g| ≈ 1e-3, two orders of magnitude
    above this bound.
    Adam is not compared this way: it divides each gradient by its running RMS, so a weight whose gradient is
    pure rounding noise takes ±lr steps (2e-3 seen with AVX2 kernels) and nothing short of lr·steps bounds it.
    """
    eps = torch.finfo(torch.float32).eps
    for name in a:
        scale = float(a[name].abs().max()) or 1.0
        tol = steps * ulps_per_step * eps
        torch.testing.assert_close(
            a[name], b[name], rtol=tol, atol=tol * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
