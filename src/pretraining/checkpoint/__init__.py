"""Checkpoints that are never half-written, and the search for the newest good one.

A checkpoint `step-000200.ckpt` is written to a temporary file in the same
directory, fsynced, read back for its SHA-256, renamed into place, and the
directory fsynced; then its sidecar `step-000200.ckpt.json` (checksum, size,
step, lineage, parameter shapes) is written the same way, last. A checkpoint
counts only once its sidecar exists and its bytes match it, so a crash at any
moment leaves either the previous good checkpoint or the new good one, never a
torn file that a resume would trust. Resume takes the newest that verifies.

A sharded checkpoint (FSDP2 with `save_distributed_checkpoint=true`) is a
directory of the same name: every rank writes its shards into a temporary
directory beside it, and once all have finished, rank zero checksums every
file, renames the directory into place and writes the sidecar (which lists each
file's size and SHA-256) last, with the same guarantees (`pretraining.checkpoint.sharded`, which the FSDP2
strategy loads with the first sharded checkpoint it saves or loads).

On one device, with DDP and for sharded checkpoints the write happens in the background (`background`):
the step waits only for a copy of the state in host memory, and a writer thread writes that copy exactly
as above (DCP's `async_save` writes the shards).
"""

from pretraining.checkpoint.lineage import (
    checkpoint_digest,
    existing_checkpoint,
    lineage_of,
    read_lineage,
    sidecar_checksums,
    sidecar_digest,
)
from pretraining.checkpoint.sidecar import (
    LINEAGE_FORMAT,
    READABLE_LINEAGE_FORMATS,
    SHARDED_META,
    parameter_shapes,
    read_sidecar,
    sidecar_path,
    verify,
)
from pretraining.checkpoint.store import (
    LAST_LINK,
    keep_for_good,
    link_last,
    newest_saved,
    newest_verified,
    prune,
    record_validation,
    remove,
    save_file,
    saved_checkpoints,
    storage_fault,
    storage_faults_stop_the_run,
)
from pretraining.checkpoint.weights_only import load_weights_only, refusing_code
from pretraining.errors import CheckpointError

__all__ = [
    "LAST_LINK",
    "LINEAGE_FORMAT",
    "READABLE_LINEAGE_FORMATS",
    "SHARDED_META",
    "CheckpointError",
    "checkpoint_digest",
    "existing_checkpoint",
    "keep_for_good",
    "lineage_of",
    "link_last",
    "load_weights_only",
    "newest_saved",
    "newest_verified",
    "parameter_shapes",
    "prune",
    "read_lineage",
    "read_sidecar",
    "record_validation",
    "refusing_code",
    "remove",
    "save_file",
    "saved_checkpoints",
    "sidecar_checksums",
    "sidecar_digest",
    "sidecar_path",
    "storage_fault",
    "storage_faults_stop_the_run",
    "verify",
]
