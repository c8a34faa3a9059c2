"""Where records come from: local files (JSONL, TSV, JSON, CSV, Parquet, Arrow), folders of them, or a
Hugging Face dataset, each read into one ``datasets.Dataset`` of encoded records.

JSONL and TSV are read line by line by our own reader, in byte ranges spread over ``datasets``' worker
processes, so a malformed line is counted and reported with its file and line (or is fatal with
``data.on_bad_line: fail``) instead of failing the whole file. The other formats go through ``datasets``'
own builders. Every source becomes rows of ``line, status, why, ids, target, sample`` (``STATUS_*``).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from trainer.data.records import DataError, Encoder

LINE_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".tsv": "tsv", ".tab": "tsv"}
BUILDERS = {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
RANGE_BYTES = 4 << 20  # one worker task: big enough to amortise, small enough to spread and stop quickly

SAMPLE_RECORDS = 1000  # texts kept for the length report's paragraph and sentence strategies
STATUS_OK, STATUS_BAD_LINE, STATUS_BAD_RECORD = 0, 1, 2  # a bad line is not a record; a bad record is


@dataclass
class Source:
    """One training or validation source: files (read in this order) or a named dataset."""

    label: str  # what messages name: the path or dataset id
    files: list[Path] = field(default_factory=list)
    dataset: tuple | None = None  # (name, config, split, revision)

    @property
    def line_based(self) -> bool:
        return bool(self.files) and all(kind_of(f) in ("jsonl", "tsv") for f in self.files)


def kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".json" and _looks_like_jsonl(path):
        return "jsonl"
    return LINE_KINDS.get(suffix) or BUILDERS.get(suffix) or "unknown"


def _looks_like_jsonl(path: Path) -> bool:
    """A ``.json`` file holding one object per line (not one array) is JSONL."""
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip()
    return not head.startswith(b"[")


def from_path(path: str, key: str) -> Source:
    """A file or a folder of files of one supported kind; ``key`` names the config key in errors."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(
            f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in {**LINE_KINDS, **BUILDERS}
        )
        if not files:
            raise DataError(
                f"{key}: no data files in folder {path} (expected {', '.join(sorted({**LINE_KINDS, **BUILDERS}))})"
            )
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"{key}: file not found: {path}")
    kinds = {kind_of(f) for f in files}
    if "unknown" in kinds:
        bad = next(f for f in files if kind_of(f) == "unknown")
        raise DataError(
            f"{bad}: unknown data file type (expected .jsonl, .json, .tsv, .csv, .parquet or .arrow)"
        )
    structured = kinds - {"jsonl", "tsv"}
    if structured and len(kinds) > 1:
        raise DataError(f"{path}: mixes file types {sorted(kinds)}; keep one type per folder")
    return Source(str(path), files=files)


def from_dataset(cfg, split: str) -> Source:
    return Source(
        f"{cfg.dataset}[{split}]", dataset=(cfg.dataset, cfg.dataset_config, split, cfg.dataset_revision)
    )


# ---------------------------------------------------------------- the first record (format detection)


def first_record(source: Source, on_bad_line: str) -> dict | None:
    """The first record that parses, read without loading the rest (a bad line before it still counts later)."""
    if source.line_based:
        for r in (r for path in source.files for r in file_ranges(path)):
            for _, record, why in _line_records(
                Path(r["file"]), r["start"], r["end"], r["line"], r["header"]
            ):
                if record is not None:
                    return record
                if on_bad_line == "fail":
                    raise DataError(why + " (set data.on_bad_line: skip to skip such lines)")
        return None
    dataset = load_structured(source, streaming=True)
    return next(iter(dataset), None)


# ---------------------------------------------------------------- line files, in byte ranges


def _tsv_header(path: Path) -> list[str] | None:
    if kind_of(path) != "tsv":
        return None
    with open(path, encoding="utf-8", newline="") as handle:
        return next(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE), None) or []


def file_ranges(path: Path):
    """``path`` cut into ranges of about RANGE_BYTES at line ends, each with the number of its first line;
    lazily, a block at a time, so finding the first record reads one block, not the file."""
    header = _tsv_header(path)
    size, line, start = path.stat().st_size, 1, 0
    with open(path, "rb") as handle:
        while start < size:
            handle.seek(start)
            block = handle.read(RANGE_BYTES)
            end = start + len(block)
            if end < size:
                rest = handle.readline()  # finish the line the block cut
                end += len(rest)
                block += rest
            lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
            yield {
                "file": str(path),
                "start": start,
                "end": end,
                "line": line,
                "lines": lines,
                "header": header,
            }
            line += lines
            start = end


def line_ranges(files: list[Path]) -> list[dict]:
    """Every file's ranges, in order: one ``datasets.map`` task each."""
    return [r for path in files for r in file_ranges(path)]


def _line_records(path: Path, start: int, end: int, first_line: int, header: list[str] | None):
    """(line number, record or None, why) for each non-blank line (TSV: each row after the header)."""
    with open(path, "rb") as handle:
        handle.seek(start)
        data = handle.read(end - start)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for offset, raw in enumerate(lines):
        number = first_line + offset
        where = f"{path}:{number}"
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield number, None, f"{where}: not valid UTF-8"
            continue
        if header is not None:
            if number == 1:
                continue
            row = line.split("\t") if line else []
            if len(row) != len(header):
                yield number, None, f"{where}: expected {len(header)} tab-separated fields, got {len(row)}"
                continue
            yield number, dict(zip(header, row)), None
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            yield number, None, f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})"
            continue
        if not isinstance(record, dict):
            yield number, None, f"{where}: expected a JSON object"
            continue
        yield number, record, None


def _list_array(lists: list, dtype):
    """A pyarrow list array built through numpy: no per-element Python work in Arrow's converter."""
    import itertools

    import numpy as np
    import pyarrow as pa

    offsets = np.zeros(len(lists) + 1, np.int32)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _rows(numbers, wheres, records, whys, encoder: Encoder, sample_every: int, text_field: str):
    """The output columns (a pyarrow table) for a batch of (line, file:line, record or None, why)."""
    import numpy as np
    import pyarrow as pa

    good = [i for i, r in enumerate(records) if r is not None]
    encoded = dict(zip(good, encoder.encode([records[i] for i in good])))
    status, why, ids, masked, target, sample = [], [], [], [], [], []
    for i, number in enumerate(numbers):
        enc = encoded.get(i)
        if enc is None:
            status.append(STATUS_BAD_LINE)
            why.append(whys[i])
        elif enc.ids is None:
            status.append(STATUS_BAD_RECORD)
            why.append(f"{wheres[i]}: {enc.why}")
        else:
            status.append(STATUS_OK)
            why.append(None)
        ok = enc is not None and enc.ids is not None
        ids.append(enc.ids if ok else ())
        masked.append(enc.masked if ok else 0)
        target.append(enc.target if ok and enc.target is not None else ())
        value = records[i].get(text_field) if enc is not None and number % sample_every == 0 else None
        sample.append(value if isinstance(value, str) else None)
    return pa.table(
        {
            "line": pa.array(numbers, pa.int64()),
            "status": pa.array(status, pa.int8()),
            "why": pa.array(why, pa.string()),
            "ids": _list_array(ids, np.int32),
            "masked": pa.array(masked, pa.int32()),
            "target": _list_array(target, np.bool_),
            "sample": pa.array(sample, pa.string()),
        }
    )


class LineTask:
    """``datasets.map`` function over byte ranges: read, parse, encode; one range in, its lines out."""

    def __init__(self, encoder: Encoder, sample_every: int, text_field: str):
        self.encoder, self.sample_every, self.text_field = encoder, sample_every, text_field

    def __call__(self, batch: dict) -> dict:
        numbers, wheres, records, whys = [], [], [], []
        for path, start, end, line, header in zip(
            batch["file"], batch["start"], batch["end"], batch["line"], batch["header"]
        ):
            for number, record, why in _line_records(Path(path), start, end, line, header):
                numbers.append(number)
                wheres.append(f"{path}:{number}")
                records.append(record)
                whys.append(why)
        return _rows(numbers, wheres, records, whys, self.encoder, self.sample_every, self.text_field)


class RecordTask:
    """``datasets.map`` function over a dataset's rows (CSV, Parquet, Arrow, JSON, the Hub)."""

    def __init__(self, encoder: Encoder, sample_every: int, text_field: str, label: str, first_line: int):
        self.encoder, self.sample_every, self.text_field = encoder, sample_every, text_field
        self.label, self.first_line = label, first_line

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        keys = list(batch)
        records = (
            [dict(zip(keys, values)) for values in zip(*batch.values())] if keys else [{} for _ in indices]
        )
        numbers = [i + self.first_line for i in indices]
        wheres = [f"{self.label}:{number}" for number in numbers]
        return _rows(
            numbers, wheres, records, [None] * len(records), self.encoder, self.sample_every, self.text_field
        )


def load_structured(source: Source, streaming: bool = False, cache_dir: str | None = None):
    """The source's records as a ``datasets`` dataset (files through the builder their type names)."""
    import datasets

    try:
        if source.dataset is not None:
            name, config, split, revision = source.dataset
            return datasets.load_dataset(
                name, config, split=split, revision=revision, streaming=streaming, cache_dir=cache_dir
            )
        builder = BUILDERS[source.files[0].suffix.lower()]
        return datasets.load_dataset(
            builder,
            data_files=[str(f) for f in source.files],
            split="train",
            streaming=streaming,
            cache_dir=cache_dir,
        )
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{source.label}: cannot read ({first})") from exc
    except Exception as exc:  # datasets wraps parser errors (pyarrow, pandas) in its own types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{source.label}: cannot read ({type(exc).__name__}: {first})") from exc


def features():
    import datasets

    return datasets.Features(
        {
            "line": datasets.Value("int64"),
            "status": datasets.Value("int8"),
            "why": datasets.Value("string"),
            "ids": datasets.List(datasets.Value("int32")),
            "masked": datasets.Value("int32"),
            "target": datasets.List(datasets.Value("bool")),
            "sample": datasets.Value("string"),
        }
    )


def encode_source(source: Source, encoder: Encoder, workers: int, work_dir: Path, text_field: str):
    """Every line or row of ``source`` encoded, in order, as a memory-mapped ``datasets.Dataset``."""
    import datasets

    work_dir.mkdir(parents=True, exist_ok=True)
    if source.line_based:
        ranges = line_ranges(source.files)
        sample_every = max(1, sum(r["lines"] for r in ranges) // SAMPLE_RECORDS)
        tasks = datasets.Dataset.from_list(ranges) if ranges else None
        if tasks is None:
            return datasets.Dataset.from_dict({k: [] for k in features()}, features=features())
        task = LineTask(encoder, sample_every, text_field)
        return _encode_map(tasks, task, 1, min(workers, len(ranges)), work_dir, with_indices=False)
    # Local files convert into a scratch folder removed after the build; a Hub dataset stays in datasets' own
    # cache, where it was downloaded (and where offline use finds it).
    records = load_structured(source, cache_dir=str(work_dir / "hf") if source.files else None)
    first_line = 2 if source.files and source.files[0].suffix.lower() == ".csv" else 1
    sample_every = max(1, len(records) // SAMPLE_RECORDS)
    task = RecordTask(encoder, sample_every, text_field, source.label, first_line)
    return _encode_map(
        records, task, 1000, min(workers, len(records) // 1000 + 1), work_dir, with_indices=True
    )


def _encode_map(dataset, task, batch_size: int, processes: int, work_dir: Path, with_indices: bool):
    """``task`` over ``dataset`` in ``processes`` workers (in this process for one), written to ``work_dir``; our
    fingerprint, not datasets', decides reuse, so its own cache is never consulted."""
    return dataset.map(
        task,
        batched=True,
        batch_size=batch_size,
        with_indices=with_indices,
        num_proc=processes if processes > 1 else None,
        remove_columns=dataset.column_names,
        features=features(),
        cache_file_name=str(work_dir / "encoded.arrow"),
        load_from_cache_file=False,
        new_fingerprint=f"encoded-{os.getpid()}",
        desc="tokenizing",
    )
