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
