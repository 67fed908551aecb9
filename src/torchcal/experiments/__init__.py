"""The experiment runner: configs, data readers, models, training loop, evaluation, reports and the CLI.

Separate from the light core: ``import torchcal`` never imports this package. It needs the ``experiments``
extra (PyYAML, typer, rich, scikit-learn, matplotlib).
"""
