"""Training data: read JSONL/TSV, split deterministically, tokenize, pack or split long documents.

Nothing is silently truncated: documents longer than ``max_length`` are split into chunks (or,
if the user asks for truncation, the tokens it loses are counted and reported). Instruction
records (``prompt``/``response``) put only the response into the loss.
"""

from __future__ import annotations

import csv
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.config import DataConfig

IGNORE = -100


class DataError(ValueError):
    """Bad training data; the message starts with file:line."""


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

    def as_event(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def read_records(path: str | Path, on_bad_line: str, report: DataReport) -> list[dict]:
    """JSONL objects (or TSV rows with a header); a malformed line is skipped and counted, or fatal."""
    path = Path(path)
    records: list[dict] = []
    with open(path, encoding="utf-8", newline="") as handle:
        if path.suffix.lower() in (".tsv", ".tab"):
            rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(rows, None) or []
            for number, row in enumerate(rows, start=2):
                if len(row) != len(header):
                    _bad(
                        path,
                        number,
                        f"expected {len(header)} tab-separated fields, got {len(row)}",
                        on_bad_line,
                        report,
                    )
                    continue
                records.append(dict(zip(header, row)))
            return records
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                _bad(path, number, f"not valid JSON ({exc.msg})", on_bad_line, report)
                continue
            if not isinstance(record, dict):
                _bad(path, number, "expected a JSON object", on_bad_line, report)
                continue
            records.append(record)
    return records


def _bad(path: Path, number: int, why: str, on_bad_line: str, report: DataReport) -> None:
    message = f"{path}:{number}: {why}"
    if on_bad_line == "fail":
        raise DataError(message + " (set data.on_bad_line: skip to skip such lines)")
    report.skipped_lines += 1
    if len(report.skipped_examples) < 5:
        report.skipped_examples.append(message)


def detect_format(records: list[dict], cfg: DataConfig, source: str) -> str:
    if cfg.format != "auto":
        fmt = cfg.format
    elif records and cfg.prompt_field in records[0] and cfg.response_field in records[0]:
        fmt = "instruction"
    else:
        fmt = "text"
    needed = (cfg.text_field,) if fmt == "text" else (cfg.prompt_field, cfg.response_field)
    for key in needed:
        if records and key not in records[0]:
            raise DataError(
                f"{source}:1: field '{key}' missing (data.format is {fmt}; set data.{fmt}_field?)"
            )
    return fmt


def split_records(records: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic: the same seed and file always give the same validation records."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(records) * val_fraction))
    if val_fraction > 0 and len(records) > 1:
        n_val = max(1, n_val)
    val_ids = set(order[:n_val])
    return [r for i, r in enumerate(records) if i not in val_ids], [records[i] for i in sorted(val_ids)]


def tokenize_record(
    record: dict, tokenizer, cfg: DataConfig, fmt: str, where: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels; prompt tokens get IGNORE so only the response is learned."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if cfg.add_eos and tokenizer.eos_token_id is not None else []
    if fmt == "text":
        text = record.get(cfg.text_field)
        if not isinstance(text, str):
            raise DataError(f"{where}: field '{cfg.text_field}' must be a string")
        ids = bos + tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        return ids, list(ids)
    prompt, response = record.get(cfg.prompt_field), record.get(cfg.response_field)
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise DataError(f"{where}: fields '{cfg.prompt_field}' and '{cfg.response_field}' must be strings")
    prompt_ids = bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
    return prompt_ids + response_ids, [IGNORE] * len(prompt_ids) + response_ids


@dataclass
class Sequence:
    """One training row: ids, labels, and position ids restarting at every document boundary."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]


def chunk_document(ids: list[int], labels: list[int], max_length: int) -> list[tuple[list[int], list[int]]]:
    return [(ids[i : i + max_length], labels[i : i + max_length]) for i in range(0, len(ids), max_length)]


def build_sequences(
    tokenized: list[tuple[list[int], list[int]]],
    cfg: DataConfig,
    pad_id: int,
    report: DataReport,
    packing: bool,
) -> list[Sequence]:
    """Split (or truncate, counting the loss) long documents, then pack them into full rows or keep one per row."""
    pieces: list[tuple[list[int], list[int]]] = []
    for ids, labels in tokenized:
        chunks = chunk_document(ids, labels, cfg.max_length)
        lost = sum(len(c[0]) for c in chunks[1:])
        report.truncation_would_lose_tokens += lost
        if cfg.long_documents == "truncate":
            report.truncated_tokens += lost
            chunks = chunks[:1]
        pieces.extend(chunks)
    if not packing:
        return [Sequence(ids, labels, list(range(len(ids)))) for ids, labels in pieces]
    return pack(pieces, cfg.max_length, pad_id)


def pack(pieces: list[tuple[list[int], list[int]]], max_length: int, pad_id: int) -> list[Sequence]:
    """Concatenate documents into rows of exactly max_length, cutting at row ends.

    Position ids restart at each document, so transformers' causal models attend within a document
    only; the first label of each segment is ignored so no token is predicted across a boundary.
    The last row is filled with padding that is masked out of the loss, its positions counting on from the
    row's last segment (layout 2 of the data cache: padding is no document of its own).
    """
    rows: list[Sequence] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for piece_ids, piece_labels in pieces:
        start = 0
        while start < len(piece_ids):
            room = max_length - len(ids)
            take_ids = piece_ids[start : start + room]
            take_labels = [IGNORE] + piece_labels[start + 1 : start + room]
            ids += take_ids
            labels += take_labels
            positions += list(range(len(take_ids)))
            start += len(take_ids)
            if len(ids) == max_length:
                rows.append(Sequence(ids, labels, positions))
                ids, labels, positions = [], [], []
    if ids:
        fill = max_length - len(ids)
        after = positions[-1] + 1
        rows.append(
            Sequence(
                ids + [pad_id] * fill, labels + [IGNORE] * fill, positions + list(range(after, after + fill))
            )
        )
    return rows


def collate(rows: list[Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; an attention mask only when there is padding to hide."""
    width = max(len(r.input_ids) for r in rows)
    needs_mask = any(len(r.input_ids) < width for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
        "token_mask": torch.zeros((len(rows), width), dtype=torch.bool),
    }
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        batch["input_ids"][i, :n] = torch.tensor(row.input_ids)
        batch["labels"][i, :n] = torch.tensor(row.labels)
        batch["position_ids"][i, :n] = torch.tensor(row.position_ids)
        batch["token_mask"][i, :n] = True
    if needs_mask:
        batch["attention_mask"] = batch["token_mask"].long()
    return batch


@dataclass
class PreparedData:
    train: list[Sequence]
    val: list[Sequence]
    report: DataReport


def prepare_data(paths, cfg: DataConfig, tokenizer, family_packing: bool, workers: int = 0) -> PreparedData:
    """Everything from file to rows; deterministic for a given seed, so resume sees the same data.

    The rows stay in memory and the loop collates them directly, so ``workers`` (the config's
    ``performance.dataloader_num_workers``) parallelises the one costly part: tokenizing at start-up."""
    report = DataReport()
    records = read_records(paths.train_file, cfg.on_bad_line, report)
    if not records:
        raise DataError(f"{paths.train_file}: no usable records")
    fmt = detect_format(records, cfg, str(paths.train_file))
    if paths.val_file:
        train_records = records
        val_records = read_records(paths.val_file, cfg.on_bad_line, report)
    else:
        train_records, val_records = split_records(records, cfg.val_fraction, cfg.seed)
    packing = cfg.packing and family_packing
    report.format, report.packing = fmt, packing
    report.train_records, report.val_records = len(train_records), len(val_records)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def tokenize_one(item: tuple[int, dict], source: str):
        i, record = item
        try:
            return tokenize_record(record, tokenizer, cfg, fmt, f"{source}:record {i + 1}")
        except DataError:
            if cfg.on_bad_line == "fail":
                raise
            return None

    def tokenize_all(items: list[dict], source: str) -> list[tuple[list[int], list[int]]]:
        """In order; with ``workers`` > 1 in threads (fast tokenizers release the GIL)."""
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                results = list(
                    pool.map(lambda item: tokenize_one(item, source), enumerate(items), chunksize=256)
                )
        else:
            results = [tokenize_one(item, source) for item in enumerate(items)]
        report.skipped_lines += sum(1 for r in results if r is None)
        return [r for r in results if r is not None]

    train = build_sequences(tokenize_all(train_records, str(paths.train_file)), cfg, pad_id, report, packing)
    val_report = DataReport()
    val = build_sequences(tokenize_all(val_records, "validation"), cfg, pad_id, val_report, packing)
    report.train_sequences, report.val_sequences = len(train), len(val)
    if not train:
        raise DataError(f"{paths.train_file}: no training sequences after tokenization")
    return PreparedData(train=train, val=val, report=report)


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The row order for one epoch; a pure function of (seed, epoch) so a resume can replay it."""
    generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()
