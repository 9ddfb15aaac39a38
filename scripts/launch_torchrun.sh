#!/usr/bin/env bash
# Pretrain with torchrun: it starts one process per GPU on each node, and Lightning joins them
# (it detects torchrun's environment and starts no process itself). Hydra overrides pass through.
#
#   one node, every GPU:  scripts/launch_torchrun.sh experiment=clm_tiny
#   two nodes, run the same command on each with its NODE_RANK:
#     NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/launch_torchrun.sh experiment=gpt2_124m data.dir=data/mine   # on node0
#     NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 scripts/launch_torchrun.sh experiment=gpt2_124m data.dir=data/mine   # on node1
#
# Every rank finds the same run directory (the run's name comes from the overrides), so running the
# same command again continues the run from its newest checkpoint. A SIGTERM to torchrun reaches
# every rank: they save at the next step boundary and exit with status 143.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}   # gpu: one process per visible GPU
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TRAINER=${TRAINER:-ddp}                 # or fsdp, fsdp1; ddp_cpu with NPROC_PER_NODE=2 to try it on a CPU
PYTHON=${PYTHON:-.venv/bin/python}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m pretraining trainer="$TRAINER" ++trainer.num_nodes="$NNODES" "$@"
