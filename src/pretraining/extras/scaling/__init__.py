"""Scaling (an extra): the coordinate check of a parametrization (`coordinates.py`, `pretrain-scaling
coordinates`), the scaling ladder (`ladder.py` and its fit, `power_law.py`: `pretrain-scaling ladder`, `make
ladder`) and their figures (`figures.py`, with the plots extra). The rules themselves are the core's
(`pretraining.models.parametrization`). Delete this folder, configs/experiment/ladder.yaml, make/scaling.mk and
its line in pyproject.toml to drop it."""
