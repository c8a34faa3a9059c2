"""Whatever a model generates, scoring one answer takes bounded time and memory.

A seeded generator makes adversarial answers (deep nesting, megabyte literals and comments,
unbalanced quotes and parentheses, control characters, random token soup, long chains) and
each goes through exact-set match and the full task scoring path (Spider, with execution, and
GLUE), timed and with tracemalloc's peak measured. The families run from small to large, so
a regression trips the bound early instead of exhausting the machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.helpers import measured
from trainer.tasks import get_task
from trainer.tasks.sql_example import write_example_spider
from trainer.tasks.sql_match import exact_set_match

MAX_SECONDS = 1.0
MAX_PEAK_BYTES = 50_000_000
GOLD = "SELECT T1.name FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.singer_id = T2.singer_id"
MEGABYTE = 1_000_000
VOCAB = (
    "select from where group by having order limit offset asc desc and or not in like between is null exists "
    "distinct all as join on inner left right outer cross natural case when then else end union intersect "
    "except count max min avg sum singer concert stadium name age singer_id t1 t2 t1.name * , ( ) ( ) = != "
    "< > <= >= + - / % || ; 1 2.5 'x' \"y\" ' \" ` [ ] -- /* */ \n \t"
).split(" ")
CONTROL = "".join(map(chr, range(32))) + "\x7f\u2028\u2029\ufeff\ud800"


def nested_in(depth: int) -> str:
    query = "SELECT name FROM singer"
    for _ in range(depth):
        query = f"SELECT name FROM singer WHERE singer_id IN ({query})"
    return query


def nested_from(depth: int) -> str:
    query = "SELECT name FROM singer"
    for i in range(depth):
        query = f"SELECT * FROM ({query}) AS s{i}"
    return query


def adversarial_answers(seed: int = 11) -> Iterator[tuple[str, str]]:
    """``(label, answer)`` pairs, smallest first within each family."""
    rng = random.Random(seed)
    for depth in (1, 4, 8, 12, 16, 20, 22, 24, 26, 28, 31, 32, 33, 40, 60, 100, 200):
        yield f"IN nested {depth}", nested_in(depth)
        yield f"FROM nested {depth}", nested_from(depth)
        yield f"parentheses {depth}", "SELECT " + "(" * depth + "age" + ")" * depth + " FROM singer"
        yield f"unclosed {depth}", "SELECT name FROM singer WHERE age IN " + "(SELECT " * depth
    for size in (MEGABYTE // 100, MEGABYTE, 3 * MEGABYTE):
        yield f"literal {size}", f"SELECT name FROM singer WHERE name = '{'x' * size}'"
        yield f"unterminated literal {size}", "SELECT name FROM singer WHERE name = '" + "y" * size
        yield f"number {size}", "SELECT " + "9" * size + " FROM singer"
        yield f"identifier {size}", "SELECT " + "n" * size + " FROM singer"
        yield f"block comment {size}", "SELECT name /*" + "c" * size + "*/ FROM singer"
        yield f"line comment {size}", "SELECT name FROM singer --" + "c" * size
        yield f"comment openers {size}", "SELECT " + "/*" * (size // 2)
        yield f"whitespace {size}", "SELECT" + " \n\t" * (size // 3) + "name FROM singer"
        yield f"quotes {size}", "'\"`[" * (size // 4)
        yield f"parentheses {size}", "SELECT " + "(" * size
    for count in (10, 100, 1000):
        yield f"union chain {count}", " UNION ".join(["SELECT name FROM singer"] * count)
        yield f"wide select {count}", "SELECT " + ", ".join(["name"] * count) + " FROM singer"
        yield f"long where {count}", "SELECT name FROM singer WHERE " + " AND ".join(["age > 1"] * count)
        aliases = ", ".join(["age AS a0"] + [f"a{i - 1} + a{i - 1} AS a{i}" for i in range(1, count)])
        yield f"alias chain {count}", f"SELECT {aliases} FROM singer ORDER BY a{count - 1}, a{count - 1} + 1"
        yield f"cross join {count}", "SELECT * FROM " + ", ".join(f"singer s{i}" for i in range(count))
    for i in range(40):
        length = rng.choice((5, 50, 500, 5000))
        yield f"control soup {i}", "SELECT name" + "".join(rng.choice(CONTROL) for _ in range(length))
        yield f"quote soup {i}", "".join(rng.choice("'\"`[]()-/*; select") for _ in range(length))
        yield f"token soup {i}", " ".join(rng.choice(VOCAB) for _ in range(length))
        yield f"select soup {i}", "SELECT " + " ".join(rng.choice(VOCAB) for _ in range(length))


@pytest.fixture(scope="module")
def spider(tmp_path_factory):
    root = write_example_spider(tmp_path_factory.mktemp("spider"))
    return get_task("spider", root, timeout_s=0.2)


def check_bounded(label: str, fn, *args):
    result, seconds, peak = measured(fn, *args)
    assert seconds < MAX_SECONDS, f"{label}: {seconds:.2f} s"
    assert peak < MAX_PEAK_BYTES, f"{label}: peak {peak / 1e6:.0f} MB"
    return result


def test_every_adversarial_answer_is_scored_in_bounded_time_and_memory(spider):
    example = {"db_id": "concert_singer", "question": "?", "query": GOLD}
    stsb, cola = get_task("stsb"), get_task("cola")
    seen = 0
    for label, answer in adversarial_answers():
        assert check_bounded(label, exact_set_match, answer, GOLD) is False, label
        result = check_bounded(label, spider.score, [" " + answer], [example])
        assert result["exact_match"] == 0.0 and result["execution_accuracy"] in (0.0, 1.0), label
        check_bounded(label, stsb.score, [answer], [{"label": 2.5}])
        check_bounded(label, cola.score, [answer], [{"label": 1}])
        seen += 1
    assert seen > 250


def test_the_generator_is_seeded():
    assert list(adversarial_answers(3))[-5:] == list(adversarial_answers(3))[-5:]
    assert list(adversarial_answers(3))[-1] != list(adversarial_answers(4))[-1]
