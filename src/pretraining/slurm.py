"""What the template asks of SLURM: requeue this job (an array's task alone), also when the time-limit notice comes
before training begins. Only the notice requeues: SLURM sends SIGTERM both for `scancel` and for a preemption, and
a preemption under `PreemptMode=REQUEUE` is requeued by SLURM itself (docs/scale-out.md). Light to import: `pretrain`
installs the start-up handler before it loads torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType

# The signal scripts/launch_slurm.sh and the slurm launcher ask for before the time limit (`--signal=USR1@120`).
NOTICE = signal.SIGUSR1


def job_to_requeue() -> str | None:
    """This job's id for `scontrol requeue`, None outside SLURM. An array task is `<array job>_<task>`: its plain
    SLURM_JOB_ID may be the array's own, and requeueing that requeues every task of the array."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def requeue_this_job() -> None:
    """Put this job back in the queue (SLURM then ends the running one); a failure is reported, not raised."""
    job = job_to_requeue()
    if job is None:
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as error:
        print(f"could not requeue SLURM job {job}: {error}", file=sys.stderr)
        return
    if result.returncode == 0:
        print(f"requeued SLURM job {job}", file=sys.stderr)
    else:
        print(f"could not requeue SLURM job {job}: {result.stderr.strip()}", file=sys.stderr)


def requeue_on_early_notice() -> None:
    """Under SLURM, make the notice that arrives outside training (during start-up, or after training ends) requeue
    the job and exit 128 + the signal: nothing is owed a save there, and the notice's default action would end the
    job unrequeued. Training's own handler (`Preemption`) takes over within each stage. A handler someone else
    installed (submitit's) is kept."""
    if job_to_requeue() is not None and signal.getsignal(NOTICE) is signal.SIG_DFL:
        signal.signal(NOTICE, requeue_and_exit)


def requeue_and_exit(signum: int, frame: FrameType | None) -> None:
    print(f"{signal.Signals(signum).name} received outside training: requeueing the job", file=sys.stderr)
    if os.environ.get("SLURM_PROCID", "0") == "0":  # one task requeues the job; every task exits
        requeue_this_job()
    raise SystemExit(128 + signum)
