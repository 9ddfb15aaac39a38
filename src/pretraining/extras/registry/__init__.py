"""The model registry (an extra): checkpoints chosen for use, as numbered versions with aliases that move
with history, taints and rollback (`pretrain-registry`, `cli.py`); kept in an append-only ledger
(`ledger.py`), mirrored to W&B (`mirror.py`); checkpoints registered as a run trains (`callback.py`,
`callbacks=[default,register]`). Distillation and Hugging Face import and export consult it where it is
installed. Delete this folder and `configs/callbacks/register.yaml` to drop it."""

from pretraining.config import PROJECT_ROOT

REGISTRY_DIR = PROJECT_ROOT / "logs" / "registry"  # the default paths.registry_dir, for the commands without Hydra
