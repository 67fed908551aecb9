import socket

import pytest
import torch


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


def free_port() -> int:
    """A free TCP port on localhost for a test's torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
