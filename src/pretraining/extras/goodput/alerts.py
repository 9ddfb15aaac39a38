"""The conditions that deserve a warning before a run wastes a day. Each is a function of what the `Goodput`
callback measured, returning the warning's text or None; the callback raises each at most once a run."""

from __future__ import annotations

import statistics
from typing import Literal

Condition = Literal["no_improvement", "slow_steps", "data_wait", "crash_loop", "slow_restore"]


def no_improvement(values: list[float], monitor: str, validations: int, tolerance: float) -> str | None:
    """Silent non-convergence: the best of the last `validations` values of `monitor` (lower is better; one per
    validated step, in order) is not below the best before them by more than `tolerance`."""
    if len(values) <= validations:
        return None
    before, recent = min(values[:-validations]), min(values[-validations:])
    if recent < before - tolerance:
        return None
    return (
        f"{monitor} has not improved by more than {tolerance:g} over the last {validations} validations (best "
        f"{recent:.5g} against {before:.5g} before them): the run may have stopped learning. Look at the LR and "
        "the data, or stop it (callbacks.goodput.flat_validations, min_improvement set the test)"
    )


def slow_steps(step_times: list[float], window: int, share: float) -> str | None:
    """A straggler or a slow node: each of the last `window` intervals' seconds per step (the first, with
    compilation, left out) is above the process's median divided by `share`."""
    times = step_times[1:]
    if len(times) < 2 * window:
        return None
    median, recent = statistics.median(times), times[-window:]
    if min(recent) <= median / share:
        return None
    return (
        f"steps are slow: {statistics.mean(recent):.3g} s a step over the last {window} logging intervals, "
        f"against this process's median of {median:.3g} s (throughput below {share:g} of it): a straggler, a slow "
        "node or a throttled device (callbacks.goodput.slow_share, slow_steps set the test)"
    )


def data_wait(waited: float, busy: float, share: float) -> str | None:
    """The data path is the bottleneck: the loop waited for batches more than `share` of its time."""
    if busy <= 0 or waited / busy <= share:
        return None
    return (
        f"the training loop waited for data {waited / busy:.1%} of its time, over {share:.0%}: raise "
        "data.num_workers, or check the storage the shards are read from (callbacks.goodput.data_wait_share)"
    )


def crash_loop(restarts: list[float], now: float, limit: int) -> str | None:
    """More than `limit` restarts after a crash within the last hour (`restarts`: when each attempt began that
    followed one killed or ended by an error; a run continued after a clean stop is no crash)."""
    recent = sum(now - start < 3600 for start in restarts)
    if recent <= limit:
        return None
    return (
        f"{recent} restarts after a kill or an error within the hour, over {limit}: a crash loop? Read the last "
        "attempts' errors (status.json, the job's log) before the scheduler restarts it again "
        "(callbacks.goodput.restarts_per_hour)"
    )


def slow_restore(seconds: float, limit: float) -> str | None:
    """A restore (the set-up of a resumed process) that took more than `limit` seconds."""
    if seconds <= limit:
        return None
    return (
        f"restoring the checkpoint took {seconds:.0f} s, over {limit:g} s: slow storage, or a checkpoint grown "
        "large? Every restart pays it (callbacks.goodput.restore_seconds)"
    )
