"""Goodput, cost and run health, across every restart of a run.

- `record`: the run's account book, `<run dir>/goodput.jsonl`: one line when a process starts, then where its
  time went (start-up, set-up and restore, training, validation, saving, data wait), at saves, validations,
  alerts, its end and every `heartbeat_seconds`.
- `account`: the book read back: wall time, productive time, goodput, what restarts, saves, validation and
  data waits cost, restarts and their causes, cost and the projection to `trainer.max_steps`.
- `callback`: `Goodput`, the callback that keeps the book, enforces a budget and raises alerts
  (`configs/callbacks/goodput.yaml`: `callbacks=[default,goodput]`, from a run's first command).
- `alerts`: the conditions worth a warning before a run wastes a day.
- `cli`, `report`: `pretrain-goodput RUN` (or a sweep's directory: each job, and the share that completed).
"""
