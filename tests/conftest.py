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


@pytest.fixture(params=["numba", "torch"])
def cpu_backend(request):
    """Runs a test once with the fused numba CPU kernels and once on the plain torch path."""
    from torchcal.functional import _kernels, use_cpu_kernels

    if request.param == "numba" and _kernels._compiled() is None:
        pytest.skip("numba is not installed (pip install 'torchcal[fast]')")
    with use_cpu_kernels(request.param == "numba"):
        yield request.param
