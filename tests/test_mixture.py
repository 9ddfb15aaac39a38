"""A weighted mixture of shard sets (`data.sources`): each source's share over any window of steps, the
source of each example independent of the layout, exact resume of every source's cursors (in the stream,
the DataModule's state, and killed runs), caps on a source's repetitions, the config checks, and a real
run's per-source validation, counts, lineage and change of weights on resume."""

from __future__ import annotations

import csv
import itertools
import json
import random
import re
import shutil
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import pretraining.data.manifest as manifest_module
from conftest import ComposeTrain, packed_blocks
from pretraining.callbacks.batch_log import read_batch_log
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR
from pretraining.data.batches import BatchPlan, BatchStream, batch_plan
from pretraining.data.corpus import Document
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import PackedBlocks
from pretraining.data.loader import training_loader
from pretraining.data.manifest import MANIFEST, PAIR_FIELDS, Manifest
from pretraining.data.mixture import Mixture, SourceSettings
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.stream import Cursor, ShardStream
from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import CheckpointError, ConfigError, PretrainingError, ShardError
from pretraining.evaluate import evaluate
from pretraining.instantiate import build
from pretraining.run import check_config
from pretraining.stored import load_checkpoint
from pretraining.train import train

BLOCK = 32  # bytes (ByteTokenizer): a document of a few hundred gives several blocks
SEED = 11
BUFFER = 16
# Each source's text is written in its own characters, so a block tells which source it came from.
ALPHABETS = {"a": "abcdefgh", "b": "0123456789", "c": "KLMNOPQR"}


# --- small shard sets, one per source -------------------------------------------------------------------


def documents(name: str, count: int) -> list[Document]:
    rng = random.Random(name)
    letters = ALPHABETS[name]
    texts = [
        "\n".join(
            " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(3, 9)))
            for _ in range(rng.randint(3, 6))
        )
        for _ in range(count)
    ]
    return [Document(f"{name}/doc{number}", {"txt": text}) for number, text in enumerate(texts)]


def build_source(root: Path, name: str, count: int) -> Path:
    out = root / name
    build_shards(documents(name, count), out, [name], BuildSettings(0.25, max_shard_samples=3), show_progress=False)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three text shard sets: `a` and `b` of a dozen training shards (about 150 blocks of 32 bytes), `c` of a
    few (it runs out)."""
    root = tmp_path_factory.mktemp("mixture")
    built = {"a": build_source(root, "a", 48), "b": build_source(root, "b", 48), "c": build_source(root, "c", 10)}
    assert all(len(Manifest.load(path).urls("train")) >= 8 for path in (built["a"], built["b"]))
    return built


def source_of_tokens(tokens: list[int]) -> str:
    """The source a block's text is written in."""
    characters = set(ByteTokenizer().decode(tokens)) - set(" \n")
    (name,) = [name for name, letters in ALPHABETS.items() if characters <= set(letters)]
    return name


def shard_stream(directory: Path, max_epochs: int | None = None) -> ShardStream:
    urls = Manifest.load(directory).urls("train")
    format = PackedBlocks(ByteTokenizer(), BLOCK)
    return ShardStream(urls, format, SEED, BUFFER, max_epochs=max_epochs, source=directory.name)


def settings(**weights: float) -> list[SourceSettings]:
    return [SourceSettings(name, "", weight, key=f"data.sources.{name}") for name, weight in weights.items()]


# --- the mixture: each source's share ----------------------------------------------------------------------


@pytest.mark.parametrize("weights", [{"a": 0.7, "b": 0.3}, {"a": 0.5, "b": 0.3, "c": 0.2}], ids=["70-30", "50-30-20"])
def test_every_window_of_1000_steps_gives_each_source_its_weight_within_one_point(weights: dict[str, float]) -> None:
    """The source of the run's k-th example (k = step x global batch + place in the step) over 6,000 steps
    of 16: every window of 1,000 consecutive steps, and windows far into a run, within 1 percentage point
    of each weight (a random draw's shares stray 3 standard deviations, about 1 point, somewhere)."""
    global_batch, window, steps = 16, 1000, 6000
    for seed in (0, 1234):
        mixture = Mixture(settings(**weights), seed)
        for first_step in (0, 10**9, 2**40 + 12345):  # a run's start, and steps no run reaches
            first = first_step * global_batch
            drawn = np.array([mixture.source_of(k) for k in range(first, first + steps * global_batch)])
            per_step = np.stack([(drawn == index).reshape(steps, global_batch).sum(1) for index in range(len(weights))])
            cumulative = np.concatenate([np.zeros((len(weights), 1)), per_step.cumsum(1)], axis=1)
            shares = (cumulative[:, window:] - cumulative[:, :-window]) / (window * global_batch)  # every window start
            expected = np.array(list(weights.values()))[:, None]
            assert np.abs(shares - expected).max() < 0.01, (seed, first_step)
            # Much better than a random draw: within a few examples of each weight, and every step of 16 within
            # two examples of each weight's share of it.
            assert np.abs(shares - expected).max() * window * global_batch < 8
            assert np.abs(per_step - expected * global_batch).max() < 2


def test_the_source_of_an_example_is_a_function_of_the_seed_and_its_index() -> None:
    mixture = Mixture(settings(a=0.7, b=0.3), 5)
    drawn = [mixture.source_of(k) for k in range(1000)]
    assert drawn == [Mixture(settings(a=0.7, b=0.3), 5).source_of(k) for k in range(1000)]
    assert drawn != [Mixture(settings(a=0.7, b=0.3), 6).source_of(k) for k in range(1000)]
    # A source of weight 0 never gives an example; one out of the mixture neither, its weight shared by the rest.
    assert {Mixture(settings(a=0.7, b=0.0, c=0.3), 5).source_of(k) for k in range(1000)} == {0, 2}
    assert {mixture.source_of(k, out=frozenset({0})) for k in range(1000)} == {1}


# --- the stream of a mixture -------------------------------------------------------------------------------


def mixed_datamodule(
    paths: Mapping[str, Path], weights: Mapping[str, float], workers: int = 0, **kwargs: Any
) -> ShardDataModule:
    """Blocks of 32 bytes, 16 per step from 4 streams."""
    extra = kwargs.pop("source_settings", {})
    sources = {
        name: {"dir": str(paths[name]), "weight": weight} | extra.get(name, {}) for name, weight in weights.items()
    }
    options = {"global_batch_size": 16, "streams": 4, "num_workers": workers, "shuffle_buffer": BUFFER, "seed": SEED}
    return ShardDataModule(None, ByteTokenizer(), packed_blocks(BLOCK), sources=sources, **(options | kwargs))


def consume(module: ShardDataModule, batches: int) -> list[list[tuple[str, int, tuple[int, ...]]]]:
    """The (source, sample id, tokens) of the next `batches` training batches, each passed through the
    module's hook as the training loop does."""
    loader = iter(module.train_dataloader())
    taken = []
    for _ in range(batches):
        batch = module.on_before_batch_transfer(next(loader), 0)
        tokens = batch["tokens"].tolist()
        taken.append([(source_of_tokens(t), int(i), tuple(t)) for t, i in zip(tokens, batch["sample_id"], strict=True)])
    return taken


def test_a_datamodules_batches_come_from_the_sources_the_mixture_names_and_it_counts_them(
    sources: dict[str, Path],
) -> None:
    """200 steps of 16 examples: each example is of the source the mixture names for its index in the run,
    and the counts the module keeps (and saves) are the mixture's."""
    module = mixed_datamodule(sources, {"a": 0.7, "b": 0.3})
    steps = 200
    batches = consume(module, steps)
    mixture = Mixture(settings(a=0.7, b=0.3), SEED)
    expected = [mixture.source_of(k) for k in range(steps * 16)]
    assert [source for batch in batches for source, _, _ in batch] == [["a", "b"][index] for index in expected]
    assert module.position.drawn == [expected.count(0), expected.count(1)]
    assert module.state_dict()["drawn"] == {"a": expected.count(0), "b": expected.count(1)}
    assert abs(expected.count(0) / len(expected) - 0.7) < 0.001
    # A sample id names one example of the run (the MLM masks and the batch log go by it), whatever its source:
    # over the first pass of each, as many ids as different examples.
    first_pass = {(source, tokens): sample_id for batch in batches[:8] for source, sample_id, tokens in batch}
    assert len(set(first_pass.values())) == len(first_pass) == 8 * 16


def stream_batches(
    paths: Mapping[str, Path],
    weights: Mapping[str, float],
    plan: BatchPlan,
    rank: int,
    count: int,
    workers: int,
    **state,
) -> list[dict[str, torch.Tensor]]:
    """The first `count` micro-batches of a rank of a mixture, through a DataLoader with `workers` workers."""
    streams = [shard_stream(paths[name]) for name in weights]
    mixture = Mixture(settings(**weights), SEED)
    stream = BatchStream(streams, plan, rank, mixture=mixture, **state)
    return list(itertools.islice(iter(training_loader(stream, workers, pin_memory=False)), count))


def per_step(plan: BatchPlan, ranks: list[list[dict[str, torch.Tensor]]], steps: int) -> list[list[tuple]]:
    """Each step's (sample id, tokens) over all devices, in slot order."""
    per = plan.accumulation
    return [
        [
            (int(i), tuple(t))
            for rank in ranks
            for batch in rank[step * per : (step + 1) * per]
            for i, t in zip(batch["sample_id"], batch["tokens"].tolist(), strict=True)
        ]
        for step in range(steps)
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_layout_of_devices_and_micro_batches_draws_each_example_from_the_same_source(
    sources: dict[str, Path], workers: int
) -> None:
    weights = {"a": 0.7, "b": 0.3}
    layouts = [(None, 1), (2, 1), (4, 2), (2, 4), (None, 4)]  # (micro-batch, devices) of a global batch of 8
    steps = []
    for micro, devices in layouts:
        plan = batch_plan(8, micro, 4, devices)
        ranks = [
            stream_batches(sources, weights, plan, rank, 5 * plan.accumulation, workers) for rank in range(devices)
        ]
        steps.append(per_step(plan, ranks, 5))
    assert all(other == steps[0] for other in steps[1:])
    mixture = Mixture(settings(**weights), SEED)
    drawn = [source_of_tokens(list(tokens)) for step in steps[0] for _, tokens in step]
    assert drawn == [["a", "b"][mixture.source_of(k)] for k in range(40)]
    assert {"a", "b"} <= set(drawn[:8])  # the sources interleave within a step


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixed_batch_stream_resumes_exactly_on_any_number_of_devices(sources: dict[str, Path], workers: int) -> None:
    weights = {"a": 0.6, "b": 0.4}
    single = batch_plan(8, 2, 4, 1)
    reference = per_step(single, [stream_batches(sources, weights, single, 0, 9 * single.accumulation, workers)], 9)
    # Two devices run 4 steps and keep the cursors of each (source, sub-stream) of the batches they consumed.
    plan = batch_plan(8, 2, 4, 2)
    cursors = {}
    for rank in (0, 1):
        for batch in stream_batches(sources, weights, plan, rank, 4 * plan.accumulation, workers):
            cursors |= {
                (source, sub): Cursor(shard, block) for source, sub, shard, block in batch["positions"].tolist()
            }
    assert {source for source, _ in cursors} == {0, 1}  # both sources have a position
    # One device, or four, continues from them at step 4 exactly where the uninterrupted run went.
    for continued in (single, batch_plan(8, None, 4, 4)):
        count = 5 * continued.accumulation
        ranks = [
            stream_batches(
                sources, weights, continued, rank, count, workers, cursors=cursors, start=4 * continued.accumulation
            )
            for rank in range(continued.world_size)
        ]
        assert per_step(continued, ranks, 5) == reference[4:]


# --- the DataModule's state ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_restoring_a_mixtures_position_after_any_number_of_batches_continues_exactly(
    sources: dict[str, Path], workers: int
) -> None:
    """Restart points inside shards and across epochs of either source (every one with the batches read in the
    main process, a few with two workers: each start of theirs takes a second) continue each source exactly,
    and keep its counts."""
    weights, total = {"a": 0.7, "b": 0.3}, 24  # about 2 epochs of a, most of one of b
    whole = mixed_datamodule(sources, weights, workers)
    reference = consume(whole, total)
    for consumed in range(total) if workers == 0 else (5, 16):
        first = mixed_datamodule(sources, weights, workers)
        consume(first, consumed)
        state = first.state_dict()
        assert (
            state["format"] == 3 and state["steps"] == consumed and state["phases"] == [{"step": 0, "weights": weights}]
        )
        assert {name for name, *_ in state["cursors"]} == ({"a", "b"} if consumed else set())
        restored = mixed_datamodule(sources, weights, workers)
        restored.load_state_dict(state)
        assert consume(restored, total - consumed) == reference[consumed:], f"restart after {consumed} batches"
        assert restored.position.drawn == whole.position.drawn and restored.position.phases == whole.position.phases


def test_a_source_added_to_a_run_starts_from_its_beginning_and_the_first_continues(sources: dict[str, Path]) -> None:
    """A run on data.dir=<a> continued on a mixture of a (the same directory, so the same name) and b: a from its
    cursors, b from its start, under a phase of the new weights."""
    continue_with_a_source_added(sources, lambda state: state)


def continue_with_a_source_added(sources: dict[str, Path], saved: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The test above, from the position `saved` makes of the first run's (tests/test_compat.py: format 2's)."""
    options = {"global_batch_size": 16, "streams": 4, "num_workers": 0, "shuffle_buffer": BUFFER, "seed": SEED}
    first = ShardDataModule(str(sources["a"]), ByteTokenizer(), packed_blocks(BLOCK), **options)
    before = {tokens for batch in consume(first, 6) for _, _, tokens in batch}  # 96 of a's 138 blocks
    state = saved(first.state_dict())
    mixed = mixed_datamodule(sources, {"a": 0.5, "b": 0.5})
    with pytest.warns(UserWarning, match=r"shards of data\.sources\.b\.dir are not the checkpoint's: they are read"):
        mixed.load_state_dict(state)
    assert mixed.position.phases == [{"step": 0, "weights": {"a": 1.0}}, {"step": 6, "weights": {"a": 0.5, "b": 0.5}}]
    after = consume(mixed, 2)
    counts = Counter(Mixture(settings(a=0.5, b=0.5), SEED).source_of(k) for k in range(6 * 16, 8 * 16))
    assert mixed.position.drawn == [6 * 16 + counts[0], counts[1]]
    assert before.isdisjoint(tokens for batch in after for source, _, tokens in batch if source == "a")  # a goes on
    # b from its start: each stream (4 rows of a batch) reads b's examples from the first.
    from_start = by_stream(consume(mixed_datamodule(sources, {"a": 0.5, "b": 0.5}), 4), "b")
    for stream, read in by_stream(after, "b").items():
        assert read == from_start[stream][: len(read)]


def test_a_source_under_another_name_continues_where_the_same_shards_stopped(sources: dict[str, Path]) -> None:
    """A run on data.dir=<a> continued on a mixture that names that directory `code`: the source of the same
    version continues from a's cursors (not from its start, which would train on what it trained on)."""
    options = {"global_batch_size": 16, "streams": 4, "num_workers": 0, "shuffle_buffer": BUFFER, "seed": SEED}
    first = ShardDataModule(str(sources["a"]), ByteTokenizer(), packed_blocks(BLOCK), **options)
    before = {tokens for batch in consume(first, 6) for _, _, tokens in batch}
    renamed = {"code": {"dir": str(sources["a"]), "weight": 0.5}, "b": {"dir": str(sources["b"]), "weight": 0.5}}
    mixed = ShardDataModule(None, ByteTokenizer(), packed_blocks(BLOCK), sources=renamed, **options)
    with pytest.warns(UserWarning, match=r"shards of data\.sources\.b\.dir are not the checkpoint's"):
        mixed.load_state_dict(first.state_dict())
    assert {sub: cursor for (source, sub), cursor in mixed.position.cursors.items() if source == 0} == {
        sub: cursor for (_, sub), cursor in first.position.cursors.items()
    }
    after = consume(mixed, 2)
    assert before.isdisjoint(tokens for batch in after for source, _, tokens in batch if source == "a")


def test_only_the_checkpoint_where_a_source_stopped_the_run_refuses_to_continue(sources: dict[str, Path]) -> None:
    """Saved after c ran out but before the logging step that stops, a checkpoint continues as any other (the
    run it continues stops at that step); the one saved where it stopped refuses the same cap."""
    capped = {"c": {"max_epochs": 1, "exhausted": "stop"}}
    module = mixed_datamodule(sources, {"a": 0.5, "c": 0.5}, streams=2, source_settings=capped)
    loader = iter(module.train_dataloader())
    while not module.position.ran_out:
        module.on_before_batch_transfer(next(loader), 0)
    before_the_stop = module.state_dict()
    assert module.position.stop_reason([False, True]) is not None  # what DataCounts calls at the logging step
    stopped = module.state_dict()
    again = mixed_datamodule(sources, {"a": 0.5, "c": 0.5}, streams=2, source_settings=capped)
    again.load_state_dict(before_the_stop)
    assert again.position.ran_out == {1}  # it goes on, and stops at its own logging step
    with pytest.raises(ShardError, match=r"data\.sources\.c ran out before this checkpoint .* stopped the run"):
        mixed_datamodule(sources, {"a": 0.5, "c": 0.5}, streams=2, source_settings=capped).load_state_dict(stopped)
    raised = {"c": {"max_epochs": 2, "exhausted": "stop"}}
    mixed_datamodule(sources, {"a": 0.5, "c": 0.5}, streams=2, source_settings=raised).load_state_dict(stopped)


def by_stream(batches: list[list[tuple[str, int, tuple[int, ...]]]], source: str) -> dict[int, list[tuple[int, ...]]]:
    """The examples of `source` that each of the 4 streams gave to steps of 16 (one micro-batch each)."""
    read: dict[int, list[tuple[int, ...]]] = {stream: [] for stream in range(4)}
    for batch in batches:
        for row, (name, _, tokens) in enumerate(batch):
            if name == source:
                read[row // 4].append(tokens)
    return read


# --- caps on a source's repetitions ------------------------------------------------------------------------------


def one_pass(directory: Path) -> list[tuple[int, ...]]:
    """The blocks of one pass over a source's training shards."""
    return [tuple(item.example.tokens) for item in shard_stream(directory, max_epochs=1).examples(0, 1, Cursor())]


def test_a_source_that_runs_out_fills_nothing_twice_and_names_the_stop_and_its_fixes(sources: dict[str, Path]) -> None:
    capped = {"c": {"max_epochs": 1, "exhausted": "stop"}}
    module = mixed_datamodule(sources, {"a": 0.5, "c": 0.5}, streams=2, source_settings=capped)
    loader = iter(module.train_dataloader())
    for _ in range(100):
        module.on_before_batch_transfer(next(loader), 0)
    position = module.position
    assert position.ran_out == {1} and position.drawn[1] == len(one_pass(sources["c"]))  # each block of c once, then a
    assert position.stop_reason([False, False]) is None
    message = position.stop_reason([False, True])
    assert message is not None and message.startswith("data.sources.c has run out: its shards were read max_epochs=1")
    assert "raise data.sources.c.max_epochs, or pass ++data.sources.c.exhausted=renormalise" in message
    assert "continue with resume_allow=[mixture]" in message


def test_a_run_whose_source_runs_out_saves_stops_and_goes_on_only_with_a_higher_cap(
    compose_train: ComposeTrain, tmp_path: Path, sources: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    def capped(max_epochs: int) -> list[str]:
        entries = f"a:{{dir:'{sources['a']}',weight:0.5}},c:{{dir:'{sources['c']}',weight:0.5,max_epochs:{max_epochs}}}"
        return ["data.dir=null", f"data.sources={{{entries}}}", "trainer.val_check_interval=100"]

    steps = ["trainer.max_steps=300", "trainer.log_every_n_steps=5"]
    with pytest.warns(UserWarning, match=r"data\.sources\.c has run out: .* saving and stopping"):
        train(compose_train(*capped(1), *steps))
    (saved,) = [int(path.stem.split("-")[1]) for path in (tmp_path / "checkpoints").glob("step-*.ckpt")]
    assert saved < 300 and saved % 5 == 0  # stopped at a logging step, where every rank agrees, and saved it
    # The summary says why and how to go on (not "run the same command", which is refused).
    assert f"stopped at step {saved} of trainer.max_steps=300: data.sources.c has run out" in caplog.text
    assert "run the same command" not in caplog.text
    with pytest.raises(ShardError, match=r"data\.sources\.c ran out before this checkpoint .* raise data\.sources\.c"):
        train(compose_train(*capped(1), *steps))  # the same command: refused, nothing trained
    assert not (tmp_path / "checkpoints" / f"step-{saved + 5:06d}.ckpt").exists()
    train(compose_train(*capped(2), "trainer.max_steps=" + str(saved + 5), "resume_allow=[mixture]"))
    assert (tmp_path / "checkpoints" / f"step-{saved + 5:06d}.ckpt").exists()  # a second pass of c


def test_a_source_that_runs_out_under_renormalise_gives_its_weight_to_the_others(sources: dict[str, Path]) -> None:
    """c (a third of the mixture) gives each of its blocks once, then the run goes on with a alone; once a
    runs out too, nothing is left."""
    capped = {"a": {"max_epochs": 3, "exhausted": "renormalise"}, "c": {"max_epochs": 1, "exhausted": "renormalise"}}
    module = mixed_datamodule(sources, {"a": 0.7, "c": 0.3}, streams=2, source_settings=capped)
    loader = iter(module.train_dataloader())
    drawn: list[str] = []
    with pytest.warns(
        UserWarning, match=r"data\.sources\.c has run out at step \d+ \(data\.sources\.c\.max_epochs=1\)"
    ):
        while len(drawn) < 24 * 16:
            batch = module.on_before_batch_transfer(next(loader), 0)
            drawn += [source_of_tokens(tokens) for tokens in batch["tokens"].tolist()]
    last_c = max(index for index, source in enumerate(drawn) if source == "c")
    assert drawn.count("c") == len(one_pass(sources["c"])) == module.position.drawn[1]  # each block of c once
    assert set(drawn[last_c + 1 :]) == {"a"} and len(drawn) - last_c > 100  # then a alone
    with (
        pytest.warns(UserWarning, match=r"data\.sources\.a has run out at step \d+ \(data\.sources\.a\.max_epochs=3\)"),
        pytest.raises(ShardError, match=r"at step \d+ every source with weight has run out .* raise a cap"),
    ):
        for _ in range(100):
            module.on_before_batch_transfer(next(loader), 0)
    assert len(one_pass(sources["a"])) * 2 < module.position.drawn[0] <= 3 * len(one_pass(sources["a"]))


def test_a_mixture_resumes_exactly_after_a_source_ran_out(sources: dict[str, Path]) -> None:
    """Three sources, c capped at one pass and renormalised: restored after c has run out (on some
    sub-streams, or all), the run draws from a and b exactly what the uninterrupted run drew."""
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    capped = {"c": {"max_epochs": 1, "exhausted": "renormalise"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # c's running out, on each sub-stream
        reference = consume(mixed_datamodule(sources, weights, streams=2, source_settings=capped), 30)
        out = next(
            step
            for step, batch in enumerate(reference)
            if all(s != "c" for s, _, _ in itertools.chain(*reference[step:]))
        )
        assert 3 < out < 25
        for consumed in (out - 2, out, out + 3):
            first = mixed_datamodule(sources, weights, streams=2, source_settings=capped)
            consume(first, consumed)
            restored = mixed_datamodule(sources, weights, streams=2, source_settings=capped)
            restored.load_state_dict(first.state_dict())
            assert consume(restored, 30 - consumed) == reference[consumed:], f"restart after {consumed} batches"


# --- a real run ----------------------------------------------------------------------------------------------


def mixture_overrides(paths: Mapping[str, Path], **weights: float) -> list[str]:
    """data.dir=null and data.sources as a Hydra override: {a:{dir:'<dir>',weight:0.7},...}."""
    entries = ",".join(f"{name}:{{dir:'{paths[name]}',weight:{weight}}}" for name, weight in weights.items())
    return ["data.dir=null", f"data.sources={{{entries}}}"]


def run_metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as file:
        return list(csv.DictReader(file))


def test_a_run_on_a_mixture_validates_each_source_counts_them_and_records_them(
    compose_train: ComposeTrain,
    tmp_path: Path,
    sources: dict[str, Path],
    capsys: pytest.CaptureFixture,
    recwarn: pytest.WarningsRecorder,
) -> None:
    cfg = compose_train(*mixture_overrides(sources, a=0.7, b=0.3))
    metrics = train(cfg)
    assert not [warning for warning in recwarn if "in eval mode" in str(warning.message)]  # b's validation states
    rows = run_metrics(tmp_path)
    validated = [row for row in rows if row.get("val/bpb")]
    assert [int(row["step"]) for row in validated] == [0, 6, 12]
    for row in validated:  # each source's, and the mean weighted as the mixture weighs them
        for metric in ("bpb", "loss"):
            each = {name: float(row[f"val/{name}/{metric}"]) for name in ("a", "b")}
            assert each["a"] != each["b"]
            assert float(row[f"val/{metric}"]) == pytest.approx(0.7 * each["a"] + 0.3 * each["b"], rel=1e-5)
    assert metrics["val/bpb"] == pytest.approx(float(validated[-1]["val/bpb"]), rel=1e-6)
    # The examples each source gave (the mixture's, of the 4 a step trained on), as tokens and shares: logged
    # after 10 steps (trainer.log_every_n_steps) and reported at the last.
    mixture = Mixture(settings(a=0.7, b=0.3), cfg.data.seed)
    counts = {steps: Counter(mixture.source_of(k) for k in range(steps * 4)) for steps in (10, 12)}
    (logged,) = [row for row in rows if row.get("data/a/share")]
    assert float(logged["data/a/share"]) == pytest.approx(counts[10][0] / 40) and int(logged["step"]) == 9
    assert float(logged["data/b/tokens"]) == counts[10][1] * 64  # blocks of 64 tokens
    assert metrics["data/a/share"] == pytest.approx(counts[12][0] / 48) and abs(counts[12][0] / 48 - 0.7) < 0.03
    assert (
        metrics["data/b/share"] == pytest.approx(counts[12][1] / 48) and metrics["data/a/tokens"] == counts[12][0] * 64
    )
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    lineage = checkpoint["lineage"]
    versions = {name: Manifest.load(sources[name]).version for name in ("a", "b")}
    assert lineage["sources"] == {name: {"dir": str(sources[name]), "version": versions[name]} for name in "ab"}
    assert lineage["mixture"] == {
        name: {"weight": weight, "max_epochs": None, "exhausted": "stop", "fields": {"text_field": "txt"}}
        for name, weight in (("a", 0.7), ("b", 0.3))
    }
    assert lineage["mixture_phases"] == [{"step": 0, "weights": {"a": 0.7, "b": 0.3}}]
    assert lineage["data_version"] not in versions.values()
    assert checkpoint["ShardDataModule"]["drawn"] == {"a": counts[12][0], "b": counts[12][1]}

    last = tmp_path / "checkpoints" / "last.ckpt"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        eval_cfg = compose("eval", overrides=[f"ckpt_path={last}", f"paths.output_dir={tmp_path}", "max_new_tokens=4"])
    result = evaluate(eval_cfg)  # the checkpoint's mixture, validated again (its first validation: b's starts empty)
    for key in ("val/bpb", "val/a/bpb", "val/b/bpb"):
        assert result[key] == pytest.approx(metrics[key], abs=1e-5), key
    assert "note" not in result  # the same data version

    capsys.readouterr()
    info_main([str(tmp_path / "checkpoints" / "last.ckpt")])
    printed = capsys.readouterr().out
    assert re.search(rf"\ndata +version {lineage['data_version']} from a mixture of\n", printed)
    for name, weight in (("a", 0.7), ("b", 0.3)):
        assert re.search(rf"\n  {name} +weight {weight}: version {versions[name]} from {sources[name]}\n", printed)
    assert re.search(r"\n  phase +from step 0: a 0.7, b 0.3\n", printed)


def test_other_weights_on_resume_are_refused_unless_allowed_and_every_source_continues(
    compose_train: ComposeTrain, tmp_path: Path, sources: dict[str, Path]
) -> None:
    logged = ["callbacks=[default,batch_log]", "trainer.max_steps=6"]
    cfg = compose_train(*mixture_overrides(sources, a=0.7, b=0.3), *logged)
    train(cfg)
    checkpoints = tmp_path / "checkpoints"
    reweighed = mixture_overrides(sources, a=0.2, b=0.8)
    with pytest.raises(CheckpointError) as refused:
        train(compose_train(*reweighed, "trainer.max_steps=12"))
    message = str(refused.value)
    assert (
        "mixture: the checkpoint has {'a': {'weight': 0.7" in message and "this run has {'a': {'weight': 0.2" in message
    )
    assert "use the data.sources weights, max_epochs, exhausted and fields it was trained with" in message
    assert "pass resume_allow=[mixture]" in message
    assert not (checkpoints / "step-000012.ckpt").exists()

    train(compose_train(*reweighed, *logged[:1], "trainer.max_steps=12", "resume_allow=[mixture]"))
    checkpoint = load_checkpoint(checkpoints / "step-000012.ckpt")
    assert checkpoint["lineage"]["mixture_phases"] == [
        {"step": 0, "weights": {"a": 0.7, "b": 0.3}},
        {"step": 6, "weights": {"a": 0.2, "b": 0.8}},
    ]
    assert checkpoint["lineage"]["mixture"]["a"]["weight"] == 0.2
    # Steps 1 to 6 drew from the first weights, 7 to 12 from the second: the counts saved are theirs.
    before, after = Mixture(settings(a=0.7, b=0.3), cfg.data.seed), Mixture(settings(a=0.2, b=0.8), cfg.data.seed)
    drawn = Counter(before.source_of(k) for k in range(24)) + Counter(after.source_of(k) for k in range(24, 48))
    assert checkpoint["ShardDataModule"]["drawn"] == {"a": drawn[0], "b": drawn[1]}
    # Each source continued from its cursors: nothing trained before the change is trained again after it.
    log = read_batch_log(tmp_path / "batches" / "rank0.jsonl")
    assert sorted(log) == list(range(1, 13))
    trained = [{i for batch in range(first, first + 6) for i in log[batch]["samples"]} for first in (1, 7)]
    assert len(trained[0]) == len(trained[1]) == 24 and trained[0].isdisjoint(trained[1])


# --- bad mixtures: refused before any data is read ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pair shards (query.txt, passage.txt): queries in c's characters, passages in b's."""
    queries, passages = documents("c", 24), documents("b", 24)
    pairs = [
        Document(f"pair{number}", {"query.txt": query.texts["txt"], "passage.txt": passage.texts["txt"]})
        for number, (query, passage) in enumerate(zip(queries, passages, strict=True))
    ]
    out = tmp_path_factory.mktemp("mixture") / "pairs"
    settings = BuildSettings(0.25, max_shard_samples=3)
    build_shards(pairs, out, ["pairs"], settings, show_progress=False, fields=PAIR_FIELDS)
    return out


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> Path:
    """A shard directory whose manifest lists validation shards and no training ones."""
    out = tmp_path_factory.mktemp("mixture") / "empty"
    shutil.copytree(sources["c"], out)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["splits"]["train"]["shards"] = []
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def test_a_source_reads_its_own_fields(sources: dict[str, Path], pairs: Path) -> None:
    """The docstrings of pair shards as a text source (data=mixture's): only the query side is read."""
    docstrings = {"dir": str(pairs), "weight": 0.5, "fields": {"text_field": "query.txt"}}
    module = ShardDataModule(
        None,
        ByteTokenizer(),
        packed_blocks(BLOCK),
        global_batch_size=8,
        streams=2,
        num_workers=0,
        sources={"a": {"dir": str(sources["a"])}, "docstrings": docstrings},
    )
    drawn = {source for batch in consume(module, 4) for source, _, _ in batch}
    assert drawn == {"a", "c"}  # c's characters: the queries, never the passages (b's)
    assert module.mixture_settings["docstrings"]["fields"] == {"text_field": "query.txt"}
    assert len(module.validation_sets[1]) > 0


NOWHERE = "/nonexistent/shards"  # a source's directory that the config checks come before
A, NOT_A_NUMBER = {"dir": "{a}"}, r"a weight is a finite number >= 0 \(its share of the training tokens\)"
# (data.dir, data.sources, the error, its message), filled with the directories of the test.
BAD_MIXTURES = {
    "negative_weight": (
        None,
        {"a": {"dir": NOWHERE, "weight": -0.5}},
        ConfigError,
        rf"\.a\.weight=-0\.5: {NOT_A_NUMBER}",
    ),
    "weight_not_a_number": (None, {"a": {"dir": NOWHERE, "weight": "heavy"}}, ConfigError, r"\.a\.weight='heavy': a"),
    "infinite_weight": (None, {"a": {"dir": NOWHERE, "weight": float("inf")}}, ConfigError, r"\.a\.weight=inf: a"),
    "all_weights_zero": (
        None,
        {"a": {"dir": NOWHERE, "weight": 0}, "b": {"dir": NOWHERE, "weight": 0.0}},
        ConfigError,
        r"the weights of data\.sources are all zero: give at least one source a positive weight",
    ),
    "weights_sum_overflows": (
        None,
        {"a": {"dir": NOWHERE, "weight": 1e308}, "b": {"dir": NOWHERE, "weight": 1e308}},
        ConfigError,
        r"data\.sources\.a\.weight=1e\+308, data\.sources\.b\.weight=1e\+308: their sum \(inf\) is out of a "
        r"float's range; a weight is a share, so scale them in proportion",
    ),
    "weights_sum_too_small": (
        None,
        {"a": {"dir": NOWHERE, "weight": 1e-320}},
        ConfigError,
        r"data\.sources\.a\.weight=9\.99989e-321: their sum \(9\.99989e-321\) is out of a float's range",
    ),
    "dir_and_sources": (
        "{a}",
        {"a": {"dir": NOWHERE}},
        ConfigError,
        r"set exactly one of data\.dir .* and data\.sources",
    ),
    "neither": (None, None, ConfigError, r"set exactly one .* got data\.dir=None and data\.sources=None \(set the"),
    "no_source": (None, {}, ConfigError, r"data\.sources is empty: name at least one shard directory"),
    "no_dir": (
        None,
        {"a": {"weight": 0.5}},
        ConfigError,
        r"\.a has no dir: set data\.sources\.a\.dir=<shard directory>",
    ),
    "empty_entry": (None, {"a": None}, ConfigError, r"data\.sources\.a has no dir"),
    "unknown_key": (
        None,
        {"a": {"dir": NOWHERE, "colour": "red"}},
        ConfigError,
        r"\.a\.colour is not a setting of a source: a source has dir, weight, max_epochs, exhausted, fields",
    ),
    "max_epochs_0": (None, {"a": {"dir": NOWHERE, "max_epochs": 0}}, ConfigError, r"\.a\.max_epochs=0: a whole number"),
    "exhausted": (
        None,
        {"a": {"dir": NOWHERE, "exhausted": "wrap"}},
        ConfigError,
        r"\.exhausted='wrap': use one of stop",
    ),
    "fields_length": (
        None,
        {"a": {"dir": NOWHERE, "fields": {"block_size": 8}}},
        ConfigError,
        r"\.a\.fields\.block_size: a source names only its sample fields, which data\.format names as text_field",
    ),
    "dir_missing": (
        None,
        {"a": A, "b": {"dir": "{tmp}/missing"}},
        ShardError,
        r"data\.sources\.b\.dir={tmp}/missing: the directory does not exist",
    ),
    "no_training_shards": (
        None,
        {"a": A, "e": {"dir": "{empty}"}},
        ShardError,
        r"data\.sources\.e\.dir={empty}: its manifest \(.*manifest\.json\) lists no training shards",
    ),
    "fields_not_in_shards": (
        None,
        {"a": A, "p": {"dir": "{pairs}"}},
        ShardError,
        r"data\.format\.text_field='txt': not a field of every sample in {pairs}, whose samples all have "
        r"query\.txt, passage\.txt: every source of a mixture needs them: give data\.sources\.p its own, "
        r"\+\+data\.sources\.p\.fields\.text_field=<one of those>",
    ),
    "own_fields_not_in_shards": (
        None,
        {"a": A, "p": {"dir": "{pairs}", "fields": {"text_field": "title.txt"}}},
        ShardError,
        r"data\.sources\.p\.fields\.text_field='title\.txt': not a field of every sample in {pairs}",
    ),
}


@pytest.mark.parametrize(("dir", "entries", "error", "message"), BAD_MIXTURES.values(), ids=BAD_MIXTURES.keys())
def test_a_bad_mixture_is_refused_naming_its_key_before_any_shard_is_read(
    sources: dict[str, Path],
    pairs: Path,
    empty: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dir: str | None,
    entries: dict[str, Any] | None,
    error: type[Exception],
    message: str,
) -> None:
    """Each refused as the module is made, with the key to change; the config's mistakes before any directory
    is looked at (their sources' directories do not exist), and no shard read for its checksum (a's, say,
    which can take minutes) before a later source's mistake is found."""
    paths = {"a": sources["a"], "pairs": pairs, "empty": empty, "tmp": tmp_path}
    checksummed: list[str] = []
    monkeypatch.setattr(manifest_module, "checksum_problem", lambda url, *args: checksummed.append(url))

    def filled(value: Any) -> Any:
        if isinstance(value, str):
            return value.format(**paths)
        return {key: filled(item) for key, item in value.items()} if isinstance(value, dict) else value

    with pytest.raises(error, match=filled(message)):
        ShardDataModule(
            filled(dir), ByteTokenizer(), packed_blocks(BLOCK), global_batch_size=4, sources=filled(entries)
        )
    assert checksummed == []


def test_a_bad_mixture_on_the_command_line_stops_before_any_work(
    compose_train: ComposeTrain, tmp_path: Path, sources: dict[str, Path]
) -> None:
    """Through the run's own path, each an error of ours (printed alone, no traceback: tests/test_errors.py)."""
    for overrides, message in [
        (mixture_overrides(sources, a=-1, b=1), r"data\.sources\.a\.weight=-1: a weight is a finite number >= 0"),
        (mixture_overrides(sources, a=1e308, b=1e308), r"data\.sources\.a\.weight=1e\+308, .*: their sum \(inf\)"),
        (mixture_overrides(sources, a=0.5, b=0.5)[1:], r"set exactly one of data\.dir .* and data\.sources"),
        (
            ["tokenizer=bpe", *mixture_overrides(sources, a=0.5, b=0.5)],
            r"tokenizer\.path=\$\{data\.dir\}/tokenizer\.json, and a mixture \(data\.sources\) has no data\.dir: its "
            r"sources share one tokenizer; pass tokenizer\.path=<tokenizer\.json>",
        ),
    ]:
        with pytest.raises(PretrainingError, match=message):
            train(compose_train(*overrides))
        assert not (tmp_path / "checkpoints").exists()
    # A tokenizer named, the mixture's config passes.
    check_config(compose_train("tokenizer=bpe", "tokenizer.path=/any/tokenizer.json", *mixture_overrides(sources, a=1)))


def test_the_mixture_preset_reads_code_and_its_docstrings(
    compose_train: ComposeTrain, tmp_path: Path, sources: dict[str, Path], pairs: Path
) -> None:
    """data=mixture over the corpus `make data` builds (here a's text as the code, the pairs' queries as its
    docstrings)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stdlib").symlink_to(sources["a"])
    (tmp_path / "data" / "stdlib_pairs").symlink_to(pairs)
    cfg = compose_train("data=mixture", f"paths.data_dir={tmp_path / 'data'}", "data.dir=null")
    module = build(cfg.data, tokenizer=ByteTokenizer())
    assert module.position.weights == {"code": 0.7, "docstrings": 0.3}
    fields = [source.format.field_keys["text_field"] for source in module.sources]
    assert fields == ["txt", "query.txt"]
