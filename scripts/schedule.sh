#!/usr/bin/env bash
# A schedule of runs, one after the other: copy it and edit the steps for your own. Each step prints
# the command it runs, and the first one that fails stops the schedule with its exit status.
#
#   (a) a short next-token run: RUN for SHORT_STEPS steps;
#   (b) the same run continued to LONG_STEPS: the same run_name names the same run directory, so it
#       continues from the newest checkpoint of (a), which its checkpoints name as their parent;
#   (c) the final checkpoint evaluated (validation metrics and a sample) and its lineage printed;
#   (d) a masked-LM run on the same data (THEN= leaves it out).
#
#   scripts/schedule.sh                                   # after `make data`: clm_tiny 300 steps, then 600; mlm_tiny
#   scripts/schedule.sh data.dir=data/mine logger=csv     # Hydra overrides for every training run
#   RUN=lr3e-3 SHORT_STEPS=1000 LONG_STEPS=5000 scripts/schedule.sh model.optimizer.lr=3e-3
#
# It runs from the repository root: relative paths (data.dir, BIN, LOG_DIR) are relative to it.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}                    # where the pretrain console scripts are
LOG_DIR=${LOG_DIR:-$PWD/logs}            # runs go to $LOG_DIR/train/runs/<run name>
EXPERIMENT=${EXPERIMENT:-clm_tiny}
RUN=${RUN:-schedule-$EXPERIMENT}
SHORT_STEPS=${SHORT_STEPS:-300}
LONG_STEPS=${LONG_STEPS:-600}
THEN=${THEN-mlm_tiny}                    # the experiment of step (d); empty: no step (d)
THEN_STEPS=${THEN_STEPS:-600}

step() {
    printf '\n==> %s\n' "$*"
    "$@"
}

train() {  # train <experiment> <run name> <steps> [overrides...]
    step "$BIN/pretrain" experiment="$1" run_name="$2" trainer.max_steps="$3" paths.log_dir="$LOG_DIR" "${@:4}"
}

train "$EXPERIMENT" "$RUN" "$SHORT_STEPS" "$@"
train "$EXPERIMENT" "$RUN" "$LONG_STEPS" "$@"

checkpoint="$LOG_DIR/train/runs/$RUN/checkpoints/last.ckpt"
step "$BIN/pretrain-eval" ckpt_path="$checkpoint" paths.log_dir="$LOG_DIR"
step "$BIN/pretrain-info" "$checkpoint"

if [[ -n "$THEN" ]]; then
    train "$THEN" "$RUN-$THEN" "$THEN_STEPS" "$@"
fi
