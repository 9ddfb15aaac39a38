"""The config schema stops a bad config at startup, naming the key, the value and the fix; every shipped
config passes it; Hydra's own error for a missing group option stays readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import DictConfig

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.objectives.causal_lm import CausalLM
from pretraining.ranges import Range
from pretraining.run import check_config
from pretraining.schema import check_schema, signature
from pretraining.settings import EvalSettings, TrainSettings

PRESETS = [
    f"{group}={path.stem}"
    for group in ("experiment", "hparams_search", "debug", "trainer", "callbacks", "logger", "model", "data")
    for path in sorted((CONFIG_DIR / group).glob("*.yaml"))
]


def composed(*overrides: str, config: str = "train") -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config, overrides=list(overrides))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_config_fits_the_schema(preset: str) -> None:
    # Only the schema: a model preset alone may contradict the default trainer (tests/test_configs.py runs
    # the cross-group checks on every experiment preset).
    check_schema(composed(preset), TrainSettings, "configs/train.yaml")


BAD = [
    # Unknown keys, with the closest known one.
    (["+model.optimizer.lrr=1"], r"model\.optimizer\.lrr=1: .* not a parameter of torch\.optim\.AdamW: did you mean "
     r"model\.optimizer\.lr\? Write model\.optimizer\.lr=1 instead"),
    (["+data.globl_batch_size=4"], r"data\.globl_batch_size=4: .*did you mean data\.global_batch_size\?"),
    (["+sed=1"], r"sed=1: sed is not a key of configs/train\.yaml: did you mean seed\?"),
    (["+data.block_size=64"], r"data\.block_size=64: .*of the example format, data\.format\.block_size: write"),
    (["+callbacks.checkpoint.zzz=1"], r"callbacks\.checkpoint\.zzz=1: .*the keys there are dirpath, every_n_steps"),
    # Wrong types.
    (["data.num_workers=two"], r"data\.num_workers='two' is not an integer: change data\.num_workers to such a value"),
    (["trainer.max_steps=1.5"], r"trainer\.max_steps=1\.5 is not an integer"),
    (["model.compile='true'"], r"model\.compile='true' is not true or false"),
    (["model.optimizer.betas=[0.9]"], r"model\.optimizer\.betas=\[0\.9\] is not a list of 2 items"),
    # Values out of range, the four examples among them.
    (["model.optimizer.lr=-1e-3"], r"model\.optimizer\.lr=-0\.001 must be > 0: set model\.optimizer\.lr within"),
    (["experiment=mlm_tiny", "model.mask_rate=0"], r"model\.mask_rate=0 must be in \(0, 1\): set model\.mask_rate"),
    (["experiment=mlm_tiny", "model.mask_rate=1.2"], r"model\.mask_rate=1\.2 must be in \(0, 1\)"),
    (["model.optimizer.betas=[0.9,1.0]"], r"model\.optimizer\.betas\[1\]=1\.0 must be in \[0, 1\)"),
    (["data.num_workers=-1"], r"data\.num_workers=-1 must be at least 0"),
    (["experiment=contrastive_tiny", "model.recall_at=[1,0]"], r"model\.recall_at\[1\]=0 must be at least 1"),
    # Every number of the Trainer that configs/ set.
    (["trainer.max_steps=0"], r"trainer\.max_steps=0 must be at least 1 \(the LR schedule and the infinite stream"),
    (["trainer.max_epochs=0"], r"trainer\.max_epochs=0 must be at least 1"),
    (["trainer.val_check_interval=0"], r"trainer\.val_check_interval=0 must be at least 1"),
    (["trainer.val_check_interval=0.5"], r"trainer\.val_check_interval=0\.5 is not an integer or null"),
    (["trainer.check_val_every_n_epoch=0"], r"trainer\.check_val_every_n_epoch=0 must be at least 1"),
    (["trainer.num_sanity_val_steps=-2"], r"trainer\.num_sanity_val_steps=-2 must be at least -1"),
    (["trainer=ddp", "trainer.num_nodes=0"], r"trainer\.num_nodes=0 must be at least 1"),
    (["trainer.log_every_n_steps=0"], r"trainer\.log_every_n_steps=0 must be at least 1"),
    (["trainer.gradient_clip_val=-1"], r"trainer\.gradient_clip_val=-1 must be at least 0"),
    (["debug=fdr", "trainer.fast_dev_run=-1"], r"trainer\.fast_dev_run=-1 must be at least 0"),
    (["debug=limit", "trainer.limit_val_batches=1.5"], r"trainer\.limit_val_batches=1\.5 must be in \[0, 1\]"),
    (["debug=overfit", "trainer.overfit_batches=-1"], r"trainer\.overfit_batches=-1 must be at least 0"),
    # Values outside their set.
    (["resume=sometimes"], r"resume='sometimes' is not one of 'auto', 'never': change resume"),
    (["resume_allow=[data,topolgy]"], r"resume_allow\[1\]='topolgy' is not one of 'data', 'tokenizer', 'topology'"),
    (["experiment=contrastive_tiny", "model.pooling=max"], r"model\.pooling='max' is not one of 'mean', 'first'"),
    (["trainer.precision=bf17"], r"trainer\.precision='bf17' is not one of .*'bf16-mixed'"),
    # Targets that do not exist or make the wrong thing.
    (["model.optimizer._target_=torch.optim.AdamWW"], r"model\.optimizer\._target_=torch\.optim\.AdamWW cannot be "
     r"imported .*: fix the name, or put its module on PYTHONPATH"),
    (["trainer=fsdp_cpu", "trainer.strategy._target_=torch.optim.AdamW"], r"trainer\.strategy\._target_="
     r"torch\.optim\.AdamW does not make .*Strategy"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_a_bad_value_stops_with_key_value_and_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(composed(*overrides))


def test_eval_settings() -> None:
    check_schema(composed("ckpt_path=x.ckpt", config="eval"), EvalSettings, "configs/eval.yaml")
    with pytest.raises(ConfigError, match=r"temperature=0 must be > 0"):
        check_schema(composed("ckpt_path=x.ckpt", "temperature=0", config="eval"), EvalSettings, "configs/eval.yaml")


class ZLossLM(CausalLM):
    """An objective of your own, forwarding the keywords it does not know to its base class."""

    def __init__(self, *args: Any, z_loss: Annotated[float, Range(ge=0)] = 1e-4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def test_an_objective_of_your_own_is_checked_by_its_signature_and_its_base() -> None:
    parameters, open_ended = signature(ZLossLM)
    assert not open_ended and {"z_loss", "warmup_steps", "backbone"} <= set(parameters)
    ok = ["model._target_=test_schema.ZLossLM", "+model.z_loss=0.01"]
    check_config(composed(*ok))  # its own key and its base's keys (warmup_steps, ...) are known
    with pytest.raises(ConfigError, match=r"model\.z_loss=-1 must be at least 0"):
        check_config(composed(*ok, "model.z_loss=-1"))
    with pytest.raises(ConfigError, match=r"model\.z_los=1: .*did you mean model\.z_loss\?"):
        check_config(composed("model._target_=test_schema.ZLossLM", "+model.z_los=1"))


def test_an_interpolated_target_is_checked_as_the_class_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_target_: ${...}` (a common Hydra idiom) is read as what it resolves to, in the pass over interpolations."""
    monkeypatch.setenv("BACKBONE", "pretraining.models.transformer.Transformer")
    backbone = ["experiment=clm_tiny", "model.backbone._target_=${oc.env:BACKBONE}"]
    check_config(composed(*backbone))
    with pytest.raises(ConfigError, match=r"model\.backbone\.dropout=1\.5 must be "):
        check_config(composed(*backbone, "model.backbone.dropout=1.5"))


def test_a_missing_group_option_gets_hydras_message() -> None:
    with pytest.raises(MissingConfigException) as error:
        composed("model=nope")
    assert "Could not find 'model/nope'" in str(error.value) and "Available options in 'model'" in str(error.value)


@pytest.mark.slow  # tests/test_errors.py's bad commands at the entry point stay in the fast suite
def test_pretrain_stops_at_a_bad_key_with_one_message_before_reading_data(tmp_path: Path) -> None:
    """The message, without a traceback, before the (absent) data directory is read."""
    command = [sys.executable, "-m", "pretraining", f"paths.log_dir={tmp_path}", f"data.dir={tmp_path}/none"]
    run = subprocess.run([*command, "+data.globl_batch_size=4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "data.globl_batch_size=4: data.globl_batch_size is not a parameter" in run.stderr
    assert "did you mean data.global_batch_size?" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) < 10, run.stderr
