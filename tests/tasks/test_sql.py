"""Text-to-SQL in Spider's layout: the example builder, exact-set match, safe execution, scoring."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from tests.helpers import measured
from trainer.tasks import TaskDataError, get_task
from trainer.tasks.sql_example import QUESTIONS, write_example_spider
from trainer.tasks.sql_exec import SqliteRunner, results_match
from trainer.tasks.sql_match import SqlParseError, canonical, exact_set_match, has_top_level_order_by
from trainer.tasks.text_to_sql import extract_sql

NEVER_ENDS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture(scope="module")
def spider(tmp_path_factory):
    return write_example_spider(tmp_path_factory.mktemp("spider"))


@pytest.fixture()
def task(spider):
    return get_task("spider", spider, timeout_s=0.3)


def example(db_id: str, query: str) -> dict:
    return {"db_id": db_id, "question": "?", "query": query}


# -- the dataset --------------------------------------------------------------------------------------


def test_example_dataset_has_spiders_layout(spider, task):
    tables = json.loads((spider / "tables.json").read_text())
    assert {t["db_id"] for t in tables} == {"concert_singer", "pets_1", "employee_hire_evaluation"}
    for entry in tables:
        assert entry["column_names_original"][0] == [-1, "*"]
        assert len(entry["column_names_original"]) == len(entry["column_types"])
        assert (spider / "database" / entry["db_id"] / f"{entry['db_id']}.sqlite").is_file()
    dev, train = task.load("validation"), task.load("train")
    assert len(dev) + len(train) == len(QUESTIONS) and len(dev) >= 30
    assert set(dev[0]) == {"db_id", "question", "query"}


def test_gold_queries_score_perfectly_and_all_run(task):
    examples = task.load("dev")
    result = task.score([" " + e["query"] + ";\n\nQuestion: next" for e in examples], examples)
    assert result == {
        "exact_match": 1.0,
        "execution_accuracy": 1.0,
        "unparsed": 0,
        "too_long": 0,
        "too_deep": 0,
        "exec_errors": 0,
        "timeouts": 0,
        "gold_errors": 0,
        "n": len(examples),
    }


def test_prompt_shows_the_schema_with_keys_and_the_question(task):
    ex = task.load("validation")[8]
    prompt = task.prompt(ex)
    assert (
        "CREATE TABLE concert (concert_ID number, concert_Name text, Theme text, Stadium_ID number" in prompt
    )
    assert "FOREIGN KEY (Stadium_ID) REFERENCES stadium(Stadium_ID)" in prompt
    assert "PRIMARY KEY (Singer_ID)" in prompt
    assert prompt.endswith(f"-- Question: {ex['question']}\nSQL:")
    assert task.target(ex) == " " + ex["query"]


def test_missing_files_give_clear_errors(tmp_path, spider):
    with pytest.raises(TaskDataError, match="tables.json"):
        get_task("spider", tmp_path).load("validation")
    with pytest.raises(TaskDataError, match="needs data_dir"):
        get_task("spider")
    with pytest.raises(TaskDataError, match="unknown split"):
        get_task("spider", spider).load("test")


# -- exact-set match ------------------------------------------------------------------------------

EQUIVALENT = [
    # aliases, case, whitespace, semicolon
    ("SELECT T1.name FROM singer AS T1", "select name from singer;"),
    ("SELECT name FROM singer", "SELECT singer.name FROM singer"),
    # values are ignored, quotes normalised
    ("SELECT name FROM singer WHERE country = 'France'", 'SELECT name FROM singer WHERE country = "Germany"'),
    ("SELECT name FROM singer WHERE age > 30 LIMIT 3", "SELECT name FROM singer WHERE age > 40 LIMIT 1"),
    # sets: select items, conditions, join order, join conditions ignored
    ("SELECT name , age FROM singer", "SELECT age, name FROM singer"),
    (
        "SELECT name FROM singer WHERE age > 3 AND country = 'x'",
        "SELECT name FROM singer WHERE country = 'y' AND age > 4",
    ),
    (
        "SELECT T2.name , count(*) FROM concert AS T1 JOIN stadium AS T2 ON T1.stadium_id = T2.stadium_id GROUP BY T1.stadium_id",
        "SELECT b.name, COUNT(*) FROM stadium b JOIN concert a ON a.stadium_id = b.stadium_id GROUP BY a.stadium_id",
    ),
    (
        "SELECT name FROM singer WHERE age BETWEEN 20 AND 30 AND country = 'a'",
        "SELECT name FROM singer WHERE country = 'b' AND age BETWEEN 1 AND 2",
    ),
    # output aliases and the ORDER BY that uses them
    (
        "SELECT country, count(*) AS n FROM singer GROUP BY country ORDER BY n DESC",
        "SELECT country, count(*) FROM singer GROUP BY country ORDER BY count(*) DESC",
    ),
    # nesting and set operations normalise inside too
    (
        "SELECT name FROM stadium WHERE stadium_id NOT IN (SELECT T.stadium_id FROM concert AS T)",
        "SELECT name FROM stadium WHERE stadium_id NOT IN (SELECT stadium_id FROM concert)",
    ),
    (
        "SELECT country FROM singer WHERE age > 40 INTERSECT SELECT country FROM singer WHERE age < 30",
        "select country from singer where age > 1 intersect select country from singer where age < 2",
    ),
    ("SELECT a FROM t WHERE x <> 1", "SELECT a FROM t WHERE x != 2"),
    (
        "SELECT date, max(time) FROM t",
        "SELECT T1.date, MAX(T1.time) FROM t AS T1",
    ),  # names that are also SQL words
]
DIFFERENT = [
    ("SELECT name FROM singer", "SELECT country FROM singer"),
    ("SELECT count(*) FROM singer", "SELECT count(name) FROM singer"),
    ("SELECT name FROM singer WHERE age > 3", "SELECT name FROM singer WHERE age < 3"),
    ("SELECT name FROM singer WHERE age > 3", "SELECT name FROM singer"),
    (
        "SELECT name FROM singer WHERE age > 3 AND country = 'x'",
        "SELECT name FROM singer WHERE age > 3 OR country = 'x'",
    ),
    ("SELECT name FROM singer ORDER BY age", "SELECT name FROM singer ORDER BY age DESC"),
    ("SELECT name FROM singer ORDER BY age LIMIT 1", "SELECT name FROM singer ORDER BY age"),
    ("SELECT DISTINCT country FROM singer", "SELECT country FROM singer"),
    ("SELECT country FROM singer GROUP BY country", "SELECT country FROM singer"),
    (
        "SELECT country FROM singer GROUP BY country HAVING count(*) > 1",
        "SELECT country FROM singer GROUP BY country",
    ),
    ("SELECT a FROM t INTERSECT SELECT a FROM u", "SELECT a FROM t UNION SELECT a FROM u"),
    ("SELECT a FROM t EXCEPT SELECT a FROM u", "SELECT a FROM u EXCEPT SELECT a FROM t"),
    ("SELECT name FROM singer", "SELECT name FROM stadium"),
    (
        "SELECT T1.name FROM singer AS T1 JOIN concert AS T2",
        "SELECT T2.name FROM singer AS T1 JOIN concert AS T2",
    ),
    (
        "SELECT name FROM s WHERE id IN (SELECT id FROM a)",
        "SELECT name FROM s WHERE id IN (SELECT id FROM b)",
    ),
]


@pytest.mark.parametrize("predicted, gold", EQUIVALENT)
def test_exact_set_match_accepts_equivalent_spellings(predicted, gold):
    assert exact_set_match(predicted, gold)


@pytest.mark.parametrize("predicted, gold", DIFFERENT)
def test_exact_set_match_rejects_different_queries(predicted, gold):
    assert not exact_set_match(predicted, gold)


def test_schema_attaches_bare_columns_to_their_table(task):
    schema = task.schemas()["concert_singer"].column_sets()
    joined = "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id"
    bare = "SELECT name FROM singer JOIN singer_in_concert ON singer.singer_id = singer_in_concert.singer_id"
    assert exact_set_match(bare, joined, schema)
    assert not exact_set_match(bare, joined)  # without the schema 'name' could belong to either table


@pytest.mark.parametrize(
    "bad",
    ["", "SELEC name FROM singer", "SELECT", "SELECT name FROM", "SELECT name FROM singer WHERE", "SELECT (name FROM singer",
     "DROP TABLE singer", "SELECT 1; DELETE FROM singer", "SELECT name FROM singer ORDER age", NEVER_ENDS, "SELECT ¤"],
)  # fmt: skip
def test_unreadable_predictions_do_not_match_and_do_not_raise(bad):
    with pytest.raises(SqlParseError):
        canonical(bad)
    assert exact_set_match(bad, "SELECT name FROM singer") is False


def nested(depth: int) -> str:
    """A subquery nested ``depth`` deep: each level adds one pair of parentheses."""
    query = "SELECT name FROM singer"
    for _ in range(depth):
        query = f"SELECT name FROM singer WHERE singer_id IN ({query})"
    return query


def test_canonical_forms_grow_linearly_with_nesting():
    # The old string forms embedded repr() of each level, re-escaped at every level: 24 deep took
    # 134 MB and 2.4 s, 60 deep ended the process.
    query = nested(24)
    assert canonical(query) == canonical(query.lower())
    matched, seconds, peak = measured(exact_set_match, query, query)
    assert matched and seconds < 1.0 and peak < 5_000_000
    assert not exact_set_match(nested(24), nested(23))


def test_queries_beyond_the_limits_are_refused_with_a_reason():
    from trainer.tasks.sql_match import MAX_DEPTH, MAX_SQL_CHARS, SqlTooComplex

    with pytest.raises(SqlTooComplex, match="nested deeper than") as deep:
        canonical(nested(MAX_DEPTH + 1))
    assert deep.value.reason == "too_deep"
    long = "SELECT name FROM singer WHERE name = '" + "x" * MAX_SQL_CHARS + "'"
    with pytest.raises(SqlTooComplex, match="characters") as too_long:
        canonical(long)
    assert too_long.value.reason == "too_long"
    assert not exact_set_match(long, "SELECT name FROM singer")
    assert not exact_set_match(nested(200), nested(3))


@pytest.mark.parametrize(
    "predicted",
    [
        "SELECT name FROM singer -- the names",
        "SELECT name -- the names\nFROM singer",
        "SELECT name /* the names; all of them */ FROM singer",
        "SELECT name FROM singer /* unterminated",
        "SELECT /* a */ name FROM singer -- b",
    ],
)
def test_comments_anywhere_are_ignored(predicted):
    assert exact_set_match(predicted, "SELECT name FROM singer")


def test_a_comment_marker_inside_quotes_is_text():
    assert canonical("SELECT a FROM t WHERE b = '--x' AND c = 1") == canonical(
        "SELECT a FROM t WHERE b = 1 AND c = 2"
    )
    assert (
        extract_sql("SELECT a FROM t WHERE b = '/* x' AND c = 1 -- ok")
        == "SELECT a FROM t WHERE b = '/* x' AND c = 1"
    )


@pytest.mark.parametrize(
    "dangling",
    [
        "SELECT name FROM singer JOIN",
        "SELECT name FROM singer AS",
        "SELECT name FROM singer AS T1 JOIN",
        "SELECT name FROM singer LEFT JOIN",
        "SELECT name FROM singer JOIN concert ON",
        "SELECT name FROM singer ,",
        "SELECT name FROM singer JOIN JOIN concert",
        "SELECT name FROM singer ORDER BY name LIMIT 1 OFFSET",
        "SELECT name FROM singer WHERE singer_id IN (SELECT singer_id FROM concert JOIN)",
    ],
)
def test_sql_ending_in_a_dangling_keyword_is_no_match(dangling, spider):
    with sqlite3.connect(spider / "database" / "concert_singer" / "concert_singer.sqlite") as conn:
        with pytest.raises(sqlite3.OperationalError):  # SQLite rejects it too
            conn.execute(dangling)
    with pytest.raises(SqlParseError):
        canonical(dangling)
    assert not exact_set_match(dangling, "SELECT name FROM singer")


def test_unreadable_gold_falls_back_to_token_comparison():
    assert exact_set_match(NEVER_ENDS.lower() + " ;", NEVER_ENDS)
    assert not exact_set_match("SELECT 1", NEVER_ENDS)


def test_top_level_order_by_is_detected():
    assert has_top_level_order_by("SELECT a FROM t ORDER BY a DESC")
    assert not has_top_level_order_by("SELECT a FROM t WHERE b IN (SELECT b FROM u ORDER BY b LIMIT 1)")
    assert not has_top_level_order_by("SELECT a FROM t")


# -- execution ---------------------------------------------------------------------------------------


def test_results_compare_as_multisets_unless_ordered():
    rows = [("a", 1), ("b", 2), ("b", 2)]
    assert results_match(list(reversed(rows)), rows, ordered=False)
    assert not results_match(list(reversed(rows)), rows, ordered=True)
    assert not results_match([("a", 1), ("b", 2)], rows, ordered=False)  # multiset, not set
    assert results_match([(1, "a"), (2, "b"), (2, "b")], rows, ordered=False)  # columns in another order
    assert not results_match([(1, "b"), (2, "a"), (2, "b")], rows, ordered=False)
    assert results_match([(1.0,)], [(1,)], ordered=True)
    assert results_match([], [], ordered=True)
    assert not results_match([("a",)], [("a", 1)], ordered=False)


def test_runner_is_read_only_and_reports_failures(spider):
    with SqliteRunner(spider / "database", timeout_s=0.3) as runner:
        assert runner.run("pets_1", "SELECT count(*) FROM pets").rows == [(4,)]
        for statement in [
            "DELETE FROM pets",
            "DROP TABLE pets",
            "INSERT INTO pets VALUES (1, 'x', 1, 1)",
            f"ATTACH DATABASE '{spider}/evil.sqlite' AS evil",
            "PRAGMA writable_schema = 1",
            "SELECT 1; DELETE FROM pets",
            "SELECT nope FROM pets",
        ]:
            result = runner.run("pets_1", statement)
            assert not result.ok and result.error.startswith("error"), statement
        assert runner.run("pets_1", "SELECT count(*) FROM pets").rows == [(4,)]
        with pytest.raises(FileNotFoundError, match="no_such_db.sqlite"):
            runner.run("no_such_db", "SELECT 1")
    assert not (spider / "evil.sqlite").exists()
    with sqlite3.connect(spider / "database" / "pets_1" / "pets_1.sqlite") as conn:
        assert conn.execute("SELECT count(*) FROM pets").fetchone() == (4,)


def test_a_query_that_never_ends_times_out(spider):
    with SqliteRunner(spider / "database", timeout_s=0.2) as runner:
        start = time.monotonic()
        result = runner.run("concert_singer", NEVER_ENDS)
        assert time.monotonic() - start < 2
        assert result.error == "timeout"
        # the connection stays usable afterwards
        assert runner.run("concert_singer", "SELECT count(*) FROM singer").rows == [(6,)]


def test_runaway_results_are_cut_off(spider):
    with SqliteRunner(spider / "database", timeout_s=5, max_rows=100) as runner:
        result = runner.run("concert_singer", "SELECT * FROM stadium, singer, concert")  # 9*6*6 rows
        assert result.error == "too_many_rows"
    # 54 rows, but 12 columns wide: over a budget of 500 values
    with SqliteRunner(spider / "database", timeout_s=5, max_values=500) as runner:
        assert runner.run("concert_singer", "SELECT * FROM stadium, singer LIMIT 60").error == "too_many_rows"
        assert runner.run("concert_singer", "SELECT stadium.name FROM stadium, singer LIMIT 60").ok


# -- scoring --------------------------------------------------------------------------------------------


def test_execution_and_exact_match_disagree_where_they_should(task):
    gold = "SELECT name FROM singer WHERE age > 40"
    examples = [example("concert_singer", gold)] * 3
    predictions = [
        " SELECT name FROM singer WHERE age > 30",  # same shape, other value: exact yes, execution no
        " SELECT name FROM singer WHERE age >= 41",  # other operator, same rows: exact no, execution yes
        " SELECT T1.name FROM singer AS T1 WHERE T1.age > 40 ORDER BY T1.name",  # order free: both? exact no
    ]
    result = task.score(predictions, examples)
    assert result["exact_match"] == pytest.approx(1 / 3)
    assert result["execution_accuracy"] == pytest.approx(2 / 3)


def test_row_order_counts_only_when_gold_orders(task):
    ordered_gold = example("concert_singer", "SELECT name FROM singer ORDER BY age DESC")
    unordered_gold = example("concert_singer", "SELECT name FROM singer")
    reversed_order = " SELECT name FROM singer ORDER BY age ASC"
    result = task.score([reversed_order, reversed_order], [ordered_gold, unordered_gold])
    assert result["execution_accuracy"] == pytest.approx(1 / 2)


def test_bad_predictions_score_zero_and_never_crash(task):
    gold = "SELECT count(*) FROM singer"
    predictions = [
        " " + NEVER_ENDS,  # hangs: stopped by the time limit
        " SELEC count(*) FROM singer",  # malformed
        " DELETE FROM singer",  # not allowed
        "",  # nothing generated
        " SELECT count(*) FROM nowhere",  # no such table
        " ```sql\nSELECT count(*)\nFROM singer\n```",  # fenced, multi-line: fine
    ]
    start = time.monotonic()
    result = task.score(predictions, [example("concert_singer", gold)] * len(predictions))
    assert time.monotonic() - start < 5
    assert result["execution_accuracy"] == pytest.approx(1 / 6)
    assert result["exact_match"] == pytest.approx(1 / 6)
    assert result["timeouts"] == 1
    assert result["exec_errors"] == 4
    assert result["unparsed"] == 4  # the CTE, the typo, the DELETE and the empty answer


def test_predictions_beyond_the_limits_score_zero_with_a_counted_reason(task):
    from trainer.tasks.sql_match import MAX_DEPTH, MAX_SQL_CHARS

    gold = "SELECT name FROM singer"
    predictions = [
        " " + nested(MAX_DEPTH + 1),  # would match in spirit: still refused
        " " + nested(200),
        " SELECT name FROM singer WHERE name = '" + "x" * MAX_SQL_CHARS + "'",
        " SELECT name FROM singer WHERE name = '" + "y" * 5_000_000,  # never ends
        " " + gold,
    ]
    result = task.score(predictions, [example("concert_singer", gold)] * len(predictions))
    assert (result["too_deep"], result["too_long"]) == (2, 2)
    assert result["exact_match"] == result["execution_accuracy"] == pytest.approx(1 / 5)
    assert result["unparsed"] == result["exec_errors"] == result["timeouts"] == 0


def test_an_inline_comment_does_not_spoil_a_correct_answer(task):
    gold = "SELECT count(*) FROM singer"
    predictions = [
        " SELECT count(*) FROM singer -- every singer",
        " SELECT count(*) -- every singer\nFROM singer",
        " SELECT count(*) /* all */ FROM singer;",
    ]
    result = task.score(predictions, [example("concert_singer", gold)] * 3)
    assert result["exact_match"] == result["execution_accuracy"] == 1.0
    assert result["unparsed"] == 0


def test_a_broken_gold_query_is_counted_not_fatal(task):
    result = task.score([" SELECT 1"], [example("concert_singer", "SELECT nope FROM singer")])
    assert result["gold_errors"] == 1 and result["execution_accuracy"] == 0.0


def test_missing_database_is_a_data_error(task, tmp_path):
    with pytest.raises(TaskDataError, match="'no_such_db' is not in tables.json"):
        task.score([" SELECT 1"], [example("no_such_db", "SELECT 1")])
    root = write_example_spider(tmp_path / "spider")
    (root / "database" / "pets_1" / "pets_1.sqlite").unlink()
    with pytest.raises(TaskDataError, match=r"pets_1/pets_1.sqlite"):
        get_task("spider", root).score([" SELECT 1"], [example("pets_1", "SELECT 1")])


def test_extract_sql_takes_the_query_out_of_a_generated_answer():
    assert extract_sql(" SELECT a FROM t;  SELECT b FROM u") == "SELECT a FROM t"
    assert extract_sql(" SELECT a FROM t WHERE b = 'x;y'; junk") == "SELECT a FROM t WHERE b = 'x;y'"
    assert extract_sql("```sql\nSELECT a\n  FROM t\n```\nExplanation") == "SELECT a FROM t"
    assert extract_sql(" SELECT a FROM t\n-- Question: next one\nSQL: SELECT") == "SELECT a FROM t"
    assert extract_sql(" SELECT a FROM t\n\nmore text") == "SELECT a FROM t"
    assert extract_sql("") == ""
    assert extract_sql(" SELECT a -- the a column\nFROM t") == "SELECT a FROM t"
    assert extract_sql(" SELECT a /* ; */ FROM t; junk") == "SELECT a FROM t"
    assert extract_sql(" SELECT 'it''s; ok' FROM t; x") == "SELECT 'it''s; ok' FROM t"


def test_extract_sql_reads_a_bounded_prefix_of_a_huge_answer():
    from trainer.tasks.sql_match import SqlTooComplex

    tail = "\n\nand then " + "blah " * 1_000_000  # the answer ends early: the tail is never read
    assert extract_sql(" SELECT a FROM t" + tail) == "SELECT a FROM t"
    with pytest.raises(SqlTooComplex, match="runs past") as error:
        extract_sql(" SELECT a FROM t WHERE b = '" + "x" * 2_000_000)
    assert error.value.reason == "too_long"
