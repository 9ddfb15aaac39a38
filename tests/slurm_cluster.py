"""A throwaway SLURM cluster on this one host, for tests/test_slurm.py: a controller and two nodes, `n1` and `n2`
(each a `slurmd` declaring its own CPUs whatever the host has), with a munge daemon and key of their own, and the
config, state, spool, pid and log files, all in one temporary directory. Client commands reach it through
`SLURM_CONF` in `env` (sbatch exports it to the jobs, so `scontrol requeue` inside a job finds it too).

Every daemon runs in a session of its own and is stopped by its process id; a job's processes (slurmstepd
daemonizes, out of any daemon's session) are found by this cluster's `SLURM_CONF` in their environment and killed,
so that no process outlives the cluster. Needs root and Debian's slurmctld, slurmd, slurm-client and munge (SLURM
22.05 on bookworm): `require_cluster` skips without them, and fails where CI=true."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from conftest import free_port

PACKAGES = "slurmctld slurmd slurm-client munge"
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # declared whatever the host has (SlurmdParameters=config_overrides): several jobs share the nodes
KILL_WAIT_S = 30  # SIGTERM to SIGKILL: a stopped run's save must fit
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the daemons are in sbin


def unavailable() -> str | None:
    """Why this host cannot run the cluster, or None."""
    missing = [name for name in COMMANDS if shutil.which(name, path=SEARCH_PATH) is None]
    if os.geteuid() != 0:
        return "root (its daemons run as root)"
    if missing:
        return f"{', '.join(missing)}, not installed"
    return None


def require_cluster() -> None:
    """Skip, naming what is missing; under CI (CI=true) fail instead, so that CI never passes without the tests."""
    reason = unavailable()
    if reason is None:
        return
    message = f"a throwaway SLURM cluster needs {reason}: as root, apt-get install {PACKAGES}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def job_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o`'s Key=Value pairs (values with spaces, such as Command, are cut at the first)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


class SlurmCluster:
    """The controller, two nodes and munge of one test module, in `root`: `start`, then `stop` whatever happens."""

    def __init__(self, root: Path, name: str = "pretraining-test") -> None:
        self.root, self.name = root, name
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: dict[str, subprocess.Popen] = {}

    # Starting and stopping.

    def start(self, timeout: float = 60) -> None:
        """Write the key and config, start munged, slurmctld and a slurmd per node; wait until both nodes are idle."""
        for directory in ("munge", "state", "logs", *(f"spool/{node}" for node in NODES)):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: munged refuses a socket under a directory not searchable by all (pytest's are 0700), and every
        # client here is root, who can reach it anyway.
        self.daemon(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.socket}", "--num-threads=4"]
            + [f"--{name}-file={self.root / 'munge' / f'munged.{name}'}" for name in ("pid", "log", "seed")],
        )
        self.wait_until(self.socket.exists, timeout, "munged's socket")
        self.conf.write_text(self.config())
        self.daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            self.daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self.wait_until(self.nodes_idle, timeout, "both nodes idle in sinfo")

    def config(self) -> str:
        state = self.root / "state"
        logs = self.root / "logs"
        nodes = "\n".join(
            f"NodeName={node} NodeHostname=localhost Port={free_port()} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for node in NODES
        )
        return f"""\
ClusterName={self.name}
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Read at the daemons' start only. A requeued job waits out its credential (cred_expire + 1 s, default 120 s)
# before it may start again; the main scheduler's pass (sched_interval, default 60 s) or backfill's then starts it.
AuthInfo=cred_expire=10,socket={self.socket}
SchedulerParameters=bf_interval=5,sched_interval=2
StateSaveLocation={state}
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
# No cgroups (a container's are not ours to use): processes are tracked by parent id, tasks not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
# Each node declares CPUs={CPUS_PER_NODE} whatever the host has.
SlurmdParameters=config_overrides
KillWait={KILL_WAIT_S}
# Ended jobs stay visible to scontrol for the module's life.
MinJobAge=3600
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def daemon(self, name: str, command: list[str]) -> None:
        log = (self.root / "logs" / f"{name}.out").open("ab")
        executable = shutil.which(command[0], path=SEARCH_PATH)
        assert executable, f"{command[0]} not found"
        self.daemons[name] = subprocess.Popen(
            [executable, *command[1:]],
            env=self.env,  # slurmstepd inherits it: how `kill_leftovers` finds a job's processes
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def nodes_idle(self) -> bool:
        for name, process in self.daemons.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode}\n{self.logs()}")
        listing = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return dict(zip(listing[::2], listing[1::2], strict=False)) == dict.fromkeys(NODES, "idle")

    def stop(self) -> None:
        """Cancel every job, stop every daemon this cluster started by its process id (SIGTERM to its session, then
        SIGKILL), and kill any job process left."""
        try:
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self.cancel_all()
        finally:
            for name in reversed(list(self.daemons)):
                stop_session(self.daemons[name])
            self.kill_leftovers()

    def cancel_all(self, timeout: float = KILL_WAIT_S + 15) -> None:
        """Cancel every job of this cluster and wait until none is left running (their SIGKILL comes after KillWait)."""
        self.command("scancel", f"--user={os.geteuid()}", check=False)
        with suppress(AssertionError):  # if not, the daemons' stop and `kill_leftovers` end them
            self.wait_until(lambda: not self.active_jobs(), timeout, "no job left")

    def active_jobs(self) -> list[str]:
        """Jobs pending, running or completing (array tasks one by one)."""
        return self.command("squeue", "-h", "-r", "-o", "%i", check=False).stdout.split()

    def kill_leftovers(self) -> None:
        """SIGKILL every process whose environment names this cluster's config (slurmstepd, job tasks, the jobs'
        children and the launchers the tests started), until none is left."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for _ in range(20):
            pids = [pid for pid in processes_with(marker) if pid != os.getpid()]
            if not pids:
                return
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    # Using it.

    def command(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...) against this cluster."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr}\n{self.logs()}")
        return result

    def sbatch(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit a batch job (with `env` added to the client's environment, which sbatch exports); its id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise AssertionError(f"sbatch exited with {result.returncode}: {result.stderr}\n{self.logs()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields of one job (or array task, `<array>_<task>`)."""
        return job_fields(self.command("scontrol", "show", "job", "-o", job).stdout)

    def wait_for_job(self, job: str, done: Callable[[dict[str, str]], bool], timeout: float, what: str) -> dict:
        """Poll `scontrol show job` until `done(fields)`; the fields then."""
        fields: dict[str, str] = {}

        def reached() -> bool:
            fields.update(self.job(job))
            return done(fields)

        self.wait_until(reached, timeout, f"job {job}: {what} (last seen: {fields.get('JobState')})")
        return fields

    def wait_until(self, condition: Callable[[], object], timeout: float, what: str, every: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def logs(self, lines: int = 25) -> str:
        """The tail of every daemon's log, for a failure's message."""
        parts = []
        for path in sorted((self.root / "logs").glob("*")):
            daemon = self.daemons.get(path.stem)
            if path.suffix == ".out" and path.with_suffix(".log").is_file() and daemon and daemon.poll() is None:
                continue  # a running daemon's output repeats its log file
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} (last {lines} lines)\n" + "\n".join(text))
        return "\n".join(parts)

    @contextmanager
    def explained(self, *files: Path) -> Iterator[None]:
        """Add the daemons' logs, and the tails of `files` (a job's output), to any failure inside."""
        try:
            yield
        except AssertionError as error:
            tails = [f"--- {path} (tail)\n{tail(path)}" for path in files]
            raise AssertionError("\n".join([str(error), *tails, self.logs()])) from None


def tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return "(no file)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_session(process: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM to the process's session (its own: started with start_new_session), then SIGKILL to it after
    `timeout`; while the leader is not yet waited for, its id (the group's) cannot be another process's."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def processes_with(*markers: bytes) -> list[int]:
    """The ids of the processes whose environment holds every one of `markers` (`NAME=value` entries)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or a kernel thread
            continue
        if all(marker in environment for marker in markers):
            found.append(int(entry.name))
    return found
