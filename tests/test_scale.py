"""Scale-out: the same config on one process and on two (DDP, FSDP2 on CPU with gloo) trains on the
same global batches, each rank on its own samples, with the same losses and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_run
from pretraining.callbacks.batch_log import global_steps, read_batch_log
from test_resume import final_weights, pretrain, run_dir

STEPS = 6
OBJECTIVES = {"clm_tiny": "small_shards", "mlm_tiny": "shard_dir", "contrastive_tiny": "pair_dir"}
# Dropout on: the DataModule keys it on each micro-batch's place in the global batch, not on the rank.
COMMON = ["callbacks=[default,batch_log]", "model.backbone.dropout=0.1", f"trainer.max_steps={STEPS}"]

pytestmark = pytest.mark.distributed  # two processes (gloo)


def micro_batch(experiment: str) -> list[str]:
    """Two micro-batches of 2 on one process, one on each of two. Contrastive takes the whole global
    batch in one forward per device, since its negatives are the pairs of the forwards run together;
    its micro-batches then differ in size between the layouts, and so would its dropout masks."""
    if experiment == "contrastive_tiny":
        return ["data.micro_batch_size=null", "model.backbone.dropout=0.0"]
    return ["data.micro_batch_size=2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, request) -> dict[str, Path]:
    """The single-process reference run of each objective, shared by the strategies."""
    runs: dict[str, Path] = {}

    def run(experiment: str, data: Path) -> Path:
        if experiment not in runs:
            log_dir = tmp_path_factory.mktemp(experiment)
            assert (
                pretrain(log_dir, "one", [*tiny_run(experiment), *COMMON, *micro_batch(experiment), f"data.dir={data}"])
                == 0
            )
            runs[experiment] = log_dir
        return runs[experiment]

    return run  # type: ignore[return-value]


# The default suite runs every objective under DDP and next-token under FSDP2 as well (keeping it near
# 10 minutes on 2 cores); `make test-full` runs every pair.
SLOW_CASES = {("mlm_tiny", "ddp_cpu"), ("mlm_tiny", "fsdp_cpu"), ("contrastive_tiny", "fsdp_cpu")}
CASES = [
    pytest.param(experiment, trainer, marks=[pytest.mark.slow] if (experiment, trainer) in SLOW_CASES else [])
    for experiment in OBJECTIVES
    for trainer in ("ddp_cpu", "fsdp_cpu")
]


@pytest.mark.parametrize(("experiment", "trainer"), CASES)
def test_two_processes_train_like_one_with_the_same_global_batch(
    tmp_path: Path, request, one_process, experiment: str, trainer: str
) -> None:
    data = request.getfixturevalue(OBJECTIVES[experiment])
    reference = one_process(experiment, data)
    overrides = [*tiny_run(experiment), *COMMON, *micro_batch(experiment), f"data.dir={data}", f"trainer={trainer}"]
    assert pretrain(tmp_path, "two", overrides) == 0

    ranks = [read_batch_log(path) for path in sorted((run_dir(tmp_path, "two") / "batches").glob("rank*.jsonl"))]
    samples = [{i for record in log.values() for i in record["samples"]} for log in ranks]
    assert len(ranks) == 2 and samples[0].isdisjoint(samples[1])  # each rank reads its own samples
    expected = global_steps(run_dir(reference, "one") / "batches")
    actual = global_steps(run_dir(tmp_path, "two") / "batches")
    assert sorted(actual) == sorted(expected) == list(range(STEPS))
    for step in range(STEPS):
        assert actual[step][0] == expected[step][0], f"step {step} trained on other samples"
    losses = torch.tensor([[expected[step][1], actual[step][1]] for step in range(STEPS)])
    torch.testing.assert_close(losses[:, 1], losses[:, 0], rtol=1e-5, atol=1e-6)
    weights = final_weights(reference, "one"), final_weights(tmp_path, "two")
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_run_killed_on_two_processes_continues_exactly_on_one(tmp_path: Path, small_shards: Path) -> None:
    """The data position does not depend on the number of devices: a DDP run killed after 4 steps
    continues on one process with the same global batches (and, with the same accumulation, without
    `resume_allow`), ending where an uninterrupted single-process run ends."""
    overrides = [
        *tiny_run("clm_tiny"),
        "callbacks=[default,batch_log]",
        "callbacks.checkpoint.every_n_steps=2",
        f"trainer.max_steps={STEPS}",
        f"data.dir={small_shards}",
    ]
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert pretrain(tmp_path, "elastic", [*overrides, "trainer=ddp_cpu"], kill_after=5) == -9
    assert pretrain(tmp_path, "elastic", overrides) == 0
    expected = global_steps(run_dir(tmp_path, "reference") / "batches")
    resumed = global_steps(run_dir(tmp_path, "elastic") / "batches")
    assert sorted(resumed) == sorted(expected) == list(range(STEPS))
    assert [resumed[step][0] for step in range(STEPS)] == [expected[step][0] for step in range(STEPS)]
    torch.testing.assert_close(
        torch.tensor([resumed[step][1] for step in range(STEPS)]),
        torch.tensor([expected[step][1] for step in range(STEPS)]),
        rtol=1e-5,
        atol=1e-6,
    )
    weights = final_weights(tmp_path, "reference"), final_weights(tmp_path, "elastic")
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-5, msg=name)
