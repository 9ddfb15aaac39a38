"""A NaN run never looks like the best run: a validation with non-finite values reads NaN (never lower) and counts
them (`val/nonfinite_batches`), with torchmetrics' own classes; a run with no finite result fails (exit status,
status.json, no value for a sweeper), and so does its evaluation, without a traceback; a refused re-run leaves the
records of the run it refused as they were."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY
from pretraining.callbacks.numerics import NumericalError, check_result
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.run_lock import CONFIG_COPIES, STATUS_FILE
from test_contrastive import pair_batch, tiny_contrastive
from test_resume import TEST_ENV, pretrain_command, run_dir

VOCAB = 260
# A Llama whose rotary angles are NaN (base 1e-300 is 0 in float32), a value every range admits: every loss is
# NaN, so the numerics guard skips every step, and every validation batch is NaN.
NAN_MAKING = ["model/backbone=llama", "model.backbone.rope_theta=1e-300"]


def tiny_causal_lm() -> CausalLM:
    backbone = Transformer(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2, causal=True)
    return CausalLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-3))


def block_batch(seed: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(4, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "target_bytes": torch.ones(2, 16, dtype=torch.long)}


def validated(model: PretrainingObjective, batches: list[dict[str, torch.Tensor]], bad: dict[int, float]) -> dict:
    """The validation metrics of `batches`, the first float of the `bad` batches' values set to that value."""
    real_update = model.validation_update

    def update(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = real_update(batch)
        if id(batch) in bad:
            name = next(name for name, value in values.items() if value.is_floating_point())
            values[name] = values[name].clone()
            values[name].view(-1)[0] = bad[id(batch)]
        return values

    model.validation_update = update  # type: ignore[method-assign]
    with torch.no_grad():
        for index, batch in enumerate(batches):
            model.validation_step(batch, index)
        return {
            name: float(value)
            for name, value in model.computed_metrics(model.validation_state, model.nonfinite_counts[0]).items()
        }


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_validation_with_one_nonfinite_batch_reads_nonfinite_not_lower_and_counts_it(value: float) -> None:
    model = tiny_causal_lm()
    batches = [block_batch(seed) for seed in range(3)]
    clean = validated(model, batches, {})
    metrics = validated(model, batches, {id(batches[1]): value})  # torchmetrics' default drops a NaN
    for name in ("loss", "ppl", "bpb"):
        assert math.isfinite(clean[name])
        assert math.isnan(metrics[name]) if math.isnan(value) else metrics[name] == math.inf
    assert clean["nonfinite_batches"] == 0 and metrics["nonfinite_batches"] == 1


def test_a_contrastive_validation_with_a_nan_embedding_reads_nan_and_counts_it() -> None:
    model = tiny_contrastive().eval()
    batches = [pair_batch(8, seed) for seed in range(2)]
    clean = validated(model, batches, {})
    assert clean["nonfinite_batches"] == 0
    metrics = validated(model, batches, {id(batches[1]): math.nan})  # one query embedding's first value
    assert math.isnan(metrics["loss"])
    assert metrics["nonfinite_batches"] == 1 and metrics["nonfinite_embeddings"] == 1
    assert metrics["q2p_mrr"] < clean["q2p_mrr"]  # its passage ranked last, not first


def test_a_result_with_a_nonfinite_validation_or_only_skipped_steps_fails() -> None:
    check_result({"val/loss": 2.5, "val/nonfinite_batches": 0, "train/skipped_steps": 3}, steps=4)
    check_result({}, steps=0)  # nothing validated, nothing trained
    with pytest.raises(NumericalError, match="every one of its 4 steps had a non-finite loss"):
        check_result({"val/loss": 2.5, "val/nonfinite_batches": 0, "train/skipped_steps": 4}, steps=4)
    with pytest.raises(NumericalError, match=r"non-finite values in 1 of its batches: val/loss\b"):
        check_result({"val/loss": math.nan, "val/nonfinite_batches": 1}, steps=4)
    with pytest.raises(NumericalError, match="in 2 of its batches"):  # a metric that stays finite (a rank)
        check_result({"val/q2p_mrr": 0.1, "val/nonfinite_batches": 2}, steps=4)


def pretrain(log_dir: Path, run: str, *overrides: str) -> subprocess.CompletedProcess:
    """A tiny `pretrain` run (`overrides` replacing TINY's values), as it ended."""
    keys = {override.split("=")[0] for override in overrides}
    tiny = [override for override in TINY if override.split("=")[0] not in keys]
    command = pretrain_command(log_dir, run, ["experiment=clm_tiny", *tiny, *overrides])
    return subprocess.run(command, env=TEST_ENV, capture_output=True, text=True, timeout=300)


def strict_json(path: Path) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def csv_column(directory: Path, name: str) -> list[float]:
    with (directory / "csv" / "metrics.csv").open() as file:
        return [float(row[name]) for row in csv.DictReader(file) if row.get(name)]


def nan_run(log_dir: Path, shard_dir: Path) -> subprocess.CompletedProcess:
    """A 4-step run whose every loss is NaN, validated at steps 0, 2 and 4 (`nanloss`)."""
    steps = ["trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_steps=2"]
    return pretrain(log_dir, "nanloss", f"data.dir={shard_dir}", *steps, *NAN_MAKING)


def assert_failed_in_one_line(done: subprocess.CompletedProcess, message: str) -> None:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert message in done.stderr


def test_a_run_whose_every_loss_is_nan_fails_and_gives_a_sweeper_nothing(tmp_path: Path, shard_dir: Path) -> None:
    done = nan_run(tmp_path, shard_dir)  # it ended `completed` with val/loss 0, val/ppl 1, and returned 0.0
    assert_failed_in_one_line(done, "the run failed: every one of its 4 steps had a non-finite loss or gradient norm")
    assert "its last validation gave non-finite values in 1 of its batches: val/bpb, val/loss" in done.stderr
    assert "val/loss = nan" in done.stdout + done.stderr  # the summary shows the values
    assert "no sample: the model's logits are not finite" in done.stdout + done.stderr
    directory = run_dir(tmp_path, "nanloss")
    status = strict_json(directory / STATUS_FILE)
    assert status["status"] == "failed" and status["error"].startswith("NumericalError: the run failed")
    assert "value" not in status  # nothing a sweeper could take
    # Validated at steps 0, 2 and 4.
    assert [math.isnan(loss) for loss in csv_column(directory, "val/loss")] == [True, True, True]
    assert csv_column(directory, "val/nonfinite_batches") == [1.0, 1.0, 1.0]


@pytest.mark.slow  # three processes; the run itself is checked in the fast suite
def test_the_nan_run_again_and_its_evaluation_fail_without_a_traceback(tmp_path: Path, shard_dir: Path) -> None:
    nan_run(tmp_path, shard_dir)
    again = nan_run(tmp_path, shard_dir)  # its checkpoint is of trainer.max_steps: "the run is complete"
    assert_failed_in_one_line(again, "the run failed: every one of its 4 steps had a non-finite loss")
    assert strict_json(run_dir(tmp_path, "nanloss") / STATUS_FILE)["status"] == "failed"

    checkpoint = run_dir(tmp_path, "nanloss") / "checkpoints" / "step-000004.ckpt"
    command = [
        str(Path(sys.executable).parent / "pretrain-eval"),
        f"ckpt_path={checkpoint}",
        f"paths.log_dir={tmp_path}",
    ]
    evaluation = subprocess.run(command, env=TEST_ENV, capture_output=True, text=True, timeout=300)
    # It dropped the NaN batches from validation, then failed with a traceback in the sample.
    assert_failed_in_one_line(
        evaluation, "the validation gave non-finite values in 1 of its batches: val/bpb, val/loss"
    )
    assert "no sample: the model's logits are not finite" in evaluation.stdout
    (written,) = (tmp_path / "eval" / "runs").glob("*/metrics.json")
    result = strict_json(written)
    assert result["val/loss"] is None and result["val/nonfinite_batches"] == 1 and result["sample"] is None


def test_a_refused_rerun_leaves_the_records_of_the_completed_run_as_they_were(tmp_path: Path, shard_dir: Path) -> None:
    run = [f"data.dir={shard_dir}", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    assert pretrain(tmp_path, "done", *run, "callbacks.checkpoint.every_n_steps=2").returncode == 0
    directory = run_dir(tmp_path, "done")
    records = [directory / STATUS_FILE, *sorted((directory / CONFIG_COPIES).iterdir())]
    before = {path: path.read_bytes() for path in records}
    assert json.loads(before[directory / STATUS_FILE])["status"] == "completed"
    # Another global batch does not fit the run's checkpoint: refused before any work.
    refused = pretrain(tmp_path, "done", *run, "callbacks.checkpoint.every_n_steps=2", "data.global_batch_size=8")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "global_batch_size" in refused.stderr
    assert {path: path.read_bytes() for path in records} == before  # it turned `failed`, with the refused config
