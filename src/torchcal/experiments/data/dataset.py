"""The in-memory split every reader returns (a leaf: the readers of :mod:`.data` and :mod:`.text` import it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Dataset"]


@dataclass
class Dataset:
    """Tensors of one split: inputs (N, ...) and integer labels (N,), or for multi-label sets float 0/1 targets
    (N, L) with ``label_names``; text training sets also carry the embedding matrix of their vocabulary
    (``embeddings``)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    embeddings: torch.Tensor | None = None
    vocab_size: int | None = None
    label_names: list | None = None

    @property
    def multilabel(self) -> bool:
        return self.targets.ndim == 2

    def __len__(self) -> int:
        return int(self.targets.shape[0])
