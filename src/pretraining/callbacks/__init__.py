"""The Trainer's callbacks a run relies on: checkpoints at step boundaries (`checkpoint`), preemption
(`preemption`), numerical faults (`numerics`), lineage
(`lineage`), throughput and MFU (`throughput`), the progress bar (`progress`), the skipped-sample count and
limit, and a mixture's shares (`data_counts`), a text sample (`text_sample`) and an audit log of batches (`batch_log`).
Configs name each by its module (`pretraining.callbacks.checkpoint.StepCheckpoint`), so a run loads only its own."""
