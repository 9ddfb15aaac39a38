"""Lightning's checkpoint writer and reader, made atomic and verified (`pretraining.checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO

from pretraining.checkpoint import refusing_code, remove, save_file, verify
from pretraining.checkpoint.background import BackgroundWriter, host_copy


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint whole or not at all, sidecar last; reads only one that verifies. Given a
    `BackgroundWriter` as `storage_options`, its thread writes a host copy. Not `AsyncCheckpointIO`: it copies
    on the device, tells no one when a write completes, and raises a failure only at the next save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        path = Path(path)
        if not isinstance(storage_options, BackgroundWriter):
            save_file(checkpoint, path)
            return
        state = host_copy(checkpoint)
        storage_options.submit(path, lambda: save_file(state, path))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        verify(Path(path))
        # Weights only: a file from elsewhere runs no code. CPU: every rank's copy would land on the saver's GPU.
        with refusing_code(path):
            return super().load_checkpoint(path, map_location=map_location or on_cpu, weights_only=True)

    def remove_checkpoint(self, path: Any) -> None:
        remove(Path(path))


def on_cpu(storage: Any, location: str) -> Any:
    """A `torch.load` map_location that keeps every tensor on the CPU."""
    return storage
