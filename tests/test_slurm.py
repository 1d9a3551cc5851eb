"""The launch templates, tested for real: a one-node Slurm cluster on this machine runs
``launch/slurm/ptq-multi-node.sbatch`` on the tiny Llama (CPU, gloo), and ``launch/torchrun.sh``
runs the same quantization without Slurm.

The cluster test needs root and Debian's ``slurm-wlm`` and ``munge`` (installed here with apt-get
when missing).  It starts its own munged, slurmctld and slurmd on free ports with every state,
spool, socket, key and log file in a temp folder (``SLURM_CONF`` points the clients at it; nothing
in /etc is read or changed), and stops them, and anything they started, when the module ends.
Where that is impossible (not root, no apt-get, no package source reachable) it is skipped with
the reason, unless ``SQ_REQUIRE_SLURM=1`` turns the skip into a failure.

The job: 2 torchrun agents x 1 rank on the one node (``TASKS_PER_NODE=2`` simulates two nodes), so
the agents meet through the template's c10d rendezvous on the head node exactly as two nodes
would.  Its first start is stopped mid-run like a preempted job: ``PYTHON`` is a stand-in that,
on the first start only (``SLURM_RESTART_COUNT`` unset), runs torchrun with the test-only fault
``SQ_FAULT=after-shard-write:1:1`` (rank 1 SIGKILLed after writing block 1's shard) and then holds
the node.  The test then sends the batch shell the USR1 that ``--signal=B:USR1@300`` sends before
a time limit: the template requeues the job, Slurm starts it again (``SLURM_RESTART_COUNT=1``), the
template drops the killed run's lock and ``--resume auto`` continues from block 1.  The output
must load in transformers and equal, tensor for tensor, what ``launch/torchrun.sh`` writes on 2
ranks in one go.  ``ptq-single-node.sbatch`` runs the same quantization on 2 ranks of one node
(torchrun --standalone) and must give the same tensors.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_ports
from quant_ref import read_tensors
import torch

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = [LAUNCH / "torchrun.sh", LAUNCH / "slurm" / "ptq-single-node.sbatch",
           LAUNCH / "slurm" / "ptq-multi-node.sbatch"]
DOC = ROOT / "docs" / "slurm.md"
PTQ = {"ALGO": "rtn", "SCHEME": "W4A16", "GROUP_SIZE": "16"}   # 16 divides the tiny Llama's widths
SLURM_BINARIES = ["munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol",
                  "squeue", "scancel", "sinfo"]
APT_PACKAGES = ["slurm-wlm", "munge"]
JOB_TIMEOUT = 300.0        # seconds from submission to the job's end, requeue included
FAULT = "after-shard-write:1:1"   # test-only: SIGKILL rank 1 once block 1's shard is written
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
KNOB = re.compile(r'^([A-Z][A-Z0-9_]*)="\$\{\1:-.*\}"\s+#\s*\S')


# --------------------------------------------------------------------------------------------
# cheap checks of the scripts themselves


def _knobs(script: Path) -> list[tuple[str, str]]:
    """The knob block: lines from ``# ---- knobs`` to the next ``# ----`` header."""
    lines, inside = [], False
    for line in script.read_text().splitlines():
        if line.startswith("# ---- knobs"):
            inside = True
            continue
        if inside and line.startswith("# ----"):
            break
        if inside and line.strip():
            lines.append(line)
    return [(line.split("=", 1)[0], line) for line in lines]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_every_knob_is_documented(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    knobs = _knobs(script)
    assert len(knobs) >= 8, f"{script.name}: no knob block found"
    doc = DOC.read_text()
    for name, line in knobs:
        assert KNOB.match(line), f'{script.name}: knob line is not NAME="${{NAME:-default}}"  # comment: {line!r}'
        assert f"`{name}`" in doc, f"{script.name}: knob {name} is missing from docs/slurm.md"
    names = {n for n, _ in knobs}
    assert {"MODEL", "OUTPUT", "SCHEME", "ALGO", "EP", "NPROC_PER_NODE", "VENV", "PYTHON",
            "EXTRA_ARGS"} <= names, script.name
    if script.suffix == ".sbatch":
        directives = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
        assert any("--requeue" in d for d in directives), script.name
        for d in directives:   # site-specific settings stay commented out (##SBATCH)
            assert not re.search(r"--(partition|account|qos|gpus|gres|time|constraint)\b", d), d


@pytest.mark.parametrize("script", SCRIPTS[1:], ids=lambda p: p.name)
def test_sbatch_script_refuses_to_run_outside_slurm(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert res.returncode == 2 and "run this script with sbatch" in res.stderr, res.stderr


# --------------------------------------------------------------------------------------------
# helpers


def _run(cmd: list[str], *, timeout: float, env=None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with a timeout that fails the test (never a hang) and readable errors."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout:.0f}s\n{e.stdout or ''}\n{e.stderr or ''}")
    if check and res.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def _skip(reason: str):
    if os.environ.get("SQ_REQUIRE_SLURM") == "1":
        pytest.fail(f"SQ_REQUIRE_SLURM=1 but: {reason}")
    pytest.skip(reason)


def _load(out: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info   # no missing / unexpected / mismatched keys
    return model


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _apt_candidates_ok(env) -> bool:
    res = _run(["apt-cache", "policy", *APT_PACKAGES], timeout=60, env=env, check=False)
    cands = re.findall(r"Candidate:\s*(\S+)", res.stdout)
    return res.returncode == 0 and len(cands) == len(APT_PACKAGES) and "(none)" not in cands


def ensure_slurm_installed() -> float:
    """Install slurm-wlm and munge with apt-get when missing; return the seconds apt took."""
    if not sys.platform.startswith("linux"):
        _skip("a real Slurm needs Linux")
    if os.geteuid() != 0:
        _skip("a real Slurm needs root here (daemons, apt-get)")
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return 0.0
    if not shutil.which("apt-get"):
        _skip("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    t0 = time.monotonic()
    if not _apt_candidates_ok(env):
        _run(["apt-get", "update", "-q"], timeout=300, env=env, check=False)
        if not _apt_candidates_ok(env):
            _skip(f"apt has no candidate for {' '.join(APT_PACKAGES)} (no package source reachable?)")
    res = _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120",
                *APT_PACKAGES], timeout=600, env=env, check=False)
    if res.returncode != 0:
        _skip(f"apt-get install {' '.join(APT_PACKAGES)} failed (exit {res.returncode}): {res.stderr[-1500:]}")
    missing = [b for b in SLURM_BINARIES if not shutil.which(b)]
    if missing:
        pytest.fail(f"apt-get installed {APT_PACKAGES} but these are missing: {missing}")
    return time.monotonic() - t0


def _assert_same_tensors(ref_out: Path, out: Path) -> None:
    ref, got = read_tensors(ref_out), read_tensors(out)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


# --------------------------------------------------------------------------------------------
# the cluster


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.apt_seconds = 0.0
        self.start_seconds = 0.0

    def env(self, **extra: str) -> dict[str, str]:
        return _clean_env(SLURM_CONF=str(self.conf), **extra)

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.root / name
        return f"--- {name}\n{p.read_text(errors='replace')[-n:]}" if p.is_file() else f"--- {name}: none"

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.console", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _wait(self, what: str, ok, timeout: float, logs: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    pytest.fail(f"{name} exited with {p.returncode} while waiting for {what}\n"
                                + "\n".join(self.log_tail(x) for x in (f"{name}.console", f"{name}.log")))
            if ok():
                return
            time.sleep(0.3)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n" + "\n".join(self.log_tail(x) for x in logs))

    def start(self) -> None:
        t0 = time.monotonic()
        (self.root / "munge").mkdir(mode=0o700)
        for d in ("state", "spool"):
            (self.root / d).mkdir()
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--log-file={self.root / 'munged.log'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}"])

        def munge_works() -> bool:
            if not self.munge_socket.exists():
                return False
            cred = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True, timeout=10)
            if cred.returncode != 0:
                return False
            back = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=cred.stdout,
                                  capture_output=True, timeout=10)
            return back.returncode == 0

        self._wait("munged", munge_works, 30, ("munged.console", "munged.log"))

        ctld_port, slurmd_port = free_ports(2)
        cpus = max(2, os.cpu_count() or 1)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=sqtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it starts again (120 s by default)
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MailProg=/bin/true",
            "KillWait=5",
            "MinJobAge=600",
            "InactiveLimit=0",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=sqtest Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])

        def node_idle() -> bool:
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                 env=self.env(), timeout=20)
            return res.returncode == 0 and res.stdout.strip() == "idle"

        self._wait("the node to be idle in sinfo", node_idle, 60, ("slurmctld.log", "slurmd.log"))
        self.start_seconds = time.monotonic() - t0

    def job(self, job_id: str) -> dict[str, str]:
        res = _run(["scontrol", "show", "job", "-o", job_id], timeout=30, env=self.env(), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", res.stdout)) if res.returncode == 0 else {}

    def stop(self) -> None:
        """Cancel every job, stop the daemons (by pid), then kill whatever they left behind."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                ids = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                                     env=self.env(), timeout=20).stdout.split()
                if ids:
                    subprocess.run(["scancel", *ids], env=self.env(), timeout=20, capture_output=True)
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline and subprocess.run(
                            ["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                            env=self.env(), timeout=20).stdout.strip():
                        time.sleep(0.5)
            except (subprocess.SubprocessError, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        # slurmstepd and job processes detach from slurmd; they all carry our SLURM_CONF
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftover_pids(self) -> list[int]:
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
        return pids


def _job_report(cluster: Cluster, job_id: str, msg: str, files: list[Path]) -> str:
    parts = [msg, f"job: {cluster.job(job_id)}"]
    for p in files:
        parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" if p.is_file() else f"--- {p.name}: none")
    parts += [cluster.log_tail("slurmctld.log"), cluster.log_tail("slurmd.log")]
    return "\n".join(parts)


def _wait_final(cluster: Cluster, job_id: str, deadline: float, report) -> dict[str, str]:
    while True:
        if time.monotonic() > deadline:
            pytest.fail(report("the job did not finish in time"))
        job = cluster.job(job_id)
        if job.get("JobState") in FINAL_STATES:
            return job
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    apt_seconds = ensure_slurm_installed()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    cluster.apt_seconds = apt_seconds
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def torchrun_sh_output(checkpoints, tmp_path_factory):
    """``launch/torchrun.sh`` on 2 CPU ranks (no Slurm)."""
    out = tmp_path_factory.mktemp("torchrun-sh") / "out"
    env = _clean_env(MODEL=str(checkpoints["llama"]), OUTPUT=str(out), NPROC_PER_NODE="2",
                     OMP_NUM_THREADS="1", PYTHON=sys.executable, **PTQ)
    proc = subprocess.Popen([str(LAUNCH / "torchrun.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"launch/torchrun.sh timed out\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    return out, log


def test_torchrun_sh_quantizes_on_two_cpu_ranks(torchrun_sh_output):
    out, log = torchrun_sh_output
    _load(out)
    assert json.loads((out / "sq_report.json").read_text())["world_size"] == 2
    assert "2 rank(s) x 1 thread(s)" in log


@pytest.mark.timeout(1500)   # apt-get (update + install: at most 900 s on a slow mirror) + the job (300 s)
def test_slurm_multi_node_job_stopped_mid_run_requeues_and_resumes(slurm_cluster, checkpoints, torchrun_sh_output, tmp_path):
    cluster = slurm_cluster
    out, logs, workdir = tmp_path / "out", tmp_path / "logs", tmp_path / "job"
    workdir.mkdir()
    (rdzv_port,) = free_ports(1)
    # PYTHON stand-in: the first start dies at the fault (rank 1, after block 1's shard), then holds
    # the node until Slurm takes it back, like a job preempted mid-run; later starts run normally.
    python = tmp_path / "python-first-start-stops"
    python.write_text(f"""#!/bin/sh
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && [ "$1 $2" = "-m torch.distributed.run" ]; then
  SQ_FAULT={FAULT} {shlex.quote(sys.executable)} "$@"
  echo "[test] first start stopped (exit $?); waiting to be requeued"
  exec sleep 900
fi
exec {shlex.quote(sys.executable)} "$@"
""")
    python.chmod(0o755)
    knobs = dict(MODEL=str(checkpoints["llama"]), OUTPUT=str(out), NNODES="1", TASKS_PER_NODE="2",
                 NPROC_PER_NODE="1", OMP_NUM_THREADS="1", PYTHON=str(python), LOG_DIR=str(logs),
                 RDZV_PORT=str(rdzv_port), **PTQ)
    try:
        socket.gethostbyname(cluster.host)
    except OSError:   # the node's name does not resolve here: rendezvous on the loopback address
        knobs["RDZV_HOST"] = "127.0.0.1"
    env = cluster.env(**knobs)
    t0 = time.monotonic()
    res = _run(["sbatch", "--parsable", f"--chdir={workdir}", "--job-name=sq-slurm-test", "--nodes=1",
                "--ntasks-per-node=2", f"--output={workdir}/%x-%j.out",
                str(LAUNCH / "slurm" / "ptq-multi-node.sbatch")], timeout=60, env=env)
    job_id = res.stdout.strip().split(";")[0]
    batch_log = workdir / f"sq-slurm-test-{job_id}.out"
    node_logs = [logs / f"sq-slurm-test-{job_id}-{cluster.host}-{t}.out" for t in (0, 1)]

    def report(msg: str) -> str:
        return _job_report(cluster, job_id, msg, [batch_log, *node_logs])

    # 1. the first start stopped after block 1: ask the batch shell to requeue, as Slurm does
    #    before the time limit
    deadline = t0 + JOB_TIMEOUT
    signalled = False
    while not signalled:
        if time.monotonic() > deadline:
            pytest.fail(report("the job did not start its srun step in time"))
        job = cluster.job(job_id)
        if job.get("JobState") in FINAL_STATES:
            pytest.fail(report(f"the job ended ({job.get('JobState')}) before it could be requeued"))
        if job.get("JobState") == "RUNNING" and any(p.is_file() and "waiting to be requeued" in p.read_text()
                                                     for p in node_logs):
            _run(["scancel", "--batch", "--signal=USR1", job_id], timeout=30, env=cluster.env())
            signalled = True
        else:
            time.sleep(0.3)
    # 2. requeued, started again, finished
    job = _wait_final(cluster, job_id, deadline, report)
    job_seconds = time.monotonic() - t0
    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", report("job failed")
    assert job.get("Restarts") == "1", report("expected exactly one requeue")

    batch = batch_log.read_text()
    assert "USR1 (time limit near): requeueing" in batch, report("no requeue in the batch log")
    assert re.search(r"start 1 on .*1 node\(s\) x 2 agent\(s\) x 1 rank\(s\), rendezvous c10d \S+:%d" % rdzv_port,
                     batch), report("no second start with the c10d rendezvous")
    assert "requeued start 1: removing the previous run's lock" in batch, report("the killed run's lock was not dropped")
    assert "srun exited with 0" in batch, report("srun failed")
    texts = [p.read_text() for p in node_logs]
    for t, text in enumerate(texts):   # per-node logs, appended to across the requeue
        assert f"agent {t} of 2, job {job_id} start 0" in text, report(f"{node_logs[t].name}: first start missing")
        assert f"agent {t} of 2, job {job_id} start 1" in text, report(f"{node_logs[t].name}: second start missing")
    assert any("fault injection: SIGKILL" in text for text in texts), report("the fault did not fire")

    report_json = json.loads((out / "sq_report.json").read_text())
    assert report_json["world_size"] == 2
    assert report_json["resumed_from_block"] == 1, report("the second start did not resume at block 1")
    assert not (out / ".sq-run").exists()
    _load(out)
    _assert_same_tensors(torchrun_sh_output[0], out)
    print(f"\nslurm: apt {cluster.apt_seconds:.1f}s, cluster start {cluster.start_seconds:.1f}s, "
          f"job (requeue included) {job_seconds:.1f}s")


@pytest.mark.timeout(1500)   # run alone (-k), it pays for apt-get
def test_slurm_single_node_template(slurm_cluster, checkpoints, torchrun_sh_output, tmp_path):
    """``ptq-single-node.sbatch``: srun -> torchrun --standalone, 2 CPU ranks, default log names."""
    cluster = slurm_cluster
    out, logs, workdir = tmp_path / "out", tmp_path / "logs", tmp_path / "job"
    workdir.mkdir()
    env = cluster.env(MODEL=str(checkpoints["llama"]), OUTPUT=str(out), NPROC_PER_NODE="2", PYTHON=sys.executable,
                      LOG_DIR=str(logs), **PTQ)
    t0 = time.monotonic()
    res = _run(["sbatch", "--parsable", f"--chdir={workdir}", str(LAUNCH / "slurm" / "ptq-single-node.sbatch")],
               timeout=60, env=env)
    job_id = res.stdout.strip().split(";")[0]
    batch_log, node_log = workdir / f"sq-ptq-{job_id}.out", logs / f"sq-ptq-{job_id}-{cluster.host}.out"

    def report(msg: str) -> str:
        return _job_report(cluster, job_id, msg, [batch_log, node_log])

    job = _wait_final(cluster, job_id, t0 + JOB_TIMEOUT, report)
    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", report("job failed")
    assert "2 rank(s), torchrun --standalone" in batch_log.read_text(), report("batch log")
    assert f"node {cluster.host}, job {job_id} start 0" in node_log.read_text(), report("per-node log")
    assert json.loads((out / "sq_report.json").read_text())["world_size"] == 2
    _load(out)
    _assert_same_tensors(torchrun_sh_output[0], out)
    print(f"\nslurm single node: job {time.monotonic() - t0:.1f}s")
