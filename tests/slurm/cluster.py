"""A real SLURM cluster for tests: munged, slurmctld and two slurmd (nodes n1 and n2, both on this
host, each with half its CPUs) from Debian's slurm-wlm, each in the foreground as a child of the test,
with every file (config, key, sockets, state, logs) in one temporary folder and ports picked free, so
it touches nothing of the machine's own. Two nodes make `srun -N2` a real two-machine rendezvous.

Needs root (slurmd starts job steps as the submitting user) and the packages slurm-wlm and munge:
run_tests.sh installs them (apt-get) on a CI machine where it is root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """``with Cluster(tmp) as c: c.run("sbatch", ...)``; ``c.env`` is the environment clients need."""

    NODES = ("n1", "n2")

    def __init__(self, folder: Path):
        self.dir = Path(folder)
        self.cpus = max(1, (os.cpu_count() or 1) // len(self.NODES))
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "log", *(f"spool/{n}" for n in self.NODES)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        lines = {
            "ClusterName": "kittest",
            "SlurmctldHost": f"{self.host}(127.0.0.1)",  # no name lookup needed
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "SlurmctldPort": _free_port(),
            "AuthType": "auth/munge",
            "AuthInfo": f"socket={d / 'munge.sock'}",
            "CredType": "cred/munge",
            "StateSaveLocation": d / "state",
            "SlurmdSpoolDir": d / "spool" / "%n",
            "SlurmctldPidFile": d / "slurmctld.pid",
            "SlurmdPidFile": d / "slurmd-%n.pid",
            "SlurmctldLogFile": d / "log" / "slurmctld.log",
            "SlurmdLogFile": d / "log" / "slurmd-%n.log",
            # No cgroups in a container: processes are tracked by parentage, tasks are not bound.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SchedulerType": "sched/backfill",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "KillWait": 30,
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "SchedulerParameters": "sched_interval=2",
        }
        text = "".join(f"{k}={v}\n" for k, v in lines.items())
        for node in self.NODES:  # one host, two slurmd told apart by their ports
            text += (
                f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={_free_port()} "
                f"CPUs={self.cpus} State=UNKNOWN\n"
            )
        text += "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        self.conf.write_text(text)

    def _start(self, *command: str) -> None:
        name = Path(command[0]).name + (f"-{command[3]}" if command[0] == "slurmd" else "")
        log = open(self.dir / "log" / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def start(self) -> Cluster:
        self.write_config()
        d = self.dir
        self._start("munged", "-F", "--force", f"--socket={d / 'munge.sock'}", f"--key-file={d / 'munge.key'}",
                    f"--log-file={d / 'log' / 'munged.log'}", f"--pid-file={d / 'munged.pid'}",
                    f"--seed-file={d / 'munged.seed'}")  # fmt: skip
        self.wait(lambda: (d / "munge.sock").exists(), "munged to create its socket")
        self._start("slurmctld", "-D", "-i", "-f", str(self.conf))
        self.wait(lambda: self.run("sinfo", check=False).returncode == 0, "slurmctld to answer")
        for node in self.NODES:
            self._start("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self.wait(
            lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.split() == ["idle"], "idle nodes"
        )
        return self

    def wait(self, predicate, what: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        raise RuntimeError(f"waited for {what}; daemons exited: {dead or 'none'}\n{self.logs()}")

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {result.returncode}: {result.stderr}")
        return result

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.dir / "log").glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        if self.procs:
            self.run("scancel", "--user=root", check=False)
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
