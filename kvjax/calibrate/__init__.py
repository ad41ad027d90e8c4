"""Calibration: the per-model files of the learned methods (`qfilter`, `kvzap`, `duo_attention`) made for a model
from kvjax's own synthetic text, in the layouts those methods read (`python -m kvjax.calibrate --help`).

One module per method (`qfilter`, `kvzap`, `duo_attention`) and `activations`, the plain forward they read.
"""
