"""What this code reads of older versions: delete this module once no checkpoint or config you still use
was written before 0.10.0 (nothing here is needed by a run of this version's configs).

- `position_of_format_2`: a data position saved before data mixtures (0.9.0: format 2, one directory).
- `current_config`: a config stored in a checkpoint whose classes have moved since (`MOVED_TARGETS`:
  0.1.0's, 0.5's, 0.6's and 0.9's names), or whose objective took `init_from` (0.5).
- `MOVED_KEYS`: the hint for a key of the example format written one level up (`data.block_size`: the
  lengths were there before 0.1.0). Users still reach for the fields there: deleted, such a key gets the
  closest known one instead.

Each is called from one place, which imports it only when it meets an old format (or, for a stored config,
always: `pretraining.stored`, which a training run does not load). To delete it, drop those call sites:
- `pretraining.data.position.DataPosition.in_current_format`: the `format == 2` branch (format 2 is then
  refused like any other);
- `pretraining.stored.stored_config`: `OmegaConf.create(checkpoint["lineage"]["config"])` instead of
  `current_config(...)`;
- `pretraining.schema.unknown_key`: the `moved_key` branch (such a key then gets the closest known one);
then delete tests/test_compat.py, the two `a key of the example format` entries of tests/test_errors.py,
this module's line in tests/test_layers.py (`FLOORS`, `DEFERS_IMPORTS`: data.position, schema).
"""

from __future__ import annotations

from typing import Any

# Classes of this package that moved since a stored config named them: 0.1.0 imported these from
# `pretraining.data` itself, which now imports nothing (so that `pretrain-data` does not load Lightning);
# 0.5 named the objectives by their package, 0.6 by their modules (a run loads only its own); 0.10.0 does
# the same for the backbones, and gives the pairs format a module of its own.
MOVED_TARGETS = {
    "pretraining.data.ShardDataModule": "pretraining.data.datamodule.ShardDataModule",
    "pretraining.data.PackedBlocks": "pretraining.data.formats.PackedBlocks",
    "pretraining.data.TokenizedPairs": "pretraining.data.pair_format.TokenizedPairs",
    "pretraining.data.formats.TokenizedPairs": "pretraining.data.pair_format.TokenizedPairs",
    "pretraining.data.ByteTokenizer": "pretraining.data.tokenizer.ByteTokenizer",
    "pretraining.data.BPETokenizer": "pretraining.data.tokenizer.BPETokenizer",
    "pretraining.objectives.CausalLM": "pretraining.objectives.causal_lm.CausalLM",
    "pretraining.objectives.MaskedLM": "pretraining.objectives.masked_lm.MaskedLM",
    "pretraining.objectives.Contrastive": "pretraining.objectives.contrastive.Contrastive",
    "pretraining.objectives.Distill": "pretraining.extras.distill.objectives.Distill",
    "pretraining.objectives.DistillMasked": "pretraining.extras.distill.objectives.DistillMasked",
    "pretraining.models.Transformer": "pretraining.models.transformer.Transformer",
    "pretraining.models.Llama": "pretraining.models.llama.Llama",
}
# Keys of the example format written one level up: the lengths, which were there in earlier layouts, and the
# fields, which users reach for there.
FORMAT_KEYS = ("block_size", "query_len", "passage_len", "text_field", "query_field", "passage_field")
MOVED_KEYS = {f"data.{key}": f"data.format.{key}" for key in FORMAT_KEYS}


def position_of_format_2(state: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """A data position of format 2 (one directory's, cursors [sub, shard, block], no counts by source) as
    format 3 would hold it, under the source name "" (`DataPosition.renamed` gives it the run's): every
    example it drew, `global_batch` a step, came from that one source."""
    return state | {
        "versions": {"": state["data_version"]},
        "cursors": [["", *cursor] for cursor in state["cursors"]],
        "drawn": {"": state["steps"] * global_batch},
        "phases": [{"step": 0, "weights": {"": 1.0}}],
    }


def current_config(stored: dict[str, Any]) -> dict[str, Any]:
    """A config stored in a checkpoint (plain containers) as this code reads it: each moved `_target_`
    (`MOVED_TARGETS`) named where it is now, and no `model.init_from` (an objective of 0.5 took it; a run now
    starts from one with callbacks.init_from)."""
    config = with_current_targets(stored)
    config["model"].pop("init_from", None)
    return config


def with_current_targets(node: Any) -> Any:
    """A stored config (plain containers) with each moved `_target_` (`MOVED_TARGETS`) named where it is now."""
    if isinstance(node, dict):
        return {
            key: MOVED_TARGETS.get(value, value) if key == "_target_" else with_current_targets(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [with_current_targets(value) for value in node]
    return node


def moved_key(key: str, value: Any) -> str | None:
    """How to write `key`, a key of the example format written one level up (None for any other key)."""
    if key not in MOVED_KEYS:
        return None
    return f"it is a key of the example format, {MOVED_KEYS[key]}: write {MOVED_KEYS[key]}={value!r} instead"
