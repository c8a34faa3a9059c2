"""The field tables of docs/run-folder.md, generated from the typed records (``records.py``): each field,
whether every record carries it, and the docstring under it.

    python -m trainer.runfolder.reference           # rewrite the generated tables in docs/run-folder.md
    python -m trainer.runfolder.reference --check   # exit 1 when one is stale

Each table sits between ``<!-- generated: <log file> -->`` and ``<!-- end generated -->``; the rest of the
page is written by hand. tests/runfolder/test_reference.py fails when a field has no docstring or a table
is stale. Standard library only, like the rest of the library.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path

from trainer.runfolder.records import RECORD_TYPES, TS, Record

PAGE = Path(__file__).resolve().parents[2] / "docs" / "run-folder.md"
COMMAND = "python -m trainer.runfolder.reference"
END = "<!-- end generated -->"


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it in the class body), whitespace collapsed."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def missing_descriptions() -> list[str]:
    """``<log>:<field>`` of every written field without a docstring."""
    missing = []
    for kind in RECORD_TYPES:
        docs = field_docs(kind)
        missing += [
            f"{kind.LOG}:{name}" for name in (*kind.required()[1:], *kind.optional()) if name not in docs
        ]
    return missing


def table(kind: type[Record]) -> str:
    """Markdown rows: ``ts``, then the fields every record carries, then the optional ones."""
    docs = {name: text.replace("|", "\\|") for name, text in field_docs(kind).items()}
    rows = [
        "| field | written | meaning |",
        "|---|---|---|",
        f"| `{TS}` | always | Unix seconds (the writer adds it) |",
    ]
    rows += [f"| `{name}` | always | {docs.get(name, '')} |" for name in kind.required()[1:]]
    rows += [f"| `{name}` | when set | {docs.get(name, '')} |" for name in kind.optional()]
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """The page with every generated table replaced by what the records say; a missing marker is an error."""
    for kind in RECORD_TYPES:
        start = f"<!-- generated: {kind.LOG} ({COMMAND}) -->\n"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(END), re.DOTALL)
        if not pattern.search(page):
            raise ValueError(
                f"no generated table for {kind.LOG} in the page (expected a line {start.strip()})"
            )
        page = pattern.sub(lambda _, kind=kind, start=start: start + table(kind) + END, page, count=1)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is stale; write nothing")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"default: {PAGE}")
    args = parser.parse_args(argv)
    missing = missing_descriptions()
    if missing:
        print(
            f"no description (a docstring under the field in records.py): {', '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    current = args.page.read_text()
    page = render(current)
    if args.check:
        if page != current:
            print(f"{args.page} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(page)
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
