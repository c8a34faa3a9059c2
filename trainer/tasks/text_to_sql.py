"""Text-to-SQL in Spider's layout: schema-in-prompt, exact-set match and execution accuracy.

Spider's folder holds ``tables.json`` (schemas), ``database/<db_id>/<db_id>.sqlite`` and question
files (``dev.json``, ``train_spider.json``, ``train_others.json``) whose records carry ``db_id``,
``question`` and the gold ``query``. ``trainer.tasks.sql_example`` writes a small folder in the
same layout, for trying the task and for the tests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.tasks.base import MetricForBest, Task, TaskDataError
from trainer.tasks.sql_exec import ExecResult, SqliteRunner, results_match
from trainer.tasks.sql_match import (
    MAX_SQL_CHARS,
    SqlParseError,
    SqlTooComplex,
    canonical,
    exact_set_match,
    has_top_level_order_by,
)

SPLIT_FILES = {
    "train": ("train_spider.json", "train_others.json"),
    "validation": ("dev.json",),
}


@dataclass(frozen=True)
class DbSchema:
    """One database's tables as ``tables.json`` lists them (original names, as the SQL uses them)."""

    db_id: str
    tables: tuple[str, ...]
    columns: tuple[tuple[int, str, str], ...]  # (table index, column name, type); no '*'
    primary_keys: tuple[int, ...]  # indices into columns
    foreign_keys: tuple[tuple[int, int], ...]  # (column, referenced column)

    @classmethod
    def from_tables_json(cls, entry: dict) -> DbSchema:
        names = entry["column_names_original"]
        types = entry.get("column_types", ["text"] * len(names))
        # Spider's column 0 is (-1, '*'); keep the others, remembering their original indices.
        index = {i: k for k, i in enumerate(i for i, (t, _) in enumerate(names) if t >= 0)}
        return cls(
            db_id=entry["db_id"],
            tables=tuple(entry["table_names_original"]),
            columns=tuple((t, c, ty) for (t, c), ty in zip(names, types) if t >= 0),
            primary_keys=tuple(index[p] for p in _flat(entry.get("primary_keys", [])) if p in index),
            foreign_keys=tuple(
                (index[a], index[b]) for a, b in entry.get("foreign_keys", []) if a in index and b in index
            ),
        )

    def column_sets(self) -> dict[str, set[str]]:
        """Table -> column names, lower case: lets the matcher attach bare columns to their table."""
        sets: dict[str, set[str]] = {t.lower(): set() for t in self.tables}
        for t, c, _ in self.columns:
            sets[self.tables[t].lower()].add(c.lower())
        return sets

    def to_sql(self) -> str:
        """The schema as compact CREATE TABLE lines, keys included: what the prompt shows the model."""
        lines = []
        for t, table in enumerate(self.tables):
            cols = [f"{c} {ty}" for ti, c, ty in self.columns if ti == t]
            pks = [self.columns[k][1] for k in self.primary_keys if self.columns[k][0] == t]
            if pks:
                cols.append(f"PRIMARY KEY ({', '.join(pks)})")
            for a, b in self.foreign_keys:
                if self.columns[a][0] == t:
                    ref_table, ref_col = self.tables[self.columns[b][0]], self.columns[b][1]
                    cols.append(f"FOREIGN KEY ({self.columns[a][1]}) REFERENCES {ref_table}({ref_col})")
            lines.append(f"CREATE TABLE {table} ({', '.join(cols)});")
        return "\n".join(lines)


def _flat(keys: list) -> list[int]:
    """Spider lists composite primary keys as nested lists in some versions."""
    return [k for item in keys for k in (item if isinstance(item, list) else [item])]


MAX_ANSWER_CHARS = 4 * MAX_SQL_CHARS  # room for comments and whitespace around a query of the longest kind
REFUSALS = ("too_long", "too_deep")  # predictions scored 0 unread (sql_match's limits), counted by reason
_FENCE = re.compile(r"```(?:sql)?", re.IGNORECASE)
# Where the answer ends: a blank line, a comment line (the next "-- Question:"), or a new prompt.
_ANSWER_END = re.compile(r"\n\s*\n|\n\s*--|\n\s*(?:Question|SQL)\s*:")
# Quoted text (kept whole, also when unterminated: SQLite reads it to the end), comments, ';'.
_LEXEME = re.compile(
    r"""'[^']*(?:''[^']*)*(?:'|\Z)|"[^"]*(?:""[^"]*)*(?:"|\Z)|`[^`]*(?:`|\Z)|\[[^\]]*(?:\]|\Z)
    |(?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
    |(?P<semicolon>;)""",
    re.DOTALL | re.VERBOSE,
)


def extract_sql(generated: str) -> str:
    """The query in a generated answer: code fences and comments dropped, cut at ';' or a comment line.

    Comments go before whitespace is collapsed, so a trailing ``-- note`` cannot swallow the rest of
    the query; quoted text is left alone. Only the first ``MAX_ANSWER_CHARS`` are read, so the cost
    is bounded: an answer still going on there raises ``SqlTooComplex('too_long')``.
    """
    window = generated[:MAX_ANSWER_CHARS]
    text = _FENCE.sub("\n", window).strip()
    end = _ANSWER_END.search(text)
    ended = end is not None or len(generated) <= MAX_ANSWER_CHARS
    if end is not None:
        text = text[: end.start()]
    pieces, pos = [], 0
    for match in _LEXEME.finditer(text):
        if match.group("semicolon") is not None:
            pieces.append(text[pos : match.start()])
            pos, ended = len(text), True
            break
        if match.group("comment") is not None:
            pieces += [text[pos : match.start()], " "]
            pos = match.end()
    if not ended:
        raise SqlTooComplex("too_long", f"the answer runs past {MAX_ANSWER_CHARS} characters")
    pieces.append(text[pos:])
    return " ".join("".join(pieces).split())


class SpiderTask(Task):
    """Spider (or any folder in its layout): exact-set match and execution accuracy."""

    name = "spider"
    metric_for_best = MetricForBest("execution_accuracy")
    max_new_tokens = 128

    def __init__(self, data_dir: str | Path, timeout_s: float = 5.0, name: str = "spider"):
        self.data_dir = Path(data_dir)
        self.name = name
        self.timeout_s = timeout_s
        self._schemas: dict[str, DbSchema] | None = None

    @property
    def db_root(self) -> Path:
        return self.data_dir / "database"

    def schemas(self) -> dict[str, DbSchema]:
        if self._schemas is None:
            path = self.data_dir / "tables.json"
            if not path.is_file():
                raise TaskDataError(
                    f"{self.name}: no {path}; expected Spider's layout (tables.json, database/, dev.json)"
                )
            self._schemas = {e["db_id"]: DbSchema.from_tables_json(e) for e in json.loads(path.read_text())}
        return self._schemas

    def load(self, split: str) -> list[dict]:
        """Examples ``{db_id, question, query}``; ``dev`` means validation; train adds train_others.json if present."""
        split = "validation" if split == "dev" else split
        if split not in SPLIT_FILES:
            raise TaskDataError(
                f"{self.name}: unknown split {split!r}; expected one of {', '.join(SPLIT_FILES)}"
            )
        schemas = self.schemas()
        paths = [self.data_dir / f for f in SPLIT_FILES[split]]
        if not paths[0].is_file():
            raise TaskDataError(f"{self.name}: no {paths[0]} for split {split!r}")
        examples = []
        for path in (p for p in paths if p.is_file()):
            for record in json.loads(path.read_text()):
                examples.append(
                    {"db_id": record["db_id"], "question": record["question"], "query": record["query"]}
                )
        unknown = sorted({e["db_id"] for e in examples} - set(schemas))
        if unknown:
            raise TaskDataError(f"{self.name}: databases {unknown[:5]} are not in tables.json")
        return examples

    def prompt(self, example: dict) -> str:
        schema = self.schemas()[example["db_id"]]
        return f"-- SQLite database {schema.db_id}\n{schema.to_sql()}\n-- Question: {example['question'].strip()}\nSQL:"

    def target(self, example: dict) -> str:
        return " " + example["query"].strip()

    def score(self, predictions: list[str], examples: list[dict], stop_check=None) -> dict[str, float]:
        """``exact_match`` and ``execution_accuracy``, plus counts of unreadable, refused, failing and
        timed-out predictions. ``stop_check`` runs before each prediction: each may take the SQL time limit."""
        self._check_aligned(predictions, examples)
        counts = dict.fromkeys(
            ("exact_match", "execution_accuracy", "unparsed", *REFUSALS, "exec_errors", "timeouts"), 0
        )
        counts["gold_errors"] = 0
        gold_cache: dict[tuple[str, str], ExecResult] = {}
        with SqliteRunner(self.db_root, timeout_s=self.timeout_s) as runner:
            for generated, example in zip(predictions, examples):
                if stop_check is not None:
                    stop_check()
                self._score_one(generated, example, runner, gold_cache, counts)
        n = len(examples)
        rates = {k: counts[k] / n if n else 0.0 for k in ("exact_match", "execution_accuracy")}
        return {**counts, **rates, "n": n}

    def _score_one(
        self, generated: str, example: dict, runner: SqliteRunner, gold_cache: dict, counts: dict
    ) -> None:
        """Add one prediction's outcome to ``counts`` (rates are divided out by ``score``).

        A prediction beyond the matcher's limits (``too_long``, ``too_deep``) scores 0 without being
        parsed or run: one generated answer must not stall or exhaust the evaluation.
        """
        db_id, gold = example["db_id"], example["query"]
        if db_id not in self.schemas():
            raise TaskDataError(f"{self.name}: database {db_id!r} is not in tables.json")
        columns = self.schemas()[db_id].column_sets()
        sql, refused = "", None
        try:
            sql = extract_sql(generated)
            canonical(sql, columns)
        except SqlTooComplex as exc:
            refused = exc.reason
            counts[refused] += 1
        except SqlParseError:
            counts["unparsed"] += 1
        if refused is None:
            counts["exact_match"] += exact_set_match(sql, gold, columns)
        key = (db_id, gold)
        if key not in gold_cache:
            try:
                gold_cache[key] = runner.run(db_id, gold)
            except FileNotFoundError as exc:
                raise TaskDataError(f"{self.name}: {exc}") from exc
        gold_result = gold_cache[key]
        if not gold_result.ok:
            counts["gold_errors"] += 1
            return
        if refused is not None:
            return
        predicted = runner.run(db_id, sql) if sql else None
        if predicted is None or not predicted.ok:
            timed_out = predicted is not None and predicted.error == "timeout"
            counts["timeouts" if timed_out else "exec_errors"] += 1
            return
        counts["execution_accuracy"] += results_match(
            predicted.rows, gold_result.rows, has_top_level_order_by(gold)
        )
