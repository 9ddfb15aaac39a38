"""What the template asks of SLURM: requeue this job (an array's task alone), also when the time-limit notice comes
before training begins. Only the notice requeues: SLURM sends SIGTERM both for `scancel` and for a preemption, and
a preemption under `PreemptMode=REQUEUE` is requeued by SLURM itself (docs/scale-out.md). Light to import: `pretrain`
installs the start-up handler before anything loads torch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType

# The signal scripts/launch_slurm.sh and the slurm launcher ask for before the time limit (`--signal=USR1@120`).
NOTICE = signal.SIGUSR1


class EarlyNotice:
    """Whether this process received the notice outside training without acting on it (a task other than the
    first): `Preemption` takes it over when training's stage begins."""

    received = False


def job_to_requeue() -> str | None:
    """This job's id for `scontrol requeue`, None outside SLURM. An array task is `<array job>_<task>`: its plain
    SLURM_JOB_ID may be the array's own, and requeueing that requeues every task of the array."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def requeue_this_job() -> tuple[bool, str]:
    """Put this job back in the queue (SLURM then ends the running one): whether it was, and what to report."""
    job = job_to_requeue()
    try:
        result = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"could not requeue SLURM job {job}: {error}"
    if result.returncode:
        return False, f"could not requeue SLURM job {job}: {result.stderr.strip()}"
    return True, f"requeued SLURM job {job}"


def requeue_on_early_notice() -> None:
    """Under SLURM, make the notice that comes outside training (during the start-up, or after training) requeue the
    job: its default action would end the job unrequeued, and nothing is owed a save there. Training's own handler
    (`Preemption`) takes over within each stage. A handler someone else installed (submitit's) is kept."""
    if job_to_requeue() is not None and signal.getsignal(NOTICE) is signal.SIG_DFL:
        signal.signal(NOTICE, requeue_and_exit)


def leave_the_notice_alone() -> None:
    """Undo `requeue_on_early_notice` (a job with `callbacks.preemption.requeue=false`)."""
    if signal.getsignal(NOTICE) is requeue_and_exit:
        signal.signal(NOTICE, signal.SIG_DFL)


def requeue_and_exit(signum: int, frame: FrameType | None) -> None:
    """The first task requeues the job and exits 128 + the signal at once, as abruptly as the signal's default
    action would have ended it (after training, a checkpoint being written is, atomically, whole or not there; the
    requeued job continues from the newest there). The others go on, the notice noted: exiting, they would have
    `srun --kill-on-bad-exit` kill the first task before its requeue; SLURM's requeue ends them.

    Not by raising SystemExit: raised at whatever line the start-up was on, it can meet cleanup code that is not
    written for it (OmegaConf's, while Hydra composes the config: an AttributeError replaces it, and Hydra catches
    that), and the run went on training after its job was requeued."""
    if os.environ.get("SLURM_PROCID", "0") != "0":
        EarlyNotice.received = True
        return
    _, message = requeue_this_job()  # first: a write to a blocked stderr could stop the handler before it
    os.write(2, f"{signal.Signals(signum).name} received outside training: {message}\n".encode())
    for stream in (sys.stdout, sys.stderr):  # what a print left in a buffer (SLURM's output is a file)
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
