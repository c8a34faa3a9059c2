"""Data preparation, once per (data, tokenizer, settings): encode every record in worker processes, split,
pack into rows on disk, and report; every later process, resume and sweep point opens the same cache.

The split is the one the list-based loader made: records (lines that parse) shuffled by
``random.Random(data.seed)``, the first ``val_fraction`` of them for validation, both halves in file order.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.data import cache, sources
from trainer.data.packing import Packer
from trainer.data.records import DataError, Encoder, detect_format
from trainer.data.rows import RowStore, RowWriter, id_dtype, pos_dtype

BATCH_ROWS = 4096


@dataclass
class DataReport:
    train_records: int = 0
    val_records: int = 0
    train_sequences: int = 0
    val_sequences: int = 0
    skipped_lines: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    truncation_would_lose_tokens: int = 0
    truncated_tokens: int = 0
    format: str = "text"
    packing: bool = True
    train_tokens: int = 0
    cache: str = ""
    fingerprint: str = ""
    cache_hit: bool = False
    prepare_seconds: float = 0.0

    def as_event(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PreparedData:
    train: RowStore
    val: RowStore
    report: DataReport
    length_report: dict = field(default_factory=dict)
    folder: Path | None = None


def default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


def workers_of(performance) -> int:
    """``performance.data_workers`` (or its older name); 0 means one per core (``default_workers``)."""
    return performance.data_workers or performance.dataloader_num_workers


def data_sources(paths, cfg) -> tuple[sources.Source, sources.Source | None]:
    if cfg.dataset:
        train = sources.from_dataset(cfg, cfg.dataset_split)
        val = sources.from_dataset(cfg, cfg.val_split) if cfg.val_split else None
    else:
        train = sources.from_path(paths.train_file, "paths.train_file")
        val = sources.from_path(paths.val_file, "paths.val_file") if paths.val_file else None
    if val is None and paths.val_file and cfg.dataset:
        val = sources.from_path(paths.val_file, "paths.val_file")
    return train, val


def source_identity(source: sources.Source, root: Path) -> dict:
    """What a source's rows depend on: file contents (hashed), or the dataset's id, split, revision and
    ``datasets``' own fingerprint of what it loaded."""
    if source.files:
        return {"files": [[f.name, f.stat().st_size, cache.file_digest(f, root)] for f in source.files]}
    loaded = sources.load_structured(source)
    return {"dataset": list(source.dataset), "datasets_fingerprint": loaded._fingerprint}


SETTINGS = (
    "format", "text_field", "prompt_field", "response_field", "messages_field", "system_prompt",
    "chat_template", "max_length", "long_documents", "val_fraction", "seed", "add_eos",
)  # fmt: skip


def settings_of(cfg, packing: bool) -> dict:
    settings = {key: getattr(cfg, key) for key in SETTINGS}
    if cfg.chat_template and Path(cfg.chat_template).expanduser().is_file():
        settings["chat_template"] = Path(cfg.chat_template).expanduser().read_text()
    settings["packing"] = packing
    return settings


def prepare_data(paths, cfg, tokenizer, family_packing: bool, workers: int = 0, log=print) -> PreparedData:
    """The run's rows from the cache, building it first when this data, tokenizer and settings are new."""
    from filelock import FileLock

    started = time.time()
    root = cache.cache_root(cfg.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    train_source, val_source = data_sources(paths, cfg)
    packing = cfg.packing and family_packing
    identity = {
        "layout": cache.LAYOUT_VERSION,
        "train": source_identity(train_source, root),
        "val": source_identity(val_source, root) if val_source else None,
        "tokenizer": cache.tokenizer_digest(tokenizer),
        "settings": settings_of(cfg, packing),
    }
    key = cache.digest(identity)
    folder = root / key
    hit = cache.is_complete(folder)
    if not hit:
        with FileLock(str(root / f"{key}.lock")):
            hit = cache.is_complete(folder)  # another process built it while this one waited
            if not hit:
                cache.remove_stale_temporaries(root, key)
                build(folder, key, identity, train_source, val_source, cfg, tokenizer, packing, workers, log)
    cache.touch(folder)
    prepared = open_cache(folder)
    report = prepared.report
    if report.skipped_examples and cfg.on_bad_line == "fail":
        raise DataError(report.skipped_examples[0] + " (set data.on_bad_line: skip to skip such lines)")
    report.cache_hit, report.prepare_seconds = hit, round(time.time() - started, 3)
    return prepared


def analyze(cfg, tokenizer) -> dict:
    """The length report of ``cfg``'s training data (trainer/data/length_report.py), from its data cache
    (built first if needed)."""
    from trainer.families import family_for
    from trainer.families.extras import model_type

    packing = family_for(model_type(cfg) or "", cfg.model.family).packing
    return prepare_data(cfg.paths, cfg.data, tokenizer, packing, workers_of(cfg.performance)).length_report


def open_cache(folder: Path) -> PreparedData:
    meta = json.loads((folder / cache.META).read_text())
    report = DataReport(**{k: v for k, v in meta["report"].items() if k in DataReport.__dataclass_fields__})
    report.cache, report.fingerprint = str(folder), folder.name
    return PreparedData(
        train=RowStore(folder, "train", meta["dtypes"]),
        val=RowStore(folder, "val", meta["dtypes"]),
        report=report,
        length_report=meta.get("length_report") or {},
        folder=folder,
    )


def build(folder, key, identity, train_source, val_source, cfg, tokenizer, packing, workers, log) -> None:
    """Encode, split, pack and report into a temporary folder, then rename it into place."""
    import datasets

    started = time.time()
    workers = workers or default_workers()
    tmp = cache.temporary_folder(folder.parent, key)
    tmp.mkdir(parents=True)
    progress = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        log(f"data: preparing {train_source.label} with {workers} worker(s) into {folder}", flush=True)
        fmt = detect_format(sources.first_record(train_source, cfg.on_bad_line), cfg, train_source.label)
        report = DataReport(format=fmt, packing=packing)
        dtypes = {
            "ids": id_dtype(len(tokenizer)),
            "target": np.dtype(np.uint8),
            "pos": pos_dtype(cfg.max_length),
        }
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        truncate = cfg.long_documents == "truncate"
        packers = {
            split: Packer(RowWriter(tmp, split, dtypes), cfg.max_length, packing, truncate, pad_id)
            for split in ("train", "val")
        }
        encoder = Encoder(tokenizer, cfg, fmt)
        skipped = Skipped(report, cfg.on_bad_line)
        lengths = LengthStats(cfg.max_length)

        encoded = sources.encode_source(train_source, encoder, workers, tmp / "work-train", cfg.text_field)
        status = encoded.data.table.column("status").to_numpy().astype(np.int8)
        records = np.flatnonzero(status != sources.STATUS_BAD_LINE)
        if not len(records):
            raise DataError(f"{train_source.label}: no usable records")
        in_val = np.zeros(len(status), bool)
        if val_source is None:
            in_val[records[val_ordinals(len(records), cfg.val_fraction, cfg.seed)]] = True
        feed(encoded, status, in_val, packers, skipped, lengths, chat=fmt == "chat")
        report.train_records, report.val_records = int(len(records) - in_val.sum()), int(in_val.sum())
        if val_source is not None:
            encoded = sources.encode_source(val_source, encoder, workers, tmp / "work-val", cfg.text_field)
            status = encoded.data.table.column("status").to_numpy().astype(np.int8)
            report.val_records = int((status != sources.STATUS_BAD_LINE).sum())
            feed(encoded, status, np.ones(len(status), bool), packers, skipped, None, chat=fmt == "chat")
        del encoded

        train = packers["train"]
        report.truncation_would_lose_tokens, report.truncated_tokens = (
            train.counts.would_lose,
            train.counts.truncated,
        )
        report.train_tokens = int(train.stream)
        report.train_sequences, report.val_sequences = train.close(), packers["val"].close()
        if not report.train_sequences:
            raise DataError(f"{train_source.label}: no training sequences after tokenization")
        for work in tmp.glob("work-*"):
            shutil.rmtree(work, ignore_errors=True)
        from trainer.data.length_report import report_from_lengths

        meta = {
            "kind": cache.KIND,
            "created": round(time.time(), 3),
            "build_seconds": round(time.time() - started, 3),
            "workers": workers,
            "sources": {"train": train_source.label, "val": val_source.label if val_source else None},
            "tokenizer": getattr(tokenizer, "name_or_path", None),
            "identity": identity,
            "settings": identity["settings"],
            "dtypes": {k: v.str for k, v in dtypes.items()},
            "report": report.as_event(),
            "length_report": report_from_lengths(
                lengths, fmt, tokenizer, cfg, train_source.label, skipped.count
            ),
        }
        (tmp / cache.META).write_text(json.dumps(meta, indent=1))
        os.rename(tmp, folder)
        log(
            f"data: {report.train_sequences:,} train / {report.val_sequences:,} val rows "
            f"({report.train_tokens:,} tokens) prepared in {time.time() - started:.1f} s",
            flush=True,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            datasets.enable_progress_bars()


def val_ordinals(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which records (by ordinal) validate: deterministic for a seed and a record count."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0 and n > 1:
        n_val = max(1, n_val)
    return np.sort(np.asarray(order[:n_val], dtype=np.int64))


class Skipped:
    """Bad lines and records: counted, the first few kept as examples; fatal with on_bad_line fail."""

    def __init__(self, report: DataReport, on_bad_line: str):
        self.report, self.on_bad_line, self.count = report, on_bad_line, 0

    def add(self, whys: list[str]) -> None:
        if whys and self.on_bad_line == "fail":
            raise DataError(whys[0] + " (set data.on_bad_line: skip to skip such lines)")
        self.count += len(whys)
        self.report.skipped_lines += len(whys)
        room = 5 - len(self.report.skipped_examples)
        self.report.skipped_examples.extend(whys[: max(0, room)])


class LengthStats:
    """Per-record token counts (numpy), targets past max_length, and sample texts for the length report."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.lengths: list[np.ndarray] = []
        self.target_lost: list[np.ndarray] = []
        self.samples: list[str] = []

    def add(self, lengths: np.ndarray, target: np.ndarray, samples: list[str]) -> None:
        self.lengths.append(lengths)
        starts = np.cumsum(lengths) - lengths
        within = np.arange(len(target)) - np.repeat(starts, lengths)
        past = np.where(within >= self.max_length, target, 0).astype(np.int64)
        bounds = np.append(starts, len(target))
        sums = np.add.reduceat(np.append(past, 0), bounds[:-1]) if len(lengths) else np.zeros(0, np.int64)
        sums = np.where(lengths > 0, sums, 0)
        self.target_lost.append(sums)
        self.samples.extend(samples)

    def all(self) -> tuple[np.ndarray, np.ndarray]:
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        return cat(self.lengths), cat(self.target_lost)


def documents(batch, mask: np.ndarray, chat: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chosen rows of an encoded batch as flat ids, flat targets (uint8) and document lengths."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chosen = pa.array(mask)
    ids = pc.filter(batch.column("ids"), chosen)
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    flat_ids = ids.flatten().to_numpy(zero_copy_only=False)
    masked = pc.filter(batch.column("masked"), chosen).to_numpy(zero_copy_only=False).astype(np.int64)
    within = np.arange(len(flat_ids), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    target = within >= np.repeat(masked, lengths)
    if chat:
        marks = pc.filter(batch.column("target"), chosen).flatten().to_numpy(zero_copy_only=False)
        target &= np.asarray(marks, dtype=bool)
    return flat_ids, target.astype(np.uint8), lengths


def stream_batches(encoded):
    """The encoded dataset's record batches, read from its Arrow files one at a time rather than through the
    memory map, so the pages read are freed as the pass goes on: memory stays flat whatever the corpus size."""
    import pyarrow as pa

    files = [f["filename"] for f in encoded.cache_files]
    if not files:  # in memory (nothing to stream from)
        yield from encoded.data.table.to_batches(max_chunksize=BATCH_ROWS)
        return
    for name in files:
        with pa.OSFile(name) as source:
            yield from pa.ipc.open_stream(source)


def feed(
    encoded, status, in_val, packers: dict, skipped: Skipped, lengths: LengthStats | None, chat: bool
) -> None:
    """Stream the encoded rows, in order, into the packers of their split."""
    import pyarrow as pa
    import pyarrow.compute as pc

    at = 0
    for batch in stream_batches(encoded):
        n = batch.num_rows
        st = status[at : at + n]
        val = in_val[at : at + n]
        at += n
        bad = np.flatnonzero(st != sources.STATUS_OK)
        if len(bad):
            whys = batch.column("why").to_pylist()
            skipped.add([whys[i] for i in bad])
        ok = st == sources.STATUS_OK
        for split, chosen in (("train", ok & ~val), ("val", ok & val)):
            if chosen.any():
                packers[split].add(*documents(batch, chosen, chat))
        if lengths is not None and ok.any():
            _, target, doc_lengths = documents(batch, ok, chat)
            samples = pc.filter(batch.column("sample"), pa.array(ok)).to_pylist()
            lengths.add(doc_lengths, target, [s for s in samples if s is not None])
