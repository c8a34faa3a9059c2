"""One line after the trainer exits abnormally: what happened, how far the run got, how to resume.

launch_training.sh runs ``python -m trainer.reports.exit_report --code N [--config F --set ...] -- <its own
command>`` when the trainer exits with anything but 0, 2 or 3. Reads the run folder only (run.json,
the tail of the training log, the error log and the checkpoint folders), so it works after a SIGKILL
too; no torch import.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from trainer import runfolder

OOM_KILL = 137  # 128 + SIGKILL: what a process killed by the kernel's OOM killer exits with


def what_happened(code: int) -> str:
    """The exit code in words: a signal by name, the OOM killer's SIGKILL, or a plain failure."""
    if code == OOM_KILL:
        return "was killed (SIGKILL, exit 137), likely by the kernel's OOM killer (see `dmesg`)"
    if code in (130, 143):
        name = "SIGINT" if code == 130 else "SIGTERM"
        return f"stopped on {name} (exit {code}) after saving a checkpoint"
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return f"was killed by {name} (exit {code})"
    return f"failed (exit {code})"


def last_error(output_dir: Path, since: float) -> str | None:
    """``Type: message`` of the last fatal error logged since ``since`` (this attempt), if any."""
    errors = [
        r
        for r in runfolder.iter_records(output_dir / runfolder.LOGS_DIR / runfolder.ERROR_LOG)
        if isinstance(r.get("ts"), (int, float)) and r["ts"] >= since
    ]
    if not errors:
        return None
    message = " ".join(str(errors[-1].get("message", "")).split())
    message = message if len(message) <= 160 else message[:157] + "..."
    return f"{errors[-1].get('type', 'error')}: {message}" if message else str(errors[-1].get("type"))


def progress_text(output_dir: Path) -> str:
    """``last logged step S/T, last checkpoint NAME`` from the run folder."""
    from trainer.runfolder.checkpoints import latest_checkpoint
    from trainer.sweep.status import progress

    logged = progress(output_dir)
    if logged is None:
        step_text = "no step logged yet"
    else:
        total = f"/{logged['total_steps']}" if logged.get("total_steps") else ""
        step_text = f"last logged step {logged['step']}{total}"
    latest = latest_checkpoint(output_dir)
    ckpt_text = f"last checkpoint {latest.path.name}" if latest else "no checkpoint yet"
    return f"{step_text}, {ckpt_text} in {output_dir}"


def report(code: int, output_dir: Path | None, resume_command: list[str], since: float = 0.0) -> str:
    parts = [f"training {what_happened(code)}"]
    if output_dir is not None:
        error = last_error(output_dir, since) if code not in (130, 143) else None
        if error:
            parts[0] += f": {error}"
        parts.append(progress_text(output_dir))
    line = "; ".join(parts)
    if resume_command:
        line += f". Resume with: {shlex.join(resume_command)}"
    return line


def output_dir_of(config: str, overrides: list[str]) -> Path | None:
    try:
        from trainer.config import load_config

        return Path(load_config(config, overrides).paths.output_dir).resolve()
    except Exception:  # the config was checked before training; a report must never fail
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m trainer.reports.exit_report")
    parser.add_argument("--code", type=int, required=True)
    parser.add_argument("--config", default="training_config.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--since", type=float, default=0.0, help="ignore errors logged before (Unix time)")
    parser.add_argument("--prefix", default="launch_training.sh")
    args = parser.parse_args(argv)
    print(
        f"{args.prefix}: {report(args.code, output_dir_of(args.config, args.overrides), command, args.since)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
