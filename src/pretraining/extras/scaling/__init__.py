"""Scaling (an extra): the coordinate check of a parametrization (`coordinates.py`, `pretrain-scaling
coordinates`) and its figure (`figures.py`, with the plots extra). The rules themselves are the core's
(`pretraining.models.parametrization`). Delete this folder and its line in pyproject.toml to drop it."""
