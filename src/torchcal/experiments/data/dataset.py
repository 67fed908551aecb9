"""The in-memory split every reader returns (a leaf: the readers of :mod:`.data` and :mod:`.text` import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["Dataset", "LazyInputs"]


class LazyInputs(Protocol):
    """Inputs decoded when indexed (:class:`~.streaming.ImageFolderInputs`, the image sets read per batch):
    the tensor-like surface of an (N, C, S, S) batch the runner uses. Indexing gives a decoded batch, a lazy
    view or the crops to take on the device, depending on the index and the set."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def ndim(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...


@dataclass
class Dataset:
    """Tensors of one split: inputs (N, ...) and integer labels (N,), or for multi-label sets float 0/1 targets
    (N, L) with ``label_names``; text training sets also carry the embedding matrix of their vocabulary
    (``embeddings``). The image sets decoded per batch hold :class:`~.streaming.ImageFolderInputs` as their
    inputs (file paths, indexed like the (N, 3, S, S) uint8 tensor; :class:`LazyInputs`)."""

    inputs: torch.Tensor | LazyInputs
    targets: torch.Tensor
    embeddings: torch.Tensor | None = None
    vocab_size: int | None = None
    label_names: list | None = None

    @property
    def multilabel(self) -> bool:
        return self.targets.ndim == 2

    def __len__(self) -> int:
        return int(self.targets.shape[0])
