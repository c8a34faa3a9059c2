"""Token lengths of the training file, and what each way of fitting them into ``max_length`` costs.

``trainer.data.prepare.analyze(cfg, tokenizer)`` reads the token count of every record from the data cache (the counts
data preparation measured: BOS, text, EOS) and answers, for ``data.max_length``:

- the length distribution (min, median, p90, p95, p99, max; nearest-rank percentiles, so every
  number is a length some record really has);
- ``truncate``: tokens dropped if each record is cut to max_length;
- ``token``: fixed max_length windows (what ``data.long_documents: split`` does): chunks, nothing lost;
- ``paragraph`` / ``sentence``: the text cut at blank lines / sentence ends, consecutive pieces
  joined greedily up to max_length; a piece longer than max_length cannot be split this way
  (``unsplittable_*``) and its tokens past max_length are what truncating it would lose.

Pieces keep their trailing whitespace (joined, they give the text back). With a fast tokenizer
each token of the record counts in the piece where it starts, so pieces add up to the record
exactly; a slow one (no offsets) tokenizes each piece on its own, which can differ by a token or
two at the cuts.
The paragraph and sentence strategies need the text: they use an evenly spaced sample of at most a
few thousand records, which preparation kept (``sample_records`` says how many).
"""

from __future__ import annotations

import bisect
import math
import os
import re
import time
from pathlib import Path

from trainer import runfolder

REPORT_JSON = runfolder.DATA_REPORT_JSON
REPORT_MD = runfolder.DATA_REPORT_MD
STRATEGIES = ("truncate", "token", "paragraph", "sentence")
HISTOGRAM_BINS = 30
ENCODE_BATCH = 512

PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n[ \t]*\n\s*")
SPLITTERS = {"paragraph": PARAGRAPH_END, "sentence": SENTENCE_END}


def split_text(text: str, strategy: str) -> list[str]:
    """Cut after each paragraph break or sentence end; ``"".join(pieces) == text``."""
    pieces, start = [], 0
    for match in SPLITTERS[strategy].finditer(text):
        if match.end() > start:
            pieces.append(text[start : match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def percentile(sorted_values: list[int], p: float) -> int:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def distribution(lengths: list[int]) -> dict:
    values = sorted(lengths)
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "min": values[0],
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": values[-1],
        "mean": round(sum(values) / len(values), 2),
        "total_tokens": sum(values),
    }


def histogram(lengths: list[int], bins: int = HISTOGRAM_BINS) -> dict:
    """Equal-width integer bins ``[edges[i], edges[i+1])`` from 0 past the longest record."""
    if not lengths:
        return {"edges": [], "counts": []}
    width = max(1, math.ceil((max(lengths) + 1) / bins))
    count = math.ceil((max(lengths) + 1) / width)
    counts = [0] * count
    for length in lengths:
        counts[length // width] += 1
    return {"edges": [i * width for i in range(count + 1)], "counts": counts}


def pack_pieces(lengths: list[int], max_length: int) -> dict:
    """Greedily join consecutive pieces into chunks of at most max_length tokens."""
    chunks = room = unsplittable = unsplittable_tokens = lost = 0
    for length in lengths:
        if length > max_length:
            chunks += 1
            room = 0
            unsplittable += 1
            unsplittable_tokens += length
            lost += length - max_length
        elif length <= room:
            room -= length
        else:
            chunks += 1
            room = max_length - length
    return {
        "chunks": chunks,
        "unsplittable_segments": unsplittable,
        "unsplittable_tokens": unsplittable_tokens,
        "lost_tokens": lost,
    }


def _token_counts(tokenizer, texts: list[str]) -> list[int]:
    if not texts:
        return []
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode_texts(tokenizer, texts: list[str]) -> tuple[list[int], list[list[int]] | None]:
    """Token count of each text and, from a fast tokenizer, each token's start offset (else None).

    With offsets, splitting a text costs no second tokenization: a piece's tokens are those that
    start inside it. Batched, as one call per record is most of the cost on big files.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        encoded = backend.encode_batch(texts, add_special_tokens=False) if texts else []
        return [len(e.ids) for e in encoded], [[span[0] for span in e.offsets] for e in encoded]
    counts: list[int] = []
    starts: list[list[int]] | None = []
    for at in range(0, len(texts), ENCODE_BATCH):
        batch = texts[at : at + ENCODE_BATCH]
        if starts is not None:
            try:
                encoded = tokenizer(batch, add_special_tokens=False, return_offsets_mapping=True)
                starts += [[span[0] for span in spans] for spans in encoded["offset_mapping"]]
                counts += [len(ids) for ids in encoded["input_ids"]]
                continue
            except (TypeError, KeyError, ValueError, NotImplementedError):
                starts = None  # a slow tokenizer: count pieces by tokenizing them
        counts += _token_counts(tokenizer, batch)
    return counts, starts


def piece_counts(pieces: list[str], starts: list[int]) -> list[int]:
    """Tokens per piece of one text, each token counted in the piece where it starts."""
    counts, end, previous = [], 0, 0
    for piece in pieces[:-1]:
        end += len(piece)
        position = bisect.bisect_left(starts, end)
        counts.append(position - previous)
        previous = position
    counts.append(len(starts) - previous)
    return counts


def _per_record(chunks: list[int]) -> dict:
    counts: dict[str, int] = {}
    for n in chunks:
        counts[str(n)] = counts.get(str(n), 0) + 1
    return {
        "mean": round(sum(chunks) / len(chunks), 3) if chunks else 0,
        "max": max(chunks, default=0),
        "histogram": dict(sorted(counts.items(), key=lambda kv: int(kv[0]))),
    }


def _strategy(
    chunks: list[int], lost: list[int], unsplittable: int = 0, unsplittable_tokens: int = 0
) -> dict:
    return {
        "chunks": sum(chunks),
        "chunks_per_record": _per_record(chunks),
        "lost_tokens": sum(lost),
        "records_with_loss": sum(1 for n in lost if n > 0),
        "unsplittable_segments": unsplittable,
        "unsplittable_tokens": unsplittable_tokens,
    }


def report_from_lengths(stats, fmt: str, tokenizer, cfg_data, source: str, skipped: int) -> dict:
    """Length distribution and per-strategy costs (see the module doc), from the token counts that data
    preparation measured for every record; the paragraph and sentence strategies re-tokenize an evenly
    spaced sample of at most a few thousand texts (they need token offsets)."""
    started = time.time()
    d = cfg_data
    max_length = d.max_length
    all_lengths, all_lost = stats.all()
    lengths, target_lost = all_lengths.tolist(), all_lost.tolist()
    bos = 1 if tokenizer.bos_token_id is not None else 0
    eos = 1 if d.add_eos and tokenizer.eos_token_id is not None else 0
    texts = stats.samples

    truncate_lost = [max(0, n - max_length) for n in lengths]
    strategies = {
        "truncate": _strategy([1] * len(lengths), truncate_lost),
        "token": _strategy([max(1, math.ceil(n / max_length)) for n in lengths], [0] * len(lengths)),
    }
    strategies["truncate"]["lost_target_tokens"] = sum(target_lost)
    starts = encode_texts(tokenizer, texts)[1] if fmt == "text" else None
    for name in ("paragraph", "sentence"):
        if fmt != "text":
            strategies[name] = {
                "applicable": False,
                "reason": f"{fmt} records are not split at text boundaries (the prompt stays with its "
                "response); only truncation and token windows apply",
            }
            continue
        strategies[name] = _split_strategy(name, texts, starts, (bos, eos), tokenizer, max_length)
        strategies[name]["sample_records"] = len(texts)

    dist = distribution(lengths)
    over = sum(1 for n in lengths if n > max_length)
    return {
        "train_file": source,
        "format": fmt,
        "tokenizer": getattr(tokenizer, "name_or_path", None),
        "max_length": max_length,
        "records_total": len(lengths) + skipped,
        "records_analyzed": len(lengths),
        "sampled": False,
        "skipped_records": skipped,
        "lengths": dist,
        "histogram": histogram(lengths),
        "over_max_length": {
            "records": over,
            "fraction": round(over / len(lengths), 4) if lengths else 0.0,
        },
        "truncation_lost_fraction": round(sum(truncate_lost) / dist["total_tokens"], 4) if lengths else 0.0,
        "strategies": strategies,
        "elapsed_seconds": round(time.time() - started, 3),
    }


def _split_strategy(
    name: str, texts: list[str], starts, specials: tuple[int, int], tokenizer, max_length: int
) -> dict:
    pieces = [split_text(text, name) or [""] for text in texts]
    if starts is not None:
        per_text = [piece_counts(ps, st) for ps, st in zip(pieces, starts)]
    else:
        flat = iter(_token_counts(tokenizer, [p for ps in pieces for p in ps]))
        per_text = [[next(flat) for _ in ps] for ps in pieces]
    chunks, lost = [], []
    unsplittable = unsplittable_tokens = 0
    for counts in per_text:
        counts[0] += specials[0]
        counts[-1] += specials[1]
        packed = pack_pieces(counts, max_length)
        chunks.append(max(1, packed["chunks"]))
        lost.append(packed["lost_tokens"])
        unsplittable += packed["unsplittable_segments"]
        unsplittable_tokens += packed["unsplittable_tokens"]
    result = _strategy(chunks, lost, unsplittable, unsplittable_tokens)
    result["segments"] = sum(len(ps) for ps in pieces if ps != [""])
    return result


# ---------------------------------------------------------------- writing


def write_data_report(report: dict, output_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``<output_dir>/data_report.json`` and ``data_report.md`` (each replaced atomically)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / REPORT_JSON, out / REPORT_MD
    runfolder.write_json_atomic(json_path, {"ts": round(time.time(), 3), **report})
    tmp = md_path.with_name(f".{md_path.name}.tmp")
    tmp.write_text(format_markdown(report))
    os.replace(tmp, md_path)
    return json_path, md_path


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_markdown(report: dict) -> str:
    d, m = report["lengths"], report["max_length"]
    sample = (
        f"an evenly spaced sample of {report['records_analyzed']:,} of {report['records_total']:,} records"
        if report["sampled"]
        else f"all {report['records_analyzed']:,} records"
    )
    lines = [
        "# Data report",
        "",
        f"`{report['train_file']}` ({report['format']} format), tokenized with `{report['tokenizer']}`: {sample}"
        f" ({report['skipped_records']} skipped). `data.max_length` = {m}.",
        "",
        "## Token lengths per record",
        "",
        "| min | median | p90 | p95 | p99 | max | mean | total |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if d.get("count"):
        lines.append(
            f"| {d['min']:,} | {d['median']:,} | {d['p90']:,} | {d['p95']:,} | {d['p99']:,} | {d['max']:,} "
            f"| {d['mean']:,} | {d['total_tokens']:,} |"
        )
    over = report["over_max_length"]
    lines += [
        "",
        f"{over['records']:,} records ({100 * over['fraction']:.1f}%) are longer than {m} tokens.",
        "",
        "## Fitting records into max_length",
        "",
        "| strategy | chunks | chunks/record (mean, max) | unsplittable pieces (tokens) | tokens lost | records losing tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    total = d.get("total_tokens", 0)
    for name in STRATEGIES:
        s = report["strategies"][name]
        if s.get("applicable") is False:
            lines.append(f"| {name} | n/a | | | | |")
            continue
        per = s["chunks_per_record"]
        unsplit = (
            f"{s['unsplittable_segments']:,} ({s['unsplittable_tokens']:,})" if name in SPLITTERS else "-"
        )
        lines.append(
            f"| {name} | {s['chunks']:,} | {per['mean']:g}, {per['max']} | {unsplit} | "
            f"{s['lost_tokens']:,} ({_pct(s['lost_tokens'], total)}) | {s['records_with_loss']:,} |"
        )
    lines += [
        "",
        "- **truncate**: each record cut to max_length; the rest is lost"
        + (
            f" ({report['strategies']['truncate']['lost_target_tokens']:,} of the lost tokens are trained on)."
            if report["format"] == "instruction"
            else "."
        ),
        "- **token**: fixed windows of max_length tokens (`data.long_documents: split`); nothing lost.",
        "- **paragraph** / **sentence**: cut at blank lines / sentence ends, pieces joined up to max_length; "
        "a piece longer than max_length is unsplittable, and tokens past max_length in it are lost if truncated.",
        "",
    ]
    for name in ("paragraph", "sentence"):
        s = report["strategies"][name]
        if s.get("applicable") is False:
            lines += [f"{name}: {s['reason']}.", ""]
    return "\n".join(lines)


def summary_line(report: dict) -> str:
    """One line for the console at the start of a run."""
    d, m, s = report["lengths"], report["max_length"], report["strategies"]
    if not d.get("count"):
        return "lengths: no records analyzed"
    text = (
        f"lengths (tokens): median {d['median']:,}, p95 {d['p95']:,}, p99 {d['p99']:,}, max {d['max']:,}; "
        f"{report['over_max_length']['records']:,} of {d['count']:,} records exceed max_length {m}: "
        f"truncation would lose {s['truncate']['lost_tokens']:,} tokens "
        f"({100 * report['truncation_lost_fraction']:.1f}%), token windows give {s['token']['chunks']:,} chunks"
    )
    for name in ("paragraph", "sentence"):
        if s[name].get("applicable") is not False:
            text += (
                f", {name} split {s[name]['chunks']:,} ({s[name]['unsplittable_segments']:,} unsplittable)"
            )
    return text + (" [sampled]" if report["sampled"] else "")
