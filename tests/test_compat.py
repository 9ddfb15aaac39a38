"""What this code reads of older versions (`pretraining.compat`): a data position of format 2 continues
exactly, a stored config names its classes where they are now, a key of the example format written one
level up is named where it goes. A fork that deletes `pretraining.compat` deletes this file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import packed_blocks
from pretraining.compat import moved_key, with_current_targets
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.tokenizer import ByteTokenizer
from pretraining.instantiate import build
from pretraining.stored import stored_config
from test_mixture import BLOCK, BUFFER, SEED, consume, continue_with_a_source_added
from test_mixture import sources as sources  # the fixture: three small shard sets


def as_format_2(state: dict[str, Any]) -> dict[str, Any]:
    """A one-source position as the code before `data.sources` saved it (format 2): cursors [sub, shard, block],
    one data version, no counts per source."""
    (version,) = state["versions"].values()
    return {
        "format": 2,
        "data_version": version,
        "topology": state["topology"],
        "steps": state["steps"],
        "cursors": [[sub, shard, block] for _, sub, shard, block in state["cursors"]],
        "samples_read": state["samples_read"],
        "samples_skipped": state["samples_skipped"],
    }


def test_a_one_source_position_of_format_2_continues_exactly(sources: dict[str, Path]) -> None:
    """A checkpoint of a run on data.dir from before mixtures: it continues the same directory, read as
    data.dir or as a mixture of one under any name, exactly."""

    def one_source(as_mixture: bool) -> ShardDataModule:
        options: dict[str, Any] = {"global_batch_size": 16, "streams": 4, "num_workers": 0, "seed": SEED}
        options["shuffle_buffer"] = BUFFER
        if as_mixture:  # of one, of another name, and weighed
            options["sources"] = {"code": {"dir": str(sources["a"]), "weight": 0.5}}
        directory = None if as_mixture else str(sources["a"])
        return ShardDataModule(directory, ByteTokenizer(), packed_blocks(BLOCK), **options)

    whole = one_source(False)
    reference = consume(whole, 14)
    first = one_source(False)
    consume(first, 9)
    old = as_format_2(first.state_dict())
    assert len(old["cursors"]) == 4 and all(block > 0 for *_, block in old["cursors"])
    for as_mixture in (False, True):
        restored = one_source(as_mixture)
        restored.load_state_dict(old)
        assert consume(restored, 5) == reference[9:], f"as a mixture: {as_mixture}"
        assert restored.position.drawn == whole.position.drawn == [14 * 16]
        assert restored.position.samples_read == whole.position.samples_read
        # No change of mixture: the weight of a mixture of one changes nothing, and is kept as the run's.
        assert restored.position.phases == [{"step": 0, "weights": restored.position.weights}]
        again = one_source(as_mixture)
        again.load_state_dict(restored.state_dict())
        assert again.position.phases == restored.position.phases and again.position.cursors == restored.position.cursors


def test_a_source_added_to_a_run_of_format_2_starts_from_its_beginning_and_the_first_continues(
    sources: dict[str, Path],
) -> None:
    continue_with_a_source_added(sources, as_format_2)


def test_a_stored_config_naming_classes_where_version_0_1_kept_them_still_builds() -> None:
    old = {
        "tokenizer": {"_target_": "pretraining.data.ByteTokenizer"},
        "data": {
            "_target_": "pretraining.data.ShardDataModule",
            "format": {"_target_": "pretraining.data.PackedBlocks"},
        },
        "model": {"init_from": "an objective of 0.5 took it", "backbone": {"_target_": "pretraining.models.Llama"}},
    }
    run = stored_config({"lineage": {"config": old}}, "old.ckpt")
    assert run.model.backbone._target_ == "pretraining.models.llama.Llama"  # 0.9.1 named it by its package
    assert run.data._target_ == "pretraining.data.datamodule.ShardDataModule"
    assert run.data.format._target_ == "pretraining.data.formats.PackedBlocks"
    pairs = with_current_targets({"_target_": "pretraining.data.formats.TokenizedPairs"})  # before 0.10.0
    assert pairs == {"_target_": "pretraining.data.pair_format.TokenizedPairs"}
    assert isinstance(build(run.tokenizer), ByteTokenizer)
    assert "init_from" not in run.model and "init_from" in old["model"]  # the checkpoint's own left as it was


@pytest.mark.parametrize("key", ["data.block_size", "data.query_len", "data.text_field"])
def test_a_key_of_the_example_format_one_level_up_is_named_where_it_goes(key: str) -> None:
    moved = key.replace("data.", "data.format.")
    assert moved_key(key, 8) == f"it is a key of the example format, {moved}: write {moved}=8 instead"
    assert moved_key("data.blok_size", 8) is None
