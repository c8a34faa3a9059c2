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
from trainer.tasks.sql_match import SqlParseError, canonical, exact_set_match, has_top_level_order_by

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


def extract_sql(generated: str) -> str:
    """The query in a generated answer: code fences dropped, cut at ';', a blank line or a comment line."""
    text = re.sub(r"```(?:sql)?", "\n", generated, flags=re.IGNORECASE).strip()
    text = re.split(r"\n\s*\n|\n\s*--|\n\s*(?:Question|SQL)\s*:", text)[0]
    text = _cut_at_semicolon(text)
    return " ".join(text.split())


def _cut_at_semicolon(text: str) -> str:
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";":
            return text[:i]
    return text


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

    def score(self, predictions: list[str], examples: list[dict]) -> dict[str, float]:
        """``exact_match`` and ``execution_accuracy``, plus counts of unreadable, failing and timed-out predictions."""
        self._check_aligned(predictions, examples)
        counts = dict.fromkeys(
            ("exact_match", "execution_accuracy", "unparsed", "exec_errors", "timeouts"), 0
        )
        counts["gold_errors"] = 0
        gold_cache: dict[tuple[str, str], ExecResult] = {}
        with SqliteRunner(self.db_root, timeout_s=self.timeout_s) as runner:
            for generated, example in zip(predictions, examples):
                self._score_one(extract_sql(generated), example, runner, gold_cache, counts)
        n = len(examples)
        rates = {k: counts[k] / n if n else 0.0 for k in ("exact_match", "execution_accuracy")}
        return {**counts, **rates, "n": n}

    def _score_one(
        self, sql: str, example: dict, runner: SqliteRunner, gold_cache: dict, counts: dict
    ) -> None:
        """Add one prediction's outcome to ``counts`` (rates are divided out by ``score``)."""
        db_id, gold = example["db_id"], example["query"]
        if db_id not in self.schemas():
            raise TaskDataError(f"{self.name}: database {db_id!r} is not in tables.json")
        columns = self.schemas()[db_id].column_sets()
        try:
            canonical(sql, columns)
        except SqlParseError:
            counts["unparsed"] += 1
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
        predicted = runner.run(db_id, sql) if sql else None
        if predicted is None or not predicted.ok:
            timed_out = predicted is not None and predicted.error == "timeout"
            counts["timeouts" if timed_out else "exec_errors"] += 1
            return
        counts["execution_accuracy"] += results_match(
            predicted.rows, gold_result.rows, has_top_level_order_by(gold)
        )
