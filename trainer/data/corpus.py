"""Turn a folder of documents (PDF, DOCX, Markdown, plain text) into JSONL ``text`` records for training.

Files under the priority folder come first and are repeated (or weighted) in the output. Records are
de-duplicated (whitespace and case folded), records shorter than the minimum are dropped, and the
summary says which files were read, which failed and why, and how many records and tokens came out.
PDF and DOCX need the ``corpus`` extra (pypdf, python-docx).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = {
    ".pdf": "pdf",
    ".docx": "docx",
    ".md": "markdown",
    ".markdown": "markdown",
    ".txt": "text",
    ".text": "text",
}
# The parser each kind needs: (module to import, package to install).
PARSERS = {"pdf": ("pypdf", "pypdf"), "docx": ("docx", "python-docx")}


class CorpusError(RuntimeError):
    """Bad input for the whole job (folder, options, a missing parser package), in one line."""


class ExtractError(RuntimeError):
    """One file could not be read; the message says why, for the summary."""


@dataclass
class Options:
    priority_dir: Path | None = None
    priority_repeat: int = 3
    priority_weight: float | None = None  # set: write priority records once with this weight instead
    min_chars: int = 50
    max_chars: int = 8000
    dedup: bool = True
    seed: int = 0
    tokenizer: str | None = None


@dataclass
class Summary:
    files_read: dict[str, int] = field(default_factory=dict)  # kind -> count
    failed: list[dict] = field(default_factory=list)  # {"file", "why"}
    skipped: list[dict] = field(default_factory=list)
    priority_files: int = 0
    records: int = 0  # lines written, priority repeats included
    unique_records: int = 0
    priority_records: int = 0  # unique records from the priority folder
    duplicates: int = 0
    too_short: int = 0
    chars: int = 0
    tokens: int = 0
    tokens_exact: bool = False
    tokenizer: str | None = None
    out: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def missing_parsers(kinds: set[str]) -> list[str]:
    """Packages the files found need and this environment lacks."""
    import importlib

    missing = []
    for kind in sorted(kinds & set(PARSERS)):
        module, package = PARSERS[kind]
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{package} (for {kind.upper()} files)")
    return missing


# ---------------------------------------------------------------- reading one file


def read_pdf(path: Path) -> str:
    import pypdf

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # malformed-but-readable files warn per object
    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ExtractError("encrypted PDF (needs a password)")
        pages = [page.extract_text() or "" for page in reader.pages]
    except ExtractError:
        raise
    except Exception as exc:  # noqa: BLE001 - pypdf raises many types for broken files; name it and move on
        raise ExtractError(f"not a readable PDF ({type(exc).__name__}: {str(exc)[:120]})") from exc
    text = "\n\n".join(pages)
    if not text.strip():
        raise ExtractError(f"no text layer in {len(pages)} page(s) (a scanned PDF? run OCR first)")
    text = re.sub(r"(\w)-\n(\w)", r"\1\2", text)  # words hyphenated across lines
    return re.sub(r"(?<=[^\n.!?:;])\n(?=[a-z])", " ", text)  # lines wrapped mid-sentence


def read_docx(path: Path) -> str:
    import docx
    from docx.table import Table

    try:
        document = docx.Document(str(path))
        blocks = []
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                for row in block.rows:
                    cells = [cell.text.strip() for cell in row.cells]
                    if any(cells):
                        blocks.append(" | ".join(cells))
            else:
                blocks.append(block.text)
    except Exception as exc:  # noqa: BLE001 - a corrupt zip or XML: name it and move on
        raise ExtractError(f"not a readable DOCX ({type(exc).__name__}: {str(exc)[:120]})") from exc
    return "\n\n".join(blocks)


def read_plain(path: Path) -> str:
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        raise ExtractError("binary content in a text file")
    for encoding in ("utf-8-sig", "cp1252"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    return data.decode("latin-1")


def read_markdown(path: Path) -> str:
    text = read_plain(path)
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)  # YAML front matter
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


READERS = {"pdf": read_pdf, "docx": read_docx, "markdown": read_markdown, "text": read_plain}


def clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch)[0] != "C")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"[ \t]{2,}", " ", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def split_long(paragraph: str, max_chars: int) -> list[str]:
    """A paragraph longer than max_chars, cut after a sentence end (else a space) near the limit."""
    pieces = []
    while len(paragraph) > max_chars:
        window = paragraph[:max_chars]
        cut = max(window.rfind(". "), window.rfind("! "), window.rfind("? "))
        cut = cut + 1 if cut > max_chars // 2 else window.rfind(" ")
        if cut <= 0:
            cut = max_chars
        pieces.append(paragraph[:cut].strip())
        paragraph = paragraph[cut:].strip()
    return pieces + ([paragraph] if paragraph else [])


def chunk(text: str, max_chars: int, min_chars: int) -> list[str]:
    """Paragraphs packed into records of at most max_chars; a short tail joins the record before it."""
    if max_chars <= 0:
        return [text] if text else []
    paragraphs = [p for block in text.split("\n\n") for p in split_long(block.strip(), max_chars) if p]
    records: list[str] = []
    current = ""
    for paragraph in paragraphs:
        if current and len(current) + 2 + len(paragraph) > max_chars:
            records.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        if records and len(current) < min_chars:
            records[-1] = f"{records[-1]}\n\n{current}"
        else:
            records.append(current)
    return records


def fingerprint(text: str) -> str:
    return hashlib.sha1(" ".join(text.casefold().split()).encode()).hexdigest()


# ---------------------------------------------------------------- the whole folder


def find_files(
    source: Path, priority: Path | None, out: Path | None
) -> tuple[list[Path], list[Path], list[dict]]:
    """Priority files, other files (both sorted), and what was skipped with why."""
    chosen: list[Path] = []
    first: list[Path] = []
    skipped = []
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source)
        if any(part.startswith(".") for part in relative.parts) or (out is not None and path == out):
            continue
        if path.name.startswith("~$"):
            skipped.append({"file": str(relative), "why": "office lock file"})
            continue
        if path.suffix.lower() not in KINDS:
            skipped.append({"file": str(relative), "why": f"unsupported type '{path.suffix or path.name}'"})
            continue
        in_priority = priority is not None and priority in path.parents
        (first if in_priority else chosen).append(path)
    return first, chosen, skipped


def token_counter(name: str | None):
    """Exact counts with the given tokenizer, else an estimate of one token per four characters."""
    if name is None:
        return (lambda text: round(len(text) / 4)), False
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise CorpusError(f"--tokenizer: cannot load '{name}' ({str(exc).splitlines()[0]})") from exc
    return (lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)), True


def build_corpus(source: Path, out: Path, options: Options) -> Summary:
    if not source.is_dir():
        raise CorpusError(f"DIR: folder not found: {source}")
    if options.priority_repeat < 1:
        raise CorpusError(f"--priority-repeat: expected >= 1, got {options.priority_repeat}")
    if options.min_chars < 0 or options.max_chars < 0:
        raise CorpusError("--min-chars and --max-chars: expected >= 0")
    if options.max_chars and options.max_chars < options.min_chars:
        raise CorpusError(f"--max-chars {options.max_chars} is below --min-chars {options.min_chars}")
    priority = options.priority_dir
    if priority is not None and not priority.is_absolute():
        priority = source / priority
    if priority is not None and not priority.is_dir():
        priority = None
    first, rest, skipped = find_files(source, priority, out.resolve())
    missing = missing_parsers({KINDS[p.suffix.lower()] for p in first + rest})
    if missing:
        raise CorpusError(
            f"prepare-corpus needs {', '.join(missing)}: pip install 'finetune-kit[corpus]' "
            "(or pip install pypdf python-docx)"
        )
    count_tokens, exact = token_counter(options.tokenizer)
    summary = Summary(
        skipped=skipped, priority_files=len(first), tokens_exact=exact, tokenizer=options.tokenizer
    )
    seen: set[str] = set()
    rows: list[dict] = []
    kinds: Counter = Counter()
    for path in first + rest:
        kind = KINDS[path.suffix.lower()]
        relative = str(path.relative_to(source))
        try:
            text = clean(READERS[kind](path))
        except ExtractError as exc:
            summary.failed.append({"file": relative, "why": str(exc)})
            continue
        except OSError as exc:
            summary.failed.append({"file": relative, "why": f"cannot read ({exc.strerror or exc})"})
            continue
        kinds[kind] += 1
        is_priority = path in first
        for text_chunk in chunk(text, options.max_chars, options.min_chars):
            if len(text_chunk) < options.min_chars:
                summary.too_short += 1
                continue
            key = fingerprint(text_chunk)
            if options.dedup and key in seen:
                summary.duplicates += 1
                continue
            seen.add(key)
            row = {"text": text_chunk, "source": relative}
            copies = 1
            if is_priority:
                summary.priority_records += 1
                if options.priority_weight is not None:
                    row["weight"] = options.priority_weight
                else:
                    copies = options.priority_repeat
            elif options.priority_weight is not None:
                row["weight"] = 1.0
            rows += [row] * copies
            summary.unique_records += 1
            summary.chars += len(text_chunk) * copies
            summary.tokens += count_tokens(text_chunk) * copies
    summary.files_read = dict(kinds)
    # Spread the repeated priority records (and each source's records) through the file.
    random.Random(options.seed).shuffle(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(out)
    summary.records = len(rows)
    summary.out = str(out)
    return summary


def format_summary(summary: Summary) -> str:
    names = {"pdf": "PDF", "docx": "DOCX", "markdown": "Markdown", "text": "text"}
    read = sum(summary.files_read.values())
    kinds = ", ".join(f"{n} {names[k]}" for k, n in sorted(summary.files_read.items()))
    lines = [
        f"files: {read} read ({kinds or 'none'}), {len(summary.failed)} failed, {len(summary.skipped)} skipped"
        + (f"; {summary.priority_files} in the priority folder" if summary.priority_files else "")
    ]
    lines += [f"  failed: {item['file']}: {item['why']}" for item in summary.failed]
    lines += [f"  skipped: {item['file']}: {item['why']}" for item in summary.skipped]
    lines.append(
        f"records: {summary.records} written ({summary.unique_records} unique, {summary.priority_records} "
        f"from priority files), {summary.duplicates} duplicates and {summary.too_short} too short dropped"
    )
    if summary.tokens_exact:
        lines.append(f"tokens: {summary.tokens:,} ({summary.tokenizer}), characters: {summary.chars:,}")
    else:
        lines.append(
            f"tokens: about {summary.tokens:,} (characters / 4; pass --tokenizer for an exact count), "
            f"characters: {summary.chars:,}"
        )
    lines.append(f"wrote {summary.out}")
    return "\n".join(lines)
