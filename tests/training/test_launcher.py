"""launch_training.sh: passes arguments through, validates first (exit 2), resumes by itself, explains a crash."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, trainer_env
from trainer import runfolder
from trainer.reports.exit_report import report, what_happened


def launch(*args: str, cwd: Path = REPO, **env_extra: str) -> subprocess.CompletedProcess:
    # Reuse the virtual environment the tests run in (the script installs into it only what is missing).
    env = dict(trainer_env(), VENV_DIR=str(Path(sys.prefix)), NUM_PROCESSES="1", **env_extra)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(REPO / "launch_training.sh"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_bad_config_exits_2_before_training(write_config):
    result = launch("--config", str(write_config()), "--set", "eval.interval=0")
    assert result.returncode == 2
    assert "config error: --set eval.interval=0: eval.interval: expected > 0, got 0" in result.stderr


def test_unknown_argument_exits_2():
    result = launch("--sett", "x")
    assert result.returncode == 2 and "unknown argument '--sett'" in result.stderr


@pytest.mark.slow
def test_runs_then_resumes_by_itself(write_config, tmp_path):
    config = write_config({"training": {"max_steps": 2, "save_steps": 100}})
    first = launch("--config", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"run folder: {tmp_path / 'run'}" in first.stdout
    second = launch("--config", str(config), "--set", "training.max_steps=4", "--extend", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming from {tmp_path / 'run' / 'final-checkpoint-2'}" in second.stdout
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == 4 and info["resumes"] == 1


@pytest.mark.slow
def test_resume_from_a_wrong_path_is_exit_2(write_config, tmp_path):
    result = launch("--config", str(write_config()), "--resume_from", str(tmp_path / "missing"))
    assert result.returncode == 2 and "--resume_from: path not found" in result.stderr
    assert os.access(REPO / "launch_training.sh", os.X_OK)


def test_help_prints_usage_only():
    result = launch("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Usage: ./launch_training.sh")
    assert "--max_restarts N" in result.stdout and "(default 1" in result.stdout
    assert "--verbose" in result.stdout and "--extend" in result.stdout
    assert "set -uo" not in result.stdout and "ROOT=" not in result.stdout


def test_bad_max_restarts_exits_2():
    result = launch("--max_restarts", "many")
    assert result.returncode == 2 and "--max_restarts: expected an integer >= 0" in result.stderr


def test_exit_codes_in_words():
    assert "likely by the kernel's OOM killer" in what_happened(137)
    assert "SIGSEGV" in what_happened(139) and "SIGTERM" in what_happened(143)
    assert what_happened(1) == "failed (exit 1)"


def test_report_reads_the_run_folder(tmp_path):
    run = tmp_path / "run"
    log = runfolder.RunLog(run)
    for step in (1, 2, 3):
        log.write(runfolder.TRAINING_LOG, {"step": step, "total_steps": 12, "loss": 1.0})
    log.write(runfolder.ERROR_LOG, {"step": 3, "type": "RuntimeError", "message": "CUDA error:\n  bad"})
    log.close()
    (run / "checkpoint-2").mkdir()
    line = report(1, run, ["./launch_training.sh", "--config", "my config.yaml"])
    assert line.startswith("training failed (exit 1): RuntimeError: CUDA error: bad; last logged step 3/12")
    assert line.endswith("Resume with: ./launch_training.sh --config 'my config.yaml'")
    # checkpoint-2 has no weights or state: not a checkpoint resume would take
    assert "no checkpoint yet" in line
    assert "RuntimeError" not in report(1, run, [], since=4e9)  # an error from an earlier attempt


@pytest.mark.slow
def test_a_killed_run_is_explained_restarted_once_and_resumed_by_the_printed_command(write_config, tmp_path):
    """SIGKILL the trainer (as the OOM killer would) once checkpoint-2 exists: the launcher explains it in one
    line with the resume command, restarts once by default, and the restart resumes to the end."""
    import time

    import psutil

    config = write_config({"training": {"max_steps": 40, "save_steps": 2}})
    env = dict(trainer_env(), VENV_DIR=str(Path(sys.prefix)), NUM_PROCESSES="1")
    env.pop("PYTHONPATH", None)
    launcher = subprocess.Popen(
        ["bash", str(REPO / "launch_training.sh"), "--config", str(config)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 600
    while not (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    trainers = [
        p for p in psutil.Process(launcher.pid).children(recursive=True) if "trainer" in " ".join(p.cmdline())
    ]
    assert trainers, "no trainer process under the launcher"
    for process in trainers:
        process.kill()
    stdout, stderr = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "Killed" not in stderr  # bash's own line; ours says more
    reports = [line for line in stderr.splitlines() if "likely by the kernel's OOM killer" in line]
    assert len(reports) == 1, stderr[-3000:]
    assert "restart 1/1, resuming from the latest checkpoint" in stderr
    assert f"in {tmp_path / 'run'}" in reports[0] and "last checkpoint checkpoint-" in reports[0]
    command = shlex.split(reports[0].split("Resume with: ", 1)[1])
    assert command == [str(REPO / "launch_training.sh"), "--config", str(config)]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == 40 and info["resumes"] == 1


def test_setup_hides_only_setuptools_editable_warning(tmp_path):
    """The filter setup_venv.sh hands to pip's build, checked against the warning as setuptools raises it."""
    script = REPO / "scripts" / "setup_venv.sh"
    rule = subprocess.run(
        ["bash", "-c", f'. "{script}"; printf %s "$EDITABLE_WARNING_FILTER"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    emit = (
        "import warnings\n"
        "for text in ('Editable installation.\\n!!\\n  ****', 'Another warning'):\n"
        "    warnings.warn_explicit(text, UserWarning, 'editable_wheel.py', 354,\n"
        "                           module='setuptools.command.editable_wheel')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", emit],
        env=dict(os.environ, PYTHONWARNINGS=rule),
        capture_output=True,
        text=True,
    )
    assert "Editable installation" not in result.stderr and "Another warning" in result.stderr

    # setup_venv hands the filter to `pip install -e` (only), unless KIT_VERBOSE: a stand-in venv records calls.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "${{PYTHONWARNINGS:-none}}|$*" >> "{calls}"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\n')
    for verbose in ("0", "1"):
        calls.write_text("")
        for stamp in venv.glob(".installed-*"):
            stamp.unlink()
        env = dict(os.environ, VENV_DIR=str(venv), KIT_VERBOSE=verbose)
        subprocess.run(["bash", "-c", f'. "{script}"; setup_venv train'], env=env, check=True)
        install = [line for line in calls.read_text().splitlines() if "install" in line and " -e " in line]
        assert len(install) == 1, calls.read_text()
        expected = "none|-m pip install -e" if verbose == "1" else f"{rule}|-m pip install -q -e"
        assert install[0].startswith(expected), install


def test_a_gpu_machine_gets_the_fast_path_extra(tmp_path):
    """launch_training.sh installs liger-kernel (the fast path's kernels) where an NVIDIA GPU answers."""
    script = REPO / "scripts" / "setup_venv.sh"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (fake / "nvidia-smi").chmod(0o755)

    def extras(path: str) -> str:
        env = dict(os.environ, PATH=path)
        return subprocess.run(
            ["bash", "-c", f'. "{script}"; train_extras'], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()

    assert extras(f"{fake}:/usr/bin:/bin") == "train,fast"
    assert extras("/usr/bin:/bin") == "train"


def model_extras(tmp_path: Path, needs_answer: str, pip_ok: bool = True, needs_code: int = 0):
    """Run setup_model_extras in a stand-in venv whose `python` answers `-m trainer needs` with needs_answer
    (until a pip install succeeds) and records its calls: (return code, calls, stderr)."""
    script = REPO / "scripts" / "setup_venv.sh"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    calls, answer = tmp_path / "calls.txt", tmp_path / "missing.txt"
    calls.write_text("")
    answer.write_text(needs_answer)
    install = f': > "{answer}"' if pip_ok else "exit 1"  # a successful install leaves nothing missing
    (venv / "bin" / "python").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{calls}"\n'
        'case "$*" in\n'
        f'  "-m trainer needs"*) cat "{answer}"; exit {needs_code} ;;\n'
        f'  *"pip install"*" -e "*) {install} ;;\n'
        "esac\n"
    )
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\n')
    env = dict(os.environ, VENV_DIR=str(venv), PATH=f"{venv / 'bin'}:{os.environ['PATH']}", KIT_VERBOSE="0")
    result = subprocess.run(
        ["bash", "-c", f'. "{script}"; setup_model_extras train --config x.yaml --set a.b=1'],
        env=env,
        capture_output=True,
        text=True,
    )
    return result.returncode, calls.read_text().splitlines(), result.stderr


def test_the_launcher_installs_the_extra_a_model_needs(tmp_path):
    """`needs` says gla: the kit is installed with [train,gla] (even under an old stamp), then checked again."""
    stale = subprocess.run(
        ["bash", "-c", f'. "{REPO / "scripts" / "setup_venv.sh"}"; venv_stamp train,gla'],
        env=dict(os.environ, VENV_DIR=str(tmp_path / "venv")),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(stale).parent.mkdir(parents=True)
    Path(stale).touch()
    code, calls, stderr = model_extras(tmp_path, "gla")
    assert code == 0, stderr
    assert calls[0] == "-m trainer needs --missing --config x.yaml --set a.b=1"
    assert [c for c in calls if " -e " in c] == [f"-m pip install -q -e {REPO}[train,gla]"]
    assert calls[-1] == calls[0] and Path(stale).exists()


def test_nothing_missing_installs_nothing(tmp_path):
    code, calls, stderr = model_extras(tmp_path, "")
    assert (code, calls, stderr) == (0, ["-m trainer needs --missing --config x.yaml --set a.b=1"], "")


def test_a_bad_config_stops_the_launcher_before_any_install(tmp_path):
    code, calls, _ = model_extras(tmp_path, "", needs_code=2)
    assert code == 2 and len(calls) == 1


def test_an_extra_that_cannot_be_installed_stops_with_the_command_to_run(tmp_path):
    """Offline or no wheel: one line with the exact pip command, exit 2, before any model loads."""
    code, calls, stderr = model_extras(tmp_path, "gla", pip_ok=False)
    assert code == 2
    python = tmp_path / "venv" / "bin" / "python"
    assert stderr.splitlines()[-1] == (
        "[setup] error: could not install the [gla] extra this model needs; run: "
        f"{python} -m pip install -e '{REPO}[train,gla]'  (then launch again)"
    )
    assert not any("trainer train" in c for c in calls)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        "training_config.yaml",
        *sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("configs/tiny-*.yaml")),
    ],
)
def test_every_example_config_trains_through_the_launcher(config, tmp_path):
    """The README's first command with --config, for the default and every tiny example (GLA, Mamba, Mamba-2):
    the shared venv has their extras, so the install step finds nothing to do; two steps, a finished run."""
    out = tmp_path / "run"
    result = launch("--config", config, "--set", "training.max_steps=2", "--set", f"paths.output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[setup]" not in result.stderr
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "finished" and info["step"] == 2
