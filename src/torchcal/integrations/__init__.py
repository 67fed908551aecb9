"""Adapters for the libraries people train with; each imports its library lazily and is an optional extra.

* :mod:`torchcal.integrations.torchmetrics` — the calibration metrics as ``torchmetrics.Metric`` classes
  (``MetricCollection``, ``.to(device)``, ``reset``, DDP sync of constant-size state), multi-label ones
  included (``MultilabelCalibrationMetric``);
* :mod:`torchcal.integrations.lightning` — a Lightning callback: calibration metrics of the validation loop,
  AdaFocal's update from the global validation pass of ``fit``, the post-hoc calibrator fitted to each
  checkpoint's weights (softmax or sigmoid outputs);
* :mod:`torchcal.integrations.huggingface` — a ``transformers.Trainer`` whose loss is any torchcal loss
  (``ignore_index=-100`` included) and a ``compute_metrics`` helper (multiclass, token or multi-label).

timm needs no adapter: every loss accepts the soft targets of timm's mixup / cutmix (docs/integrations).
Importing :mod:`torchcal.integrations` imports none of these libraries.
"""
