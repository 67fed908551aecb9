"""Evaluating runs: post-hoc calibration of a run's saved logits, the calibrator arena, the metrics beyond
ECE and conformal sets. Works on saved logits: imports nothing of training or reports."""

from __future__ import annotations

from .arena import run_arena
from .evaluate import calibrate_run, evaluate_run

__all__ = ["evaluate_run", "calibrate_run", "run_arena"]
