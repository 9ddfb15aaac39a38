"""Does distillation help? A student of about a quarter of clm_tiny's parameters (width 64 instead of 128)
trained for the same steps on the same data twice: distilled from a trained clm_tiny teacher
(experiment=distill_tiny) and from scratch (experiment=clm_tiny model.backbone.d_model=64). Prints, on the
validation split: each model's bits per byte, and each student's KL(teacher || student) per token at
temperature 1 (how far its next-token distribution is from the teacher's).

Every model is trained by the real `pretrain` command, with the default settings but `--steps` (600: the
clm_tiny run). The teacher is `--teacher CKPT` if given, else a clm_tiny run trained first (about 4.5 min on
2 CPU cores); each student takes about as long.

    python scripts/bench/bench_distill.py --data data/stdlib [--teacher CKPT] [--steps 600] \
        [--log-dir logs/bench_distill]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pretraining.evaluate import build_from_checkpoint
from pretraining.extras.distill.objectives import distillation_sums
from pretraining.stored import load_checkpoint
from trained import pretrain

STUDENT = ["model.backbone.d_model=64"]  # what model/distill.yaml sets: a quarter of clm_tiny's parameters


@torch.no_grad()
def validation_scores(student_path: Path, teacher_path: Path) -> tuple[float, float, float]:
    """(student bits per byte, teacher bits per byte, mean KL(teacher || student) per token) on the
    student's validation set, in float32 on the CPU."""
    student, datamodule = build_from_checkpoint(load_checkpoint(student_path), str(student_path), {})
    teacher, _ = build_from_checkpoint(load_checkpoint(teacher_path), str(teacher_path), {})
    student.eval(), teacher.eval()
    datamodule.setup("validate")
    nll = {"student": 0.0, "teacher": 0.0}
    kl, tokens, text_bytes = 0.0, 0, 0
    for batch in datamodule.val_dataloader():
        scored = student.scored_inputs(batch, validation=True)
        targets = scored.targets
        hidden, teacher_hidden = student.hidden_at(scored), teacher.hidden_at(scored)
        vocab = student.backbone.vocab_size
        head, teacher_head = student.backbone.logits, teacher.backbone.logits
        student_nll, batch_kl = distillation_sums(
            hidden, head, teacher_hidden, teacher_head, targets, vocab, 1.0, False, None
        )
        teacher_nll, _ = distillation_sums(
            teacher_hidden, teacher_head, teacher_hidden, teacher_head, targets, vocab, 1.0, False, None
        )
        nll["student"] += float(student_nll)
        nll["teacher"] += float(teacher_nll)
        kl += float(batch_kl)
        tokens += targets.numel()
        text_bytes += int(batch["target_bytes"].sum())
    bits = 1 / (torch.log(torch.tensor(2.0)).item() * text_bytes)
    return nll["student"] * bits, nll["teacher"] * bits, kl / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the shards (make data: data/stdlib)")
    parser.add_argument("--teacher", type=Path, help="a trained clm_tiny checkpoint (default: train one)")
    parser.add_argument("--steps", type=int, default=600, help="training steps of each student (and the teacher)")
    parser.add_argument("--log-dir", type=Path, default=Path("logs/bench_distill"))
    args = parser.parse_args()
    log_dir = args.log_dir.resolve()
    teacher = args.teacher or pretrain(log_dir, "teacher", args.steps, args.data, "experiment=clm_tiny")
    distilled = pretrain(
        log_dir, "distilled", args.steps, args.data, "experiment=distill_tiny", f"model.teacher={teacher}"
    )
    scratch = pretrain(log_dir, "scratch", args.steps, args.data, "experiment=clm_tiny", *STUDENT)
    rows = {name: validation_scores(path, teacher) for name, path in (("distilled", distilled), ("scratch", scratch))}
    teacher_bpb = rows["scratch"][1]
    print(f"\nteacher {teacher}: val bits per byte {teacher_bpb:.4f}")
    print(f"students ({args.steps} steps, same data and seed): val bits per byte, KL(teacher || student) per token")
    for name, (bpb, _, kl) in rows.items():
        print(f"  {name:<10} {bpb:.4f}   {kl:.4f}")
    (distilled_bpb, _, distilled_kl), (scratch_bpb, _, scratch_kl) = rows["distilled"], rows["scratch"]
    print(f"distilled / scratch: bits per byte {distilled_bpb / scratch_bpb:.3f}, KL {distilled_kl / scratch_kl:.3f}")


if __name__ == "__main__":
    main()
