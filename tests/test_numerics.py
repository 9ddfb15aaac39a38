"""Numerical faults: a step with a NaN/Inf loss or gradient is skipped and counted, too many in a
row stop the run with the newest checkpoint intact, loss spikes are logged, and a clean run trains
exactly as without the guard."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from conftest import tiny_run
from pretraining.callbacks.batch_log import read_batch_log
from pretraining.callbacks.numerics import LossStatistics, NumericalError, NumericalGuard
from pretraining.callbacks.progress import ProgressBar
from pretraining.checkpoint import saved_checkpoints, verify
from pretraining.errors import ConfigError
from pretraining.files import sha256_of
from pretraining.objectives.causal_lm import CausalLM
from pretraining.stored import load_checkpoint
from pretraining.train import train
from test_resume import pretrain, run_dir
from test_train import metric_rows

FAULTY = "model._target_=test_numerics.FaultyCausalLM"


class InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward, an infinite gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.inf)


class FaultyCausalLM(CausalLM):
    """Next-token loss with faults at chosen steps (numbered as checkpoints are, from 1), in one
    micro-batch of the global batch, `fault_slot` (with accumulation, one of several; under DDP, one
    rank's): a NaN loss whose gradient stays finite (so that only the loss tells), a finite loss with an
    infinite gradient (so that only the gradient tells), or the loss times 100."""

    def __init__(
        self,
        *args: Any,
        nan_at: Sequence[int] = (),
        inf_grad_at: Sequence[int] = (),
        spike_at: Sequence[int] = (),
        fault_slot: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.nan_at, self.inf_grad_at, self.spike_at = list(nan_at), list(inf_grad_at), list(spike_at)
        self.fault_slot = fault_slot

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = super().training_loss(batch)
        step, slot = self.trainer.datamodule.batch_slot
        if slot != self.fault_slot:
            return loss
        if step + 1 in self.nan_at:
            return loss + loss.detach() * math.nan
        if step + 1 in self.inf_grad_at:
            return InfiniteGradient.apply(loss)
        return loss * 100 if step + 1 in self.spike_at else loss


class StopAt(Callback):
    """Stop training after a given step, as a job that ran out of time would (without the kill)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def faults(**steps: list[int]) -> list[str]:
    return [FAULTY, *(f"+model.{name}={value}" for name, value in steps.items())]


def logged(run_dir: Path, key: str) -> list[float]:
    return [float(row[key]) for row in metric_rows(run_dir) if row.get(key)]


def last_logged(run_dir: Path, key: str) -> float:
    return logged(run_dir, key)[-1]


def optimizer_state_is_finite(checkpoint: dict[str, Any]) -> bool:
    states = checkpoint["optimizer_states"][0]["state"].values()
    return all(torch.isfinite(value).all() for state in states for value in state.values())


def adamw_updates(checkpoint: dict[str, Any]) -> int:
    (updates,) = {int(state["step"]) for state in checkpoint["optimizer_states"][0]["state"].values()}
    return updates


def test_a_nan_loss_in_one_micro_batch_skips_the_step_and_training_goes_on(compose_train, tmp_path: Path) -> None:
    cfg = compose_train(
        *faults(nan_at=[3]), "data.micro_batch_size=2", "trainer.max_steps=6", "trainer.log_every_n_steps=1"
    )
    with pytest.warns(UserWarning, match=r"step 3: loss nan, gradient norm \d+\.\d+: skipped"):
        metrics = train(cfg)
    assert metrics["train/skipped_steps"] == 1 and math.isfinite(metrics["train/loss"])
    assert last_logged(tmp_path, "train/skipped_steps") == 1
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 6
    assert all(torch.isfinite(weight).all() for weight in checkpoint["state_dict"].values())
    assert optimizer_state_is_finite(checkpoint)
    assert adamw_updates(checkpoint) == 5  # the skipped step made none


def test_an_infinite_gradient_under_a_finite_loss_is_skipped_too(compose_train, tmp_path: Path) -> None:
    cfg = compose_train(*faults(inf_grad_at=[4]), "trainer.max_steps=6")
    with pytest.warns(UserWarning, match=r"step 4: loss \d+\.\d+, gradient norm (inf|nan): skipped"):
        metrics = train(cfg)
    assert metrics["train/skipped_steps"] == 1
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 6 and optimizer_state_is_finite(checkpoint)
    assert all(torch.isfinite(weight).all() for weight in checkpoint["state_dict"].values())


def test_consecutive_bad_steps_stop_the_run_and_leave_the_newest_checkpoint_intact(
    compose_train, tmp_path: Path
) -> None:
    train(compose_train("trainer.max_steps=6"))  # a checkpoint at step 6
    checkpoints = tmp_path / "checkpoints"
    good = checkpoints / "step-000006.ckpt"
    digest = sha256_of(good)

    stopping = ["trainer.max_steps=12", *faults(nan_at=[8, 9, 10]), "callbacks.numerics.max_consecutive_bad_steps=3"]
    message = (
        rf"3 consecutive steps \(8 to 10\) had a non-finite loss.*the newest checkpoint, {good} \(step 6\), is "
        rf"intact.*add ckpt_path={good} callbacks.numerics.max_consecutive_bad_steps=null"
    )
    with pytest.raises(NumericalError, match=message):
        train(compose_train(*stopping))  # continues from step 6
    assert sha256_of(good) == digest and verify(good)["step"] == 6
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [6]

    # As the message says: past the bad steps, skipping them, from that checkpoint.
    metrics = train(compose_train(*stopping, f"ckpt_path={good}", "callbacks.numerics.max_consecutive_bad_steps=null"))
    assert metrics["train/skipped_steps"] == 3
    assert load_checkpoint(checkpoints / "last.ckpt")["global_step"] == 12


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def test_a_clean_run_trains_bit_identically_without_the_guard(compose_train, tmp_path: Path) -> None:
    """With the guard, the weights are bitwise those of a run without it, clipped by Lightning's own clipping
    (which acts: the norm exceeds 0.05)."""
    dirs = {"with": tmp_path / "with", "without": tmp_path / "without"}
    short = ["trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.gradient_clip_val=0.05"]
    train(compose_train(*short, f"paths.output_dir={dirs['with']}"))
    train(compose_train(*short, f"paths.output_dir={dirs['without']}", "~callbacks.numerics"))
    guarded, unguarded = final_weights(dirs["with"]), final_weights(dirs["without"])
    assert guarded.keys() == unguarded.keys()
    assert all(torch.equal(guarded[name], unguarded[name]) for name in guarded)
    assert last_logged(dirs["with"], "train/skipped_steps") == 0
    assert last_logged(dirs["with"], "train/grad_norm") > 0.05


def test_spikes_are_logged_and_the_counts_continue_exactly_after_a_resume(compose_train, tmp_path: Path) -> None:
    run = [*faults(nan_at=[3, 9], spike_at=[10]), "callbacks.numerics.spike_window=4", "trainer.log_every_n_steps=1"]
    stop_at_6 = ["+callbacks.stop._target_=test_numerics.StopAt", "+callbacks.stop.step=6"]
    dirs = [tmp_path / "uninterrupted", tmp_path / "resumed"]
    with pytest.warns(UserWarning, match=r"step 10: loss spike"):
        expected = train(compose_train(*run, f"paths.output_dir={dirs[0]}"))
    train(compose_train(*run, *stop_at_6, f"paths.output_dir={dirs[1]}"))
    assert load_checkpoint(dirs[1] / "checkpoints" / "last.ckpt")["global_step"] == 6
    resumed = train(compose_train(*run, *stop_at_6, f"paths.output_dir={dirs[1]}"))  # from step 6

    assert expected["train/skipped_steps"] == resumed["train/skipped_steps"] == 2
    assert expected["train/loss_spikes"] == resumed["train/loss_spikes"] == 1
    assert last_logged(dirs[1], "train/loss_spikes") == 1
    states = [load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["callbacks"]["NumericalGuard"] for run_dir in dirs]
    assert states[0] == states[1]  # the loss statistics too, bit for bit
    (spike,) = [json.loads(line) for line in (dirs[1] / "loss_spikes.jsonl").read_text().splitlines()]
    assert spike["step"] == 10 and spike["loss"] > spike["mean"] + 6 * spike["std"]
    assert {"grad_norm", "lr", "time"} <= spike.keys()


# FSDP2 (the norm of sharded gradients) is slow-marked, keeping this file near a minute on 2 cores.
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp_cpu", pytest.param("fsdp_cpu", marks=pytest.mark.slow)])
def test_every_rank_skips_a_step_whose_loss_is_nan_on_one_rank(
    compose_train, tmp_path: Path, shard_dir: Path, strategy: str
) -> None:
    """Rank one's loss is NaN at step 3, its gradient finite: rank zero (which saves) skips the step
    too, and the gradient norm is that of the whole gradient, as on one process."""
    run = [*faults(nan_at=[3], fault_slot=1), "trainer.max_steps=4", "trainer.log_every_n_steps=1"]
    train(compose_train(*run, "data.micro_batch_size=2", f"paths.output_dir={tmp_path / 'one'}"))
    two = [*tiny_run("clm_tiny"), *run, f"data.dir={shard_dir}", f"trainer={strategy}"]
    assert pretrain(tmp_path, "two", two) == 0
    run_dirs = [tmp_path / "one", run_dir(tmp_path, "two")]
    checkpoints = [load_checkpoint(path / "checkpoints" / "last.ckpt") for path in run_dirs]
    assert [checkpoint["callbacks"]["NumericalGuard"]["skipped_steps"] for checkpoint in checkpoints] == [1, 1]
    assert [adamw_updates(checkpoint) for checkpoint in checkpoints] == [3, 3]
    norms = [torch.tensor(logged(path, "train/grad_norm")) for path in run_dirs]
    assert len(norms[0]) == 4
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=0)


# On the CPU Lightning turns precision=16-mixed into bf16-mixed; its plugin with a CPU GradScaler keeps float16.
FLOAT16 = [
    "trainer.precision=null",
    "trainer.plugins=[{_target_: pretraining.plugins.checkpoint_io.AtomicCheckpointIO}, {_target_: "
    "lightning.pytorch.plugins.MixedPrecision, precision: 16-mixed, device: cpu, scaler: {_target_: "
    "torch.amp.GradScaler, device: cpu}}]",
]


def test_under_float16_an_overflow_is_left_to_the_grad_scaler_and_a_nan_loss_is_skipped(
    compose_train, tmp_path: Path
) -> None:
    cfg = compose_train(*faults(inf_grad_at=[3], nan_at=[4]), *FLOAT16, "trainer.max_steps=6")
    with pytest.warns(UserWarning) as warned:
        metrics = train(cfg)
    assert not [warning for warning in warned if "step 3" in str(warning.message)]
    assert metrics["train/skipped_steps"] == 1  # step 4's NaN loss; step 3 was the scaler's
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert adamw_updates(checkpoint) == 4
    assert checkpoint["MixedPrecision"]["scale"] == 2.0**15  # lowered once, at step 3
    statistics = checkpoint["callbacks"]["NumericalGuard"]["loss_statistics"]
    assert statistics["count"] == 4 and abs(statistics["mean"] - metrics["train/loss"]) < 1  # unscaled losses


def test_loss_statistics_start_as_a_plain_mean_and_variance_then_forget() -> None:
    statistics = LossStatistics(window=9)  # weight 2 / (9 + 1) = 0.2 per step once past the 5th
    for loss in [1.0, 2.0, 3.0]:
        statistics.update(loss)
    assert statistics.mean == pytest.approx(2.0) and statistics.variance == pytest.approx(2 / 3)
    assert not statistics.is_spike(100.0, threshold=6.0)  # fewer steps seen than the window
    for _ in range(100):
        statistics.update(5.0)
    assert statistics.mean == pytest.approx(5.0) and statistics.variance == pytest.approx(0.0, abs=1e-6)
    assert statistics.is_spike(5.1, threshold=6.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_consecutive_bad_steps": 0}, r"callbacks.numerics.max_consecutive_bad_steps=0 must be at least 1"),
        ({"spike_threshold": -1.0}, r"callbacks.numerics.spike_threshold=-1.0 must be > 0"),
        ({"spike_window": 0}, r"callbacks.numerics.spike_window=0 must be at least 1"),
    ],
)
def test_bad_settings_are_refused_with_the_key(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NumericalGuard(**settings)


class RecordSteps(Callback):
    """Records, at the end of every step (its last micro-batch), the loss the progress bar shows, the loss in
    `trainer.callback_metrics`, and the steps whose training rows are on disk in metrics.csv."""

    bar: ClassVar[dict[int, float]] = {}
    callback_metrics: ClassVar[dict[int, float]] = {}
    on_disk: ClassVar[dict[int, list[int]]] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step in RecordSteps.bar:  # a micro-batch of the next step
            return
        (bar,) = (callback for callback in trainer.callbacks if isinstance(callback, ProgressBar))  # type: ignore[attr-defined]
        RecordSteps.bar[step] = bar.get_metrics(trainer, pl_module).get("train/loss", math.nan)
        RecordSteps.callback_metrics[step] = float(trainer.callback_metrics.get("train/loss", math.nan))
        csv_file = trainer.logger.path  # type: ignore[union-attr]
        rows = list(csv.DictReader(csv_file.open())) if csv_file.exists() else []
        RecordSteps.on_disk[step] = [int(row["step"]) + 1 for row in rows if row.get("train/loss")]


def test_a_stop_at_a_step_not_logged_writes_that_steps_values(compose_train, tmp_path: Path) -> None:
    """A callback that stops training at step 5 (a signal, a time limit) makes Lightning write step 5's row
    too: it holds step 5's values, not those of step 3, the step logged last."""
    stop_at_5 = ["+callbacks.stop._target_=test_numerics.StopAt", "+callbacks.stop.step=5"]
    train(compose_train("trainer.log_every_n_steps=3", "callbacks=[default,batch_log]", *stop_at_5))
    batches = read_batch_log(tmp_path / "batches" / "rank0.jsonl")
    rows = [row for row in metric_rows(tmp_path) if row.get("train/loss")]
    assert [int(row["step"]) + 1 for row in rows] == [3, 5]  # Lightning numbers rows from 0
    for row, step in zip(rows, (3, 5), strict=True):
        assert float(row["train/loss"]) == pytest.approx(float.fromhex(batches[step]["loss"]), rel=1e-6), step


def test_each_logged_step_writes_its_last_micro_batchs_values_once_also_after_a_resume(
    compose_train, tmp_path: Path
) -> None:
    """With gradient accumulation (2 micro-batches a step), the values of a logged step are written once, at its
    end, with its last micro-batch's loss, and reach the disk; the last step's values are what the run reports.
    A run resumed at a logged step (6) writes no row for it again. The progress bar shows the last logged step's
    loss, and callbacks see a logged step's values in `trainer.callback_metrics` during that step."""
    for recorded in (RecordSteps.bar, RecordSteps.callback_metrics, RecordSteps.on_disk):
        recorded.clear()
    run = ["trainer.log_every_n_steps=3", "data.micro_batch_size=2", "callbacks=[default,batch_log]"]
    record = ["+callbacks.record._target_=test_numerics.RecordSteps"]
    stop_at_6 = ["+callbacks.stop._target_=test_numerics.StopAt", "+callbacks.stop.step=6"]
    train(compose_train(*run, *record, *stop_at_6, "trainer.max_steps=13"))
    reported = train(compose_train(*run, *record, "trainer.max_steps=13"))  # from step 6
    batches = read_batch_log(tmp_path / "batches" / "rank0.jsonl")

    def loss_of(step: int) -> float:  # the logged loss: the step's last micro-batch's, not divided by 2
        return 2 * float.fromhex(batches[2 * step]["loss"])

    rows = [row for row in metric_rows(tmp_path) if row.get("train/loss")]
    steps = [int(row["step"]) + 1 for row in rows]  # Lightning numbers rows from 0
    assert steps == [3, 6, 9, 12]
    for row, step in zip(rows, steps, strict=True):
        assert float(row["train/loss"]) == pytest.approx(loss_of(step), rel=1e-6), step
        assert row["train/grad_norm"] and row["data/samples_read"]  # one row holds all of the step's values
    assert reported["train/loss"] == pytest.approx(loss_of(13), rel=1e-6)
    assert RecordSteps.bar[10] == pytest.approx(loss_of(9), rel=1e-6)
    assert RecordSteps.callback_metrics[9] == pytest.approx(loss_of(9), rel=1e-6)
    assert RecordSteps.on_disk[10] == [3, 6, 9]  # step 9's row reached the disk at its end
