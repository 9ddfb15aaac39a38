"""Sweeps (an extra): a report of a sweep's jobs ranked (`report.py`, `pretrain-sweep-report`, rewritten after
each job of a multirun) and an Optuna search that continues where it stopped (`optuna.py`, `hparams_search=...`).
It reads the jobs' metrics with the plots extra. Delete this folder, `src/hydra_plugins/pretraining_optuna`,
`configs/hparams_search`, `configs/hydra/sweeper/optuna.yaml` and `configs/hydra/sweep_report` to drop it."""
