"""A run's time and cost, accounted for across its restarts from its record (`pretraining.extras.goodput.record`).

Each attempt's time is split at the line of the step the next attempt resumed from (the last attempt's: at its
last line). Before it, the time went where the line says; after it, the time is lost (steps re-done, and the
saves and validations among them). Productive time is the kept training time: steps whose results the run
keeps, less their data waits and saves. Goodput is its share of the wall time (the sum of the attempts'
lifetimes; the time between them, queued or down, is not the run's). Restarts cost the start-up and set-up
(restore) of every attempt after the first, and every attempt's lost time."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pretraining.extras.goodput.record import SPENT_ON, Attempt

KILLED = "killed (no end recorded: SIGKILL, out of memory, a lost machine)"


@dataclass
class AttemptAccount:
    """One attempt's figures: its wall time, where the kept part went, what was lost after it."""

    number: int
    host: str
    devices: int
    device: str
    resumed_from: int | None
    last_step: int
    kept_step: int
    cause: str
    wall: float
    kept: dict[str, float]
    lost: float

    @property
    def device_hours(self) -> float:
        return self.wall * self.devices / 3600

    @property
    def restart_seconds(self) -> float:
        """Its time lost to restarts: its own lost steps, and for a restart its start-up and set-up (restore)."""
        restarted = self.number > 1
        return self.lost + (self.kept["startup"] + self.kept["setup"] if restarted else 0.0)


def account_attempt(attempt: Attempt, next_attempt: Attempt | None) -> AttemptAccount:
    """`attempt`'s figures, kept up to the step `next_attempt` resumed from (or, last, up to its last line)."""
    lines = [attempt.start, *attempt.lines]
    last = attempt.last
    if next_attempt is None:
        kept_step, kept = last["step"], last
    else:
        resumed = next_attempt.start.get("resumed_from")
        kept_step = -1 if resumed is None else int(resumed)  # a fresh start keeps nothing of this attempt
        before = [line for line in lines if line["step"] <= kept_step]
        kept = before[-1] if before else {"t": attempt.start["started"], "spent": dict.fromkeys(SPENT_ON, 0.0)}
    cause = attempt.cause or (KILLED if next_attempt else "running, or killed and not restarted yet")
    return AttemptAccount(
        number=attempt.number,
        host=attempt.start.get("host", "?"),
        devices=int(attempt.start.get("devices", 1)),
        device=attempt.start.get("device", "?"),
        resumed_from=attempt.start.get("resumed_from"),
        last_step=int(last["step"]),
        kept_step=max(kept_step, 0),
        cause=cause,
        wall=last["t"] - attempt.start["started"],
        kept={name: float(kept["spent"].get(name, 0.0)) for name in SPENT_ON},
        lost=last["t"] - kept["t"],
    )


@dataclass
class RunAccount:
    """The whole run's figures (seconds, device-hours, the price's currency)."""

    attempts: list[AttemptAccount]
    max_steps: int | None
    device_hour: float | None
    unaccounted: list[str] = field(default_factory=list)  # what the record cannot tell

    @property
    def wall(self) -> float:
        return sum(attempt.wall for attempt in self.attempts)

    @property
    def spent(self) -> dict[str, float]:
        """Kept seconds by what they went to, and `redone`: every attempt's lost time."""
        totals = {name: sum(attempt.kept[name] for attempt in self.attempts) for name in SPENT_ON}
        return totals | {"redone": sum(attempt.lost for attempt in self.attempts)}

    @property
    def productive(self) -> float:
        return self.spent["training"]

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    @property
    def lost_to_restarts(self) -> float:
        return sum(attempt.restart_seconds for attempt in self.attempts)

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    @property
    def causes(self) -> dict[str, int]:
        """How each attempt before the last ended, counted."""
        return dict(Counter(attempt.cause for attempt in self.attempts[:-1]))

    @property
    def steps_redone(self) -> int:
        """The steps trained again after restarts: each attempt's beyond the step the next one resumed from."""
        return sum(max(attempt.last_step - attempt.kept_step, 0) for attempt in self.attempts[:-1])

    @property
    def step(self) -> int:
        return self.attempts[-1].last_step if self.attempts else 0

    @property
    def device_hours(self) -> float:
        return sum(attempt.device_hours for attempt in self.attempts)

    @property
    def seconds_per_step(self) -> float | None:
        """Wall seconds per kept step, restarts left out: the pace the projection assumes."""
        if not self.attempts:
            return None
        steps = self.step - (self.attempts[0].resumed_from or 0)
        busy = sum(self.spent[name] for name in SPENT_ON if name not in ("startup", "setup"))
        return busy / steps if steps > 0 else None

    def cost(self, device_hours: float) -> float | None:
        return None if self.device_hour is None else device_hours * self.device_hour

    def projection(self) -> float | None:
        """Device-hours still to spend to `max_steps`, at the run's pace (restarts left out)."""
        pace = self.seconds_per_step
        if pace is None or self.max_steps is None or not self.attempts:
            return None
        return max(self.max_steps - self.step, 0) * pace * self.attempts[-1].devices / 3600

    @property
    def restart_device_hours(self) -> float:
        return sum(attempt.restart_seconds * attempt.devices / 3600 for attempt in self.attempts)

    def as_dict(self) -> dict[str, Any]:
        """Everything `lines` prints, as JSON values."""
        projected = self.projection()
        return {
            "step": self.step,
            "max_steps": self.max_steps,
            "wall_seconds": self.wall,
            "productive_seconds": self.productive,
            "goodput": self.goodput,
            "seconds": self.spent,
            "lost_to_restarts_seconds": self.lost_to_restarts,
            "restarts": self.restarts,
            "steps_redone": self.steps_redone,
            "causes": self.causes,
            "device_hours": self.device_hours,
            "device_hour_price": self.device_hour,
            "cost": self.cost(self.device_hours),
            "cost_lost_to_restarts": self.cost(self.restart_device_hours),
            "projected_device_hours_to_max_steps": projected,
            "projected_cost_to_max_steps": None if projected is None else self.cost(projected),
            "attempts": [dataclasses.asdict(attempt) for attempt in self.attempts],
            "unaccounted": self.unaccounted,
        }


def account_attempts(attempts: list[Attempt]) -> list[AttemptAccount]:
    """Each attempt's figures, kept up to the step the next one resumed from (the last: up to its last line)."""
    return [
        account_attempt(attempt, attempts[index + 1] if index + 1 < len(attempts) else None)
        for index, attempt in enumerate(attempts)
    ]


def account_run(
    attempts: list[Attempt], device_hour: float | None = None, unaccounted: list[str] | None = None
) -> RunAccount:
    """The run's account from its attempts; `device_hour` overrides the price the last attempt recorded."""
    accounts = account_attempts(attempts)
    last = attempts[-1].start if attempts else {}
    price = device_hour if device_hour is not None else last.get("device_hour")
    notes = list(unaccounted or [])
    if attempts and attempts[0].start.get("resumed_from"):
        notes.append(
            f"steps 0-{attempts[0].start['resumed_from']} were trained before the record began (in the run whose "
            "checkpoint this one continued, or without the goodput extra): their time is not accounted for"
        )
    return RunAccount(accounts, last.get("max_steps"), price, notes)


def amount(value: float) -> str:
    """A cost or a count of device-hours: three significant figures (`0.0123`, `4.56`, `789`), whole above 1,000
    (`12,345`)."""
    return f"{value:,.0f}" if value >= 999.5 else f"{value:.3g}"


def hours(seconds: float) -> str:
    """`1 h 02 min`, `3 min 05 s`, `4.2 s`."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.1f} s"


def lines(account: RunAccount) -> list[str]:
    """The account in words, one figure a line."""
    if not account.attempts:
        return ["no attempt recorded", *account.unaccounted]
    wall, spent = account.wall, account.spent

    def share(seconds: float) -> str:
        return f"{hours(seconds)} ({seconds / wall:.1%})" if wall > 0 else hours(seconds)

    def money(device_hours: float) -> str:
        cost = account.cost(device_hours)
        return f"{amount(device_hours)} device-hours" + ("" if cost is None else f", costing {amount(cost)}")

    restarted = [attempt for attempt in account.attempts if attempt.number > 1]
    restore = [attempt.kept["setup"] for attempt in restarted]
    out = [
        f"step {account.step}" + (f" of {account.max_steps}" if (account.max_steps or 0) > 0 else ""),
        f"wall time {hours(wall)} over {len(account.attempts)} attempt(s); productive {share(account.productive)}: "
        f"goodput {account.goodput:.1%}",
        f"lost to restarts {share(account.lost_to_restarts)}: start-up and restore of {len(restarted)} restart(s) "
        f"{hours(sum(a.kept['startup'] + a.kept['setup'] for a in restarted))}, steps re-done "
        f"{hours(spent['redone'])} ({account.steps_redone} steps)",
        f"first start-up and set-up {share(account.attempts[0].kept['startup'] + account.attempts[0].kept['setup'])}",
        f"saving {share(spent['saving'])}, validation {share(spent['validation'])}, downstream evaluation "
        f"{share(spent['evaluation'])}, data wait {share(spent['data_wait'])}, other {share(spent['other'])}",
    ]
    if restore:
        out.append(f"restore (set-up of a resumed process): longest {hours(max(restore))}, total {hours(sum(restore))}")
    causes = ", ".join(f"{cause}: {count}" for cause, count in account.causes.items()) or "none"
    out.append(f"restarts {account.restarts}; how the attempts before the last ended: {causes}")
    out.append(f"spent {money(account.device_hours)}; lost to restarts {money(account.restart_device_hours)}")
    projected = account.projection()
    if projected is not None and account.max_steps and account.step < account.max_steps:
        out.append(
            f"to max_steps={account.max_steps}: {money(projected)} more, at {account.seconds_per_step:.3g} s a step "
            "(restarts not counted)"
        )
    if account.device_hour is None:
        out.append("no price: pass --device-hour (or run with callbacks.goodput.device_hour=...) for costs")
    for attempt in account.attempts:
        resumed = "fresh start" if attempt.resumed_from is None else f"from step {attempt.resumed_from}"
        out.append(
            f"  attempt {attempt.number}: {resumed} to step {attempt.last_step} on {attempt.devices} x "
            f"{attempt.device} ({attempt.host}), {hours(attempt.wall)}, {attempt.cause}"
        )
    return out + [f"not accounted for: {note}" for note in account.unaccounted]
