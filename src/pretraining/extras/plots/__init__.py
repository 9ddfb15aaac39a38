"""Plots (an extra): learning curves as PNG from a run's CSV log (`pretrain-plot`, `plots.py`), and the run's
logs read back (`run_logs.py`, which the sweeps extra reads too). Delete this folder to drop it."""
