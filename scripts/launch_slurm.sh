#!/bin/bash
# Pretrain on SLURM: sbatch [--nodes=4] scripts/launch_slurm.sh experiment=gpt2_124m data.dir=data/mine
# To try it on CPUs (a cluster without GPUs; MASTER_ADDR where the node names do not resolve), one task and
# so one device per node:
#   TRAINER=ddp_cpu sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 \
#       scripts/launch_slurm.sh experiment=clm_tiny trainer.devices=1
#
# srun starts one task per GPU on every node and Lightning joins them (it detects SLURM and starts no
# process itself). Before the time limit SLURM sends USR1 to every task: they save a checkpoint at the
# next step boundary, rank zero requeues the job (`scontrol requeue`; an array's task alone), and all
# exit; a notice during start-up requeues the job at once. The requeued job runs this same command, which
# finds the same run directory and continues from its newest checkpoint. A SIGTERM (`scancel`, or a
# preemption) saves the same way and exits without requeueing: a cancelled job stays cancelled, and a
# preempted one is requeued by SLURM where PreemptMode=REQUEUE (docs/scale-out.md). Keep resume=never out
# of this script.
#
# One task per GPU (--ntasks-per-node = --gpus-per-node); --cpus-per-task feeds each rank's DataLoader
# workers; --signal sends USR1 to every task 120 s before the time limit; --requeue lets the job be
# requeued; a requeued job appends to the same output file (under logs/, which the checkout has).
#SBATCH --job-name=pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/slurm-%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"

srun --kill-on-bad-exit=1 .venv/bin/pretrain trainer="${TRAINER:-ddp}" ++trainer.num_nodes="$SLURM_JOB_NUM_NODES" "$@"
