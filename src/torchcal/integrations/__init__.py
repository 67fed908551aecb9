"""Adapters for the libraries people train with; each imports its library lazily and is an optional extra.

* :mod:`torchcal.integrations.torchmetrics` — the calibration metrics as ``torchmetrics.Metric`` classes
  (``MetricCollection``, ``.to(device)``, ``reset``, DDP sync of constant-size state);
* :mod:`torchcal.integrations.lightning` — a Lightning callback: calibration metrics of the validation loop,
  AdaFocal's update from the global validation pass, a post-hoc calibrator saved with every checkpoint;
* :mod:`torchcal.integrations.huggingface` — a ``transformers.Trainer`` whose loss is any torchcal loss
  (``ignore_index=-100`` included) and a ``compute_metrics`` helper.

timm needs no adapter: every loss accepts the soft targets of timm's mixup / cutmix (docs/integrations).
Importing :mod:`torchcal.integrations` imports none of these libraries.
"""
