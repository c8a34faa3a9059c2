"""GLA's start-up on a GPU, per phase: how long a run waits for fla's Triton kernels before it trains (issue 30).

``run`` trains a config through the CLI (``python -m trainer train``) in a subprocess with its own Triton cache
folder (``--fresh`` empties it first: what a fresh machine has) and Triton's autotuning report on, and writes one
row: seconds from launch to the ``kernels:`` line (imports, config, the kernel self-check), the self-check alone
(``kernel_check_s`` of the model report), launch to the first logged step, first to last step, launch to exit,
and how many kernels Triton autotuned and how long that took, before and after the ``kernels:`` line.
``--untuned`` sets ``FLA_CACHE_MODE=disabled``: every kernel autotunes, as before the kit shipped tuned
configurations (trainer/families/fla_tuning.py). ``--model gla-340m`` trains bench/bench_families.py's GLA-340M
(random init, LoRA on all linear layers, 8 x 2048 tokens) instead of ``--config``'s model.

``export`` turns a Triton cache's autotuning results (``*.autotune.json``, written because fla runs its autotuner
with ``cache_results``) into fla's config files (``{kernel}.json`` with ``autotune_entries``), the folder
``trainer/families/fla_configs/<GPU>/`` ships. A kernel name whose entries disagree for one key (two kernels of
one name) is left out: it autotunes. ``--add-to-existing --measured-on CARD`` adds to a shipped folder only the
keys it lacks, each marked with the card that measured it (an H200's picks for shapes the H100 folder lacks:
the H200 borrows that folder, trainer/families/fla_configs/cards.json).

    python bench/gla_startup.py run --label fresh --fresh --triton-cache /tmp/tc --out $OUT/startup.json
    python bench/gla_startup.py export --triton-cache /tmp/tc --to trainer/families/fla_configs/NVIDIA_H100_80GB_HBM3
    python bench/gla_startup.py export --configs /tmp/h200 --to trainer/families/fla_configs/NVIDIA_H100_80GB_HBM3 \
        --add-to-existing --measured-on NVIDIA_H200
    python bench/gla_startup.py table $OUT/startup.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

AUTOTUNED = re.compile(r"Triton autotuning for function (\S+?),")
FINISHED = re.compile(r"finished after ([0-9.]+)s")


def _gla_340m_sets(root: Path) -> list[str]:
    from bench.bench_families import GLA_340M, model_dir

    folder = model_dir(root, GLA_340M)
    return [
        f"model.name_or_path={folder}",
        "model.random_init=true",
        "lora.target_modules=all-linear",
        "training.micro_batch_size=8",
        "data.max_length=2048",
        "eval.interval=1000",
        "eval.at_end=false",
        "training.save_steps=1000",
    ]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def run(args) -> dict:
    cache = Path(args.triton_cache)
    if args.fresh and cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gla-startup-"))
    sets = [f"paths.output_dir={work / 'run'}", "logging.progress_bar=false", *args.set]
    if args.model == "gla-340m":
        sets = _gla_340m_sets(work) + sets
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_PRINT_AUTOTUNING": "1"}
    if args.untuned:
        env["FLA_CACHE_MODE"] = "disabled"
    command = [sys.executable, "-m", "trainer", "train", "--config", args.config]
    if args.launcher:  # what a user types: set-up (venv, extras), config check, then the same trainer
        command = [str(REPO / "launch_training.sh"), "--config", args.config]
    for item in sets:
        command += ["--set", item]
    lines: list[tuple[float, str]] = []
    start = time.time()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    watchdog = threading.Timer(args.timeout, proc.kill)  # the reader below blocks until the run's output ends
    watchdog.start()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - written line by line: a killed run keeps it
    try:
        for line in proc.stdout:
            lines.append((time.time() - start, line.rstrip("\n")))
            if log:
                log.write(f"{lines[-1][0]:8.1f} {lines[-1][1]}\n")
                log.flush()
    except KeyboardInterrupt:  # SIGTERM (an outer timeout) or Ctrl-C: stop the run, still write the row
        proc.kill()
    proc.wait()
    watchdog.cancel()
    if log:
        log.close()
    total = time.time() - start
    kernels_at = next((t for t, line in lines if line.startswith("kernels:")), None)
    tuned = []  # (seconds since launch, kernel, autotuning seconds)
    name = None
    for t, line in lines:
        match = AUTOTUNED.search(line)
        if match:
            name = match.group(1)
        match = FINISHED.search(line)
        if match and name:
            tuned.append((t, name, float(match.group(1))))
            name = None
    run_dir = work / "run"
    steps = _records(run_dir / "logs" / "training_log.jsonl")
    report = next(
        (e for e in _records(run_dir / "logs" / "events.jsonl") if e.get("event") == "model_report"), {}
    )
    before = [x for x in tuned if kernels_at is not None and x[0] <= kernels_at]
    row = {
        "label": args.label,
        "config": args.model or args.config,
        "launcher": args.launcher,
        "sets": args.set,
        "fresh_cache": args.fresh,
        "tuned_configs": not args.untuned,
        "returncode": proc.returncode,
        "to_kernel_line_s": round(kernels_at, 1) if kernels_at is not None else None,
        "kernel_check_s": report.get("kernel_check_s"),
        "kernel_path": report.get("kernel_path"),
        "to_first_step_s": round(steps[0]["ts"] - start, 1) if steps else None,
        "first_to_last_step_s": round(steps[-1]["ts"] - steps[0]["ts"], 1) if steps else None,
        "steps": len(steps),
        "total_s": round(total, 1),
        "autotuned_in_check": len(before),
        "autotune_in_check_s": round(sum(x[2] for x in before), 1),
        "autotuned_after_check": len(tuned) - len(before),
        "autotune_after_check_s": round(sum(x[2] for x in tuned[len(before) :]), 1),
        "autotuned_kernels": sorted({x[1] for x in tuned}),
        "tuned_line": next((line for _, line in lines if line.startswith("fla: tuned")), None),
        "tail": [line for _, line in lines[-8:]],
    }
    if args.out:
        out = Path(args.out)
        rows = json.loads(out.read_text()) if out.exists() else []
        out.write_text(json.dumps([*rows, row], indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in row.items() if k not in ("tail", "autotuned_kernels")}), flush=True)
    return row


def _key_hash(key) -> str:
    """fla's AutotuneKey.key_hash: md5 of the key serialized as fla serializes it (tuples as lists)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def export(args) -> int:
    """Triton's ``*.autotune.json`` under ``--triton-cache`` (or an earlier export's files, ``--configs``) -> fla's
    ``{kernel}.json`` files in ``--to``; with ``--add-to-existing`` into a shipped folder, adding only its missing
    keys, each marked with ``--measured-on``."""
    import triton

    entries: dict[str, dict[str, dict]] = {}
    conflicts: set[str] = set()
    for path in sorted(Path(args.configs).glob("*.json")) if args.configs else ():  # already fla's format
        entries[path.stem] = json.loads(path.read_text())["autotune_entries"]
    for path in sorted(Path(args.triton_cache).rglob("*.autotune.json")) if args.triton_cache else ():
        kernel = path.name.removesuffix(".autotune.json")
        data = json.loads(path.read_text())
        timed = [(c, t) for c, t in data["configs_timings"] if all(map(math.isfinite, t))]
        if not timed:
            continue
        config, timing = min(timed, key=lambda ct: ct[1])
        config = {k: v for k, v in config.items() if k != "pre_hook"}
        digest = _key_hash(data["key"])
        entry = {
            "autotune_key": data["key"],
            "config": config,
            "median_ms": timing[0],
            "candidates": len(timed),
        }
        known = entries.setdefault(kernel, {}).get(digest)
        if known is not None and known["config"] != config:
            conflicts.add(kernel)
        entries[kernel][digest] = entry
    folder = Path(args.to)
    folder.mkdir(parents=True, exist_ok=True)
    written = added = 0
    for kernel, found in sorted(entries.items()):
        if kernel in conflicts:
            continue
        path = folder / f"{kernel}.json"
        if args.add_to_existing and path.exists():  # the folder's own entries stay; keys it lacks are added
            body = json.loads(path.read_text())
            new = {k: v for k, v in found.items() if k not in body["autotune_entries"]}
        else:
            body = {"kernel_name": kernel, "triton_version": triton.__version__, "autotune_entries": {}}
            new = found
        for entry in new.values():
            if args.measured_on:
                entry["measured_on"] = args.measured_on
        body["autotune_entries"].update(new)
        path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        written += 1
        added += len(new)
    print(f"wrote {written} kernels ({added} keys) to {folder}", flush=True)
    if conflicts:
        print(f"left out (entries disagree for one key): {', '.join(sorted(conflicts))}", flush=True)
    return 0


def table(args) -> int:
    rows = json.loads(Path(args.results).read_text())
    head = (
        "label",
        "to_kernel_line_s",
        "kernel_check_s",
        "to_first_step_s",
        "first_to_last_step_s",
        "total_s",
    )
    print(" | ".join(head + ("autotuned (check / after)",)))
    for row in rows:
        tuned = (
            f"{row['autotuned_in_check']} in {row['autotune_in_check_s']} s / "
            f"{row['autotuned_after_check']} in {row['autotune_after_check_s']} s"
        )
        print(" | ".join(str(row.get(k)) for k in head) + f" | {tuned}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    one = verbs.add_parser("run")
    one.add_argument("--config", default="configs/tiny-gla.yaml")
    one.add_argument("--model", choices=["gla-340m"], help="train this model instead of the config's")
    one.add_argument("--set", action="append", default=[], help="section.key=value, as the CLI takes it")
    one.add_argument("--label", default="run")
    one.add_argument("--triton-cache", required=True)
    one.add_argument("--fresh", action="store_true", help="empty the Triton cache first (a fresh machine)")
    one.add_argument("--untuned", action="store_true", help="FLA_CACHE_MODE=disabled: autotune every kernel")
    one.add_argument(
        "--launcher", action="store_true", help="through ./launch_training.sh (VENV_DIR applies)"
    )
    one.add_argument("--timeout", type=float, default=3600)
    one.add_argument("--out", help="append the row to this JSON list")
    one.add_argument("--log", help="write the run's output, time-stamped, here")
    ex = verbs.add_parser("export")
    source = ex.add_mutually_exclusive_group(required=True)
    source.add_argument("--triton-cache")
    source.add_argument("--configs", help="a folder of fla config files (an earlier export) instead")
    ex.add_argument("--to", required=True)
    ex.add_argument(
        "--add-to-existing",
        action="store_true",
        help="keep the kernel files already in --to and add only the keys they lack (a shipped folder)",
    )
    ex.add_argument("--measured-on", help="mark each written entry with the card it was measured on")
    tb = verbs.add_parser("table")
    tb.add_argument("results")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # an outer `timeout` still gets the row written
    if args.verb == "run":
        row = run(args)
        return 0 if row["returncode"] == 0 else 1
    return export(args) if args.verb == "export" else table(args)


if __name__ == "__main__":
    sys.exit(main())
