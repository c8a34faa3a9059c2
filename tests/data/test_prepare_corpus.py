"""``prepare-corpus``: small PDF, DOCX, Markdown and text files made here, turned into JSONL records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import REPO
from trainer.cli import main as cli

LOREM = (
    "Gradient accumulation sums the gradients of several micro-batches before one optimizer step, "
    "so a small GPU can train with the batch size of a large one."
)


def make_pdf(pages: list[list[str]]) -> bytes:
    """A minimal PDF with a text layer (Helvetica, one text line per entry), built by hand."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    pages_id = len(objects) + 1 + 2 * len(pages)
    kids = []
    for lines in pages:
        ops = ["BT /F1 11 Tf 72 720 Td 14 TL"]
        for line in lines:
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({escaped}) Tj T*")
        ops.append("ET")
        stream = "\n".join(ops).encode("latin-1")
        content = add(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        kids.append(
            add(
                b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] "
                b"/Resources << /Font << /F1 %d 0 R >> >> /Contents %d 0 R >>" % (pages_id, font, content)
            )
        )
    kid_refs = b" ".join(b"%d 0 R" % kid for kid in kids)
    add(b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kid_refs, len(kids)))
    catalog = add(b"<< /Type /Catalog /Pages %d 0 R >>" % pages_id)
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        catalog,
        xref,
    )
    return bytes(out)


def make_docx(path: Path, paragraphs: list[str], table: list[list[str]]) -> None:
    import docx

    document = docx.Document()
    document.add_heading(paragraphs[0], level=1)
    for text in paragraphs[1:]:
        document.add_paragraph(text)
    grid = document.add_table(rows=len(table), cols=len(table[0]))
    for r, row in enumerate(table):
        for c, value in enumerate(row):
            grid.cell(r, c).text = value
    document.save(path)


def make_folder(root: Path) -> Path:
    source = root / "docs"
    (source / "priority").mkdir(parents=True)
    (source / "notes").mkdir()
    (source / "manual.pdf").write_bytes(
        make_pdf(
            [
                [
                    "Mixed precision keeps a float32 master copy of the",
                    "weights and computes in bfloat16 on the GPU.",
                ],
                [
                    "Checkpoints are written atomically: a tempo-",
                    "rary folder is renamed once it is complete.",
                ],
            ]
        )
    )
    make_docx(
        source / "guide.docx",
        ["Resuming a run", "A run resumes from its latest complete checkpoint, including the data position."],
        [["setting", "default"], ["save_steps", "50"]],
    )
    (source / "notes" / "readme.md").write_text(
        "---\ntitle: notes\n---\n# Packing\n\n<!-- internal -->Packing concatenates short documents into "
        "one sequence and restarts position ids at each boundary.\n"
    )
    (source / "notes" / "copy.txt").write_text(
        LOREM.upper().replace(" ", "  ") + "\n"
    )  # same text, other case
    (source / "lorem.txt").write_text(LOREM + "\n")
    (source / "tiny.txt").write_text("Too short.\n")
    (source / "priority" / "house-style.md").write_text(
        "# House style\n\nAlways name the file and the expected value in an error message, in one line.\n"
    )
    (source / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not a pdf at all")
    (source / "scanned.pdf").write_bytes(make_pdf([[]]))
    (source / "bad.docx").write_bytes(b"PK\x03\x04 not really a zip")
    (source / "image.png").write_bytes(b"\x89PNG\r\n")
    return source


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_prepare_corpus_reads_every_format_dedups_and_repeats_priority(tmp_path, capsys):
    source = make_folder(tmp_path)
    out = tmp_path / "data.jsonl"
    assert cli(["prepare-corpus", str(source), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = read_jsonl(out)

    by_source: dict[str, list[str]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row["text"])
    pdf = by_source["manual.pdf"][0]
    assert "weights and computes in bfloat16" in pdf and "temporary folder is renamed" in pdf  # de-hyphenated
    docx_text = by_source["guide.docx"][0]
    assert docx_text.startswith("Resuming a run") and "save_steps | 50" in docx_text
    markdown = by_source["notes/readme.md"][0]
    assert markdown.startswith("# Packing") and "title: notes" not in markdown and "internal" not in markdown
    # The priority file's record is written three times; everything else once.
    assert by_source["priority/house-style.md"] == [by_source["priority/house-style.md"][0]] * 3
    assert len(by_source["manual.pdf"]) == 1
    # copy.txt repeats lorem.txt up to case and spacing: one of them is dropped, and the short file too.
    assert ("lorem.txt" in by_source) != ("notes/copy.txt" in by_source)
    assert "tiny.txt" not in by_source
    assert summary["duplicates"] == 1 and summary["too_short"] == 1

    assert summary["files_read"] == {"docx": 1, "markdown": 2, "pdf": 1, "text": 3}
    failed = {item["file"]: item["why"] for item in summary["failed"]}
    assert failed["broken.pdf"].startswith("not a readable PDF")
    assert failed["scanned.pdf"].startswith("no text layer")
    assert failed["bad.docx"].startswith("not a readable DOCX")
    assert summary["skipped"] == [{"file": "image.png", "why": "unsupported type '.png'"}]
    assert summary["records"] == len(rows) == 5 + 2 and summary["unique_records"] == 5
    assert summary["priority_files"] == 1 and summary["priority_records"] == 1
    assert summary["tokens"] == sum(round(len(r["text"]) / 4) for r in rows) and not summary["tokens_exact"]


def test_prepare_corpus_weights_priority_and_counts_tokens_with_a_tokenizer(tmp_path, capsys):
    source = make_folder(tmp_path)
    out = tmp_path / "weighted.jsonl"
    tokenizer = str(REPO / "configs" / "tiny-llama")
    args = ["prepare-corpus", str(source), "--out", str(out), "--priority-weight", "4", "--min-chars", "0"]
    assert cli([*args, "--tokenizer", tokenizer, "--no-dedup"]) == 0
    text = capsys.readouterr().out
    rows = read_jsonl(out)
    weights = {row["source"]: row["weight"] for row in rows}
    assert weights["priority/house-style.md"] == 4 and weights["manual.pdf"] == 1.0
    assert sum(row["source"] == "priority/house-style.md" for row in rows) == 1
    assert {"lorem.txt", "notes/copy.txt", "tiny.txt"} <= set(weights)  # no dedup, no minimum
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    expected = sum(len(tok(row["text"], add_special_tokens=False).input_ids) for row in rows)
    assert f"tokens: {expected:,} ({tokenizer})" in text
    assert "failed: broken.pdf: not a readable PDF" in text
    assert "records: 7 written" in text


def test_prepare_corpus_splits_long_documents_at_paragraphs(tmp_path, capsys):
    source = tmp_path / "long"
    source.mkdir()
    paragraphs = [f"Paragraph {i}. " + "word " * 60 for i in range(10)]
    (source / "book.txt").write_text("\n\n".join(paragraphs))
    out = tmp_path / "long.jsonl"
    assert cli(["prepare-corpus", str(source), "--out", str(out), "--max-chars", "1000"]) == 0
    rows = read_jsonl(out)
    assert len(rows) > 1 and all(len(r["text"]) <= 1000 for r in rows)
    joined = sorted(p for r in rows for p in r["text"].split("\n\n"))
    assert joined == sorted(p.strip() for p in paragraphs)  # nothing lost, no paragraph cut


def test_prepare_corpus_bad_input_and_missing_parser(tmp_path, capsys, monkeypatch):
    assert cli(["prepare-corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "DIR: folder not found" in capsys.readouterr().err
    source = make_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "pypdf", None)  # as if the corpus extra were not installed
    assert cli(["prepare-corpus", str(source), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "pypdf (for PDF files)" in err and "finetune-kit[corpus]" in err
    assert not (tmp_path / "o.jsonl").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "short.txt").write_text("hi")
    assert cli(["prepare-corpus", str(empty), "--out", str(tmp_path / "e.jsonl")]) == 1
    assert "no records written" in capsys.readouterr().err


def test_prepare_corpus_output_is_read_by_the_trainer_data_pipeline(tmp_path):
    """The file it writes goes through the trainer's own data preparation (format, split, tokenize)."""
    from transformers import AutoTokenizer

    from trainer.config import DataConfig, PathsConfig
    from trainer.data.dataset import prepare_data

    source = make_folder(tmp_path)
    out = tmp_path / "data.jsonl"
    assert cli(["prepare-corpus", str(source), "--out", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-llama")
    data = prepare_data(PathsConfig(train_file=str(out)), DataConfig(val_fraction=0.2), tokenizer, True)
    assert data.report.format == "text" and data.report.skipped_lines == 0
    assert data.report.train_records + data.report.val_records == 7
    assert len(data.train) > 0
