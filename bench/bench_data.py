"""Data preparation at real sizes (issue 29): the kit's cache build against raw ``tokenizers`` on the same
texts and cores, measured in the same run, with memory, the second launch and training on the cache.

For each corpus size (JSONL ``text`` records, generated from the shipped corpus's sentences, seeded):
  raw        ``tokenizers.Tokenizer.encode_batch`` over every text (1,000 a call, all cores through Rayon),
             only the encoding timed (reading the file is not)
  prepare    ``python -m trainer preprocess`` into a fresh cache: its own "built in X s" (read, parse,
             tokenize in worker processes, split, pack, write), and the peak memory of its process tree
  second     the same command again: the cache found and opened ("reused in X s")
  train      ``python -m trainer train`` for a few steps on that cache, peak memory, against the same run on
             the tiny shipped corpus (``--train-steps``)
Then a chat-format corpus (``messages``, from data/tiny_chat.jsonl's conversations, multi-turn mixed in)
prepared and trained the same way.

Memory is the peak over 0.2 s samples of the process tree's proportional set size (PSS: pages shared
between the parent and its forked workers counted once), and of the largest single process's RSS.
Targets: prepare >= 0.7x raw's speed; peak PSS < 1.5 GB at every size (flat, not growing); train <= 0.5 GB
over the tiny-corpus run; second launch < 5 s.

    python bench/bench_data.py                              # 100 and 400 MB text, 200 MB chat
    python bench/bench_data.py --sizes 20 --chat-mb 20      # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "configs" / "tiny-moe" / "tokenizer.json"
MB = 2**20


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---------------------------------------------------------------- corpora


def make_text_corpus(path: Path, megabytes: int) -> Path:
    """Records of 1-6 of the shipped corpus's documents joined by blank lines, until the size is reached."""
    if path.is_file() and path.stat().st_size >= megabytes * MB:
        return path
    docs = [json.loads(line)["text"] for line in (REPO / "data" / "tiny_corpus.jsonl").open()]
    rng, written = random.Random(0), 0
    with open(path, "w") as out:
        while written < megabytes * MB:
            line = (
                json.dumps({"text": "\n\n".join(rng.choice(docs) for _ in range(rng.randint(1, 6)))}) + "\n"
            )
            out.write(line)
            written += len(line)
    return path


def make_chat_corpus(path: Path, megabytes: int) -> Path:
    """Conversations of 1-4 exchanges drawn from the shipped chat sample, some with a system turn."""
    if path.is_file() and path.stat().st_size >= megabytes * MB:
        return path
    pairs, systems = [], []
    for line in (REPO / "data" / "tiny_chat.jsonl").open():
        turns = json.loads(line).get("messages") or []
        systems += [t["content"] for t in turns if t.get("role") == "system"]
        pairs += [
            (a, b) for a, b in zip(turns, turns[1:]) if a["role"] == "user" and b["role"] == "assistant"
        ]
    rng, written = random.Random(0), 0
    with open(path, "w") as out:
        while written < megabytes * MB:
            turns = (
                [{"role": "system", "content": rng.choice(systems)}] if systems and rng.random() < 0.2 else []
            )
            for user, assistant in rng.sample(pairs, rng.randint(1, 4)):
                turns += [user, assistant]
            line = json.dumps({"messages": turns}) + "\n"
            out.write(line)
            written += len(line)
    return path


# ---------------------------------------------------------------- measuring a command


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; its wall time, output, and peak PSS of its process tree / RSS of its largest process."""
    started = time.time()
    proc = psutil.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_pss = peak_rss = 0
    out_lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        pss = rss = 0
        try:
            tree = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                info = p.memory_full_info()
                pss += info.pss
                rss = max(rss, info.rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.2)
    reader.join()
    output = "".join(out_lines)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
    return {
        "wall": time.time() - started,
        "output": output,
        "pss_gb": peak_pss / 2**30,
        "rss_gb": peak_rss / 2**30,
    }


def raw_tokenizer_seconds(corpus: Path) -> tuple[float, int]:
    """Seconds inside ``encode_batch`` over every text of ``corpus``, and the tokens it produced."""
    code = f"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({str(TOKENIZER)!r})
spent = tokens = 0
batch = []
def flush():
    global spent, tokens
    t = time.perf_counter()
    encoded = tok.encode_batch(batch, add_special_tokens=False)
    spent += time.perf_counter() - t
    tokens += sum(len(e.ids) for e in encoded)
    batch.clear()
for line in open({str(corpus)!r}):
    batch.append(json.loads(line)["text"])
    if len(batch) == 1000:
        flush()
if batch:
    flush()
print(json.dumps({{"seconds": spent, "tokens": tokens}}))
"""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(cores())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["seconds"], result["tokens"]


def seconds_in(output: str, word: str) -> float:
    match = re.search(rf"{word} in ([0-9.]+) s", output)
    if not match:
        raise SystemExit(f"no '{word} in X s' in:\n{output[-2000:]}")
    return float(match.group(1))


def trainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def data_args(corpus: Path, store: Path, workers: int) -> list[str]:
    return [
        "--set", f"paths.train_file={corpus}",
        "--set", f"data.cache_dir={store}",
        "--set", f"performance.data_workers={workers}",
    ]  # fmt: skip


def train_args(out: Path, steps: int) -> list[str]:
    return [
        "--set", f"paths.output_dir={out}",
        "--set", f"training.max_steps={steps}",
        "--set", "eval.at_end=false",
        "--set", "eval.interval=1000000",
    ]  # fmt: skip


# ---------------------------------------------------------------- the bench


def bench_corpus(name: str, corpus: Path, work: Path, workers: int, steps: int, raw: bool) -> dict:
    store = work / f"cache-{name}"
    shutil.rmtree(store, ignore_errors=True)
    row: dict = {"corpus": name, "mb": round(corpus.stat().st_size / MB, 1), "workers": workers}
    if raw:
        row["raw_s"], row["raw_tokens"] = raw_tokenizer_seconds(corpus)
    first = run_measured(trainer("preprocess", *data_args(corpus, store, workers)))
    row["prepare_s"] = seconds_in(first["output"], "built")
    row["prepare_pss_gb"], row["prepare_rss_gb"] = first["pss_gb"], first["rss_gb"]
    if raw:
        row["ratio"] = row["raw_s"] / row["prepare_s"]
    second = run_measured(trainer("preprocess", *data_args(corpus, store, workers)))
    row["second_s"] = seconds_in(second["output"], "reused")
    trained = run_measured(
        trainer("train", *data_args(corpus, store, workers), *train_args(work / f"run-{name}", steps))
    )
    row["train_pss_gb"], row["train_rss_gb"] = trained["pss_gb"], trained["rss_gb"]
    row["train_wall_s"] = trained["wall"]
    events = [
        json.loads(x) for x in (work / f"run-{name}" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    report = next(e for e in events if e["event"] == "data_report")
    row["format"], row["cache_hit"] = report["format"], report["cache_hit"]
    row["train_rows"], row["tokens"] = report["train_sequences"], report["train_tokens"]
    return row


def table(rows: list[dict], tiny: dict) -> str:
    head = (
        "| corpus | MB | raw tokenizers s | prepare s | ratio | prep peak PSS GB (largest RSS) | second launch s "
        "| train peak PSS GB | over tiny-corpus run GB |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        raw = f"{r['raw_s']:.1f}" if "raw_s" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(
            f"| {r['corpus']} ({r['format']}) | {r['mb']:.0f} | {raw} | {r['prepare_s']:.1f} | {ratio} "
            f"| {r['prepare_pss_gb']:.2f} ({r['prepare_rss_gb']:.2f}) | {r['second_s']:.2f} "
            f"| {r['train_pss_gb']:.2f} | {r['train_pss_gb'] - tiny['train_pss_gb']:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100,400", help="text corpus sizes in MB (comma-separated)")
    parser.add_argument("--chat-mb", type=int, default=200, help="chat corpus size in MB (0: none)")
    parser.add_argument(
        "--workers", type=int, default=cores(), help="performance.data_workers (default: cores)"
    )
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="corpora and caches (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_data: {cores()} cores, {args.workers} data workers, work folder {work}", flush=True)
    tiny = bench_corpus(
        "tiny", REPO / "data" / "tiny_corpus.jsonl", work, args.workers, args.train_steps, False
    )
    rows = []
    for size in [int(s) for s in args.sizes.split(",") if s]:
        corpus = make_text_corpus(work / f"text-{size}mb.jsonl", size)
        rows.append(bench_corpus(f"text {size} MB", corpus, work, args.workers, args.train_steps, True))
        print(json.dumps(rows[-1]), flush=True)
    if args.chat_mb:
        corpus = make_chat_corpus(work / f"chat-{args.chat_mb}mb.jsonl", args.chat_mb)
        rows.append(
            bench_corpus(f"chat {args.chat_mb} MB", corpus, work, args.workers, args.train_steps, False)
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\ntiny shipped corpus: train peak PSS {tiny['train_pss_gb']:.2f} GB, second launch {tiny['second_s']:.2f} s"
    )
    print(table(rows, tiny))
    if args.out:
        Path(args.out).write_text(json.dumps({"tiny": tiny, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
