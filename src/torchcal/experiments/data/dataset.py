"""The in-memory split every reader returns (a leaf: the readers of :mod:`.data` and :mod:`.text` import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .streaming import ImageFolderInputs

__all__ = ["Dataset"]


@dataclass
class Dataset:
    """Tensors of one split: inputs (N, ...) and integer labels (N,), or for multi-label sets float 0/1 targets
    (N, L) with ``label_names``; text training sets also carry the embedding matrix of their vocabulary
    (``embeddings``). The image sets decoded per batch hold :class:`~.streaming.ImageFolderInputs` as their
    inputs (file paths, indexed like the (N, 3, S, S) uint8 tensor)."""

    inputs: torch.Tensor | ImageFolderInputs
    targets: torch.Tensor
    embeddings: torch.Tensor | None = None
    vocab_size: int | None = None
    label_names: list | None = None

    @property
    def multilabel(self) -> bool:
        return self.targets.ndim == 2

    def __len__(self) -> int:
        return int(self.targets.shape[0])
