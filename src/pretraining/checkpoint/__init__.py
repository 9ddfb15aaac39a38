"""Checkpoints that are never half-written, and the search for the newest good one.

`step-000200.ckpt` is written to a temporary file beside it, fsynced, read back for its SHA-256 and renamed
into place (the directory fsynced); its sidecar `step-000200.ckpt.json` (checksum, size, step, lineage,
shapes) is written the same way, last. A checkpoint counts only once its sidecar exists and its bytes match,
so a crash leaves the previous good checkpoint or the new one, never a torn file a resume would trust.

A sharded checkpoint (FSDP2, `save_distributed_checkpoint=true`) is a directory: every rank writes into a
temporary one, then rank zero checksums each file, renames it into place and writes the sidecar last
(`pretraining.checkpoint.sharded`). With `background`, a writer thread writes a host copy of the state
exactly so (DCP's `async_save` for shards)."""

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
