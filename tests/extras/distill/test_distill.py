"""Distillation: the loss (chunked as whole, forward and reverse KL, the masked positions), the teacher
attached by the run (verified, refused when it does not fit or is tainted, kept out of the student's
checkpoints, pinned across a resume), and exact resume."""

from __future__ import annotations

import copy
import math
import re
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from conftest import tiny_run
from pretraining.checkpoint import CheckpointError, read_sidecar
from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.evaluate import evaluate
from pretraining.extras.distill.objectives import Distill, DistillMasked, FrozenTeacher, distillation_sums
from pretraining.extras.registry.versions import Registry
from pretraining.info import ancestry, describe
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.run import check_config
from pretraining.stored import load_checkpoint
from pretraining.train import train
from test_head import SoftCapped
from test_resume import RESUMABLE, kill_twice_and_compare

VOCAB = 300


def backbone(causal: bool = True, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2, causal=causal)


def optimizer(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters)  # type: ignore[arg-type]


def blocks(rows: int = 3, length: int = 17) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"tokens": torch.randint(8, VOCAB, (rows, length)), "sample_id": torch.arange(rows)}


def student_with_teacher(
    kind: type = Distill, teacher_seed: int = 1, **settings: object
) -> tuple[Distill | DistillMasked, CausalLM | MaskedLM]:
    causal = kind is Distill
    student = kind(backbone(causal, seed=0), teacher="unused", optimizer=optimizer, **settings)
    teacher = (CausalLM if causal else MaskedLM)(backbone(causal, seed=teacher_seed), optimizer=optimizer)
    student.attach_teacher(FrozenTeacher(teacher))
    return student, teacher


def test_the_chunked_sums_equal_the_whole_and_the_kl_is_the_reference_kl() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight, teacher_hidden, teacher_weight = torch.randn(70, 16), torch.randn(2, 7, 16), torch.randn(70, 16)
    head, teacher_head = partial(F.linear, weight=weight), partial(F.linear, weight=teacher_weight)
    targets = torch.randint(0, 64, (2, 7))
    targets[0, 3] = -100  # a position that is not scored
    whole = distillation_sums(hidden, head, teacher_hidden, teacher_head, targets, 64, 2.0, False, None)
    (gradient,) = torch.autograd.grad(sum(whole), hidden)
    chunked = distillation_sums(hidden, head, teacher_hidden, teacher_head, targets, 64, 2.0, False, 3)
    (chunked_gradient,) = torch.autograd.grad(sum(chunked), hidden)
    assert torch.allclose(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1])
    assert torch.allclose(gradient, chunked_gradient, atol=1e-6)
    scored = targets.flatten() != -100
    student = F.log_softmax((hidden.flatten(0, 1) @ weight[:64].T) / 2.0, -1)[scored]
    teacher = F.log_softmax((teacher_hidden.flatten(0, 1) @ teacher_weight[:64].T) / 2.0, -1)[scored]
    forward = F.kl_div(student, teacher, log_target=True, reduction="sum")
    assert whole[1].item() == pytest.approx(forward.item(), rel=1e-5)
    reverse = distillation_sums(hidden, head, teacher_hidden, teacher_head, targets, 64, 2.0, True, None)[1]
    assert reverse.item() == pytest.approx(
        F.kl_div(teacher, student, log_target=True, reduction="sum").item(), rel=1e-5
    )
    assert reverse.item() != pytest.approx(forward.item(), rel=1e-3)


@pytest.mark.parametrize("chunk", [None, 5])
def test_student_and_teacher_score_with_their_backbones_heads(chunk: int | None) -> None:
    def soft_capped(seed: int) -> SoftCapped:
        torch.manual_seed(seed)
        return SoftCapped(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2)

    student = Distill(soft_capped(0), teacher="unused", optimizer=optimizer, kl_chunk_tokens=chunk)
    student.attach_teacher(FrozenTeacher(CausalLM(soft_capped(1), optimizer=optimizer)))
    batch = blocks()
    cross_entropy, kl, _ = student.batch_sums(batch, 2.0, validation=False)
    scored = student.scored_inputs(batch)
    logits = student.backbone.logits(student.hidden_at(scored)).flatten(0, 1)
    teacher_logits = student.teacher.model.backbone.logits(student.teacher.model.hidden_at(scored)).flatten(0, 1)
    targets = scored.targets.flatten()
    expected = F.cross_entropy(logits, targets, reduction="sum")
    teacher = F.log_softmax(teacher_logits[:, :VOCAB] / 2.0, -1)
    expected_kl = F.kl_div(F.log_softmax(logits[:, :VOCAB] / 2.0, -1), teacher, log_target=True, reduction="sum")
    assert cross_entropy.item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl.item() == pytest.approx(expected_kl.item(), rel=1e-4)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # no Trainer here
def test_the_loss_mixes_the_soft_and_hard_terms_as_configured() -> None:
    batch = blocks()
    hard, _ = student_with_teacher(alpha=0.0)
    plain = CausalLM(copy.deepcopy(hard.backbone), optimizer=optimizer)
    assert hard.training_loss(batch).item() == pytest.approx(plain.training_loss(batch).item(), rel=1e-6)
    soft, _ = student_with_teacher(alpha=1.0, temperature=3.0)
    _, kl, count = soft.batch_sums(batch, 3.0, validation=False)
    assert soft.training_loss(batch).item() == pytest.approx(9 * (kl / count).item(), rel=1e-6)
    # A student that is its teacher has nothing to learn from it.
    same, teacher = student_with_teacher(alpha=1.0)
    teacher.backbone.load_state_dict(same.backbone.state_dict())
    assert same.training_loss(batch).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # no Trainer here
@pytest.mark.parametrize("kind", [Distill, DistillMasked])
def test_a_llama_student_learns_from_a_llama_teacher_in_every_parameter(kind: type) -> None:
    causal = kind is Distill

    def llama(seed: int) -> Llama:
        torch.manual_seed(seed)  # GPT-2's init: zero output projections would give the rest no gradient yet
        return Llama(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2, causal=causal, output_init="scaled"
        )

    student = kind(llama(0), teacher="unused", optimizer=optimizer, alpha=0.5)
    student.attach_teacher(FrozenTeacher((CausalLM if causal else MaskedLM)(llama(1), optimizer=optimizer)))
    loss = student.training_loss(blocks(length=33))
    loss.backward()
    assert loss.isfinite()
    assert all(p.grad is not None and p.grad.any() for p in student.parameters())


def test_a_masked_student_is_taught_at_its_masked_positions_on_the_same_masked_input() -> None:
    batch = blocks(length=33)
    student, teacher = student_with_teacher(DistillMasked, alpha=1.0)
    _, kl, count = student.batch_sums(batch, 1.0, validation=False)
    assert int(count) == 3 * round(0.3 * 32)  # mask_rate 0.3 of each 32-token block
    teacher.backbone.load_state_dict(student.backbone.state_dict())
    # With the student's own weights the teacher gives the same distribution only if it reads the masked input.
    assert student.batch_sums(batch, 1.0, validation=False)[1].item() == pytest.approx(0.0, abs=1e-5)
    assert kl.item() > 0.01


def test_the_teacher_is_never_in_the_students_weights_or_optimizer() -> None:
    student, teacher = student_with_teacher()
    plain = CausalLM(backbone(), optimizer=optimizer)
    assert student.state_dict().keys() == plain.state_dict().keys()
    # configure_optimizers reads only these of the trainer
    student.trainer = SimpleNamespace(max_steps=10, precision_plugin=None, gradient_clip_val=None)
    optimized = {id(p) for group in student.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in student.parameters()}
    assert optimized.isdisjoint(id(p) for p in teacher.parameters())
    assert not any(parameter.requires_grad for parameter in teacher.parameters()) and not teacher.training


# Runs: a teacher trained for six steps, students distilled from it.


def compose_run(root: Path, shard_dir: Path, experiment: str, *overrides: str) -> DictConfig:
    base = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={shard_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=[*base, *tiny_run(experiment), "trainer.max_steps=6", *overrides])


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, shard_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("teacher")
    train(compose_run(root, shard_dir, "clm_tiny"))
    return root / "checkpoints" / "step-000006.ckpt"


def test_a_student_checkpoint_names_its_teacher_and_evaluates_without_it(
    teacher: Path, shard_dir: Path, tmp_path: Path
) -> None:
    metrics = train(compose_run(tmp_path, shard_dir, "distill_tiny", f"model.teacher={teacher}"))
    assert metrics["val/kl"] > 0 and math.isfinite(metrics["val/bpb"])
    student = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert all(name.startswith(("backbone.", "validation_state.")) for name in student["state_dict"])
    assert len(student["state_dict"]) == len(load_checkpoint(teacher)["state_dict"])  # one model, not two
    recorded = student["lineage"]["teacher"]
    assert recorded["digest"] == read_sidecar(teacher)["sha256"] and recorded["step"] == 6
    assert read_sidecar(tmp_path / "checkpoints" / "step-000006.ckpt")["lineage"]["teacher"] == recorded
    described = describe(ancestry(tmp_path / "checkpoints" / "last.ckpt"))
    assert re.search(rf"\nteacher +{re.escape(f'{teacher.resolve()} (step 6; given as {teacher})')}\n", described)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("eval", [f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}", f"paths.output_dir={tmp_path}"])
    evaluated = evaluate(cfg)
    assert evaluated["val/bpb"] == pytest.approx(metrics["val/bpb"], rel=1e-4) and "val/kl" not in evaluated


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.teacher=???"], r"model.teacher is not set: pass model.teacher=<value>"),
        (["model.teacher=nowhere"], r"model.teacher=nowhere: 'nowhere' is no alias of the registry .* \(it is empty"),
        (["model.teacher=/no/such.ckpt"], r"model.teacher=/no/such.ckpt: /no/such.ckpt: no such checkpoint"),
        (["tokenizer=bpe", "tokenizer.path={bpe}"], "was trained with another tokenizer"),
        (["model=distill_mlm", "model.backbone.d_model=32"], "the student learns from a MaskedLM teacher"),
        (["model.backbone.max_seq_len=128", "data.format.block_size=128"], "the teacher .* has 64 positions"),
    ],
)
def test_a_teacher_that_does_not_fit_is_refused_before_training(
    teacher: Path, shard_dir: Path, tmp_path: Path, bpe_path: Path, overrides: list[str], message: str
) -> None:
    overrides = [override.format(bpe=bpe_path) for override in overrides]
    cfg = compose_run(tmp_path, shard_dir, "distill_tiny", f"model.teacher={teacher}", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)
        train(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_a_registry_alias_names_the_teacher_a_taint_refuses_it_and_a_resume_keeps_the_first(
    teacher: Path, shard_dir: Path, tmp_path: Path
) -> None:
    registry = Registry(tmp_path / "logs" / "registry")  # paths.registry_dir under this run's paths.log_dir
    registry.register(teacher, alias="teacher")
    first = compose_run(tmp_path, shard_dir, "distill_tiny", "model.teacher=teacher", "trainer.max_steps=3")
    train(first)
    # The alias moves to another checkpoint (the student's own, a CausalLM too): the run keeps its teacher.
    other, _ = registry.register(tmp_path / "checkpoints" / "step-000003.ckpt")
    registry.promote(other.name, "teacher")
    train(compose_run(tmp_path, shard_dir, "distill_tiny", "model.teacher=teacher", "trainer.max_steps=6"))
    lineage = load_checkpoint(tmp_path / "checkpoints" / "step-000006.ckpt")["lineage"]
    assert lineage["teacher"]["digest"] == read_sidecar(teacher)["sha256"]
    assert lineage["teacher"]["registry_version"] == 1
    # Another teacher named on resume is refused: the run's lineage names the one it learns from.
    with pytest.raises(ConfigError, match=r"this run was distilled from .* \(model.teacher=teacher\): pass that"):
        train(compose_run(tmp_path, shard_dir, "distill_tiny", f"model.teacher={other.path}", "trainer.max_steps=9"))
    registry.taint("v1", "trained on the validation split")
    fresh = [f"model.teacher={teacher}", f"paths.log_dir={tmp_path}/logs"]  # the same registry
    with pytest.raises(ConfigError, match=r"tainted: trained on the validation split.*allow_tainted=true"):
        train(compose_run(tmp_path / "fresh", shard_dir, "distill_tiny", *fresh))
    forced = train(compose_run(tmp_path / "fresh", shard_dir, "distill_tiny", *fresh, "allow_tainted=true"))
    assert math.isfinite(forced["val/kl"])


def test_a_registered_teacher_whose_file_changed_is_refused(teacher: Path, shard_dir: Path, tmp_path: Path) -> None:
    copy_of_teacher = tmp_path / "teacher" / "step-000006.ckpt"
    copy_of_teacher.parent.mkdir()
    for suffix in ("", ".json"):
        shutil.copy(f"{teacher}{suffix}", f"{copy_of_teacher}{suffix}")
    Registry(tmp_path / "logs" / "registry").register(copy_of_teacher, alias="teacher")
    with copy_of_teacher.open("ab") as file:
        file.write(b"overwritten")
    with pytest.raises(CheckpointError, match=r"model.teacher=teacher is registry v1, whose file is changed: .*"):
        train(compose_run(tmp_path, shard_dir, "distill_tiny", "model.teacher=teacher"))


@pytest.mark.distributed
@pytest.mark.slow  # two 2-process runs, killed and restarted: about a minute on 2 cores
@pytest.mark.parametrize("trainer", ["ddp_cpu", "fsdp_cpu"])
def test_a_distilled_run_on_two_processes_resumes_exactly(
    teacher: Path, tmp_path: Path, shard_dir: Path, trainer: str
) -> None:
    overrides = [*tiny_run("distill_tiny"), *RESUMABLE, f"trainer={trainer}", f"data.dir={shard_dir}"]
    kill_twice_and_compare(tmp_path, [*overrides, f"model.teacher={teacher}"], kills=(6, 11), max_steps=14)
