"""The runner's models: the registry (``create_model``, ``list_models``), the papers' CIFAR networks, the
text CNN, the Hugging Face transformer classifier and the ten-crop evaluation wrapper. Imports nothing of
training, evaluation or reports."""

from __future__ import annotations

from .registry import TenCrop, TextCNN, TransformerClassifier, create_model, list_models

__all__ = ["TenCrop", "TextCNN", "TransformerClassifier", "create_model", "list_models"]
