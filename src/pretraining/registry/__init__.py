"""The model registry: checkpoints chosen for use, as numbered versions with aliases that move with
history, taints and rollback (`pretrain-registry`); kept in an append-only ledger (`ledger.py`),
mirrored to W&B (`mirror.py`)."""
