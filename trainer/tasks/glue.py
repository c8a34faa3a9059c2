"""GLUE as text generation: a prompt per row, a label word per class, GLUE's official metrics.

A model answers with a word (``positive``, ``yes``, ``entailment``; STS-B: a number). We read
back the first label word in the answer (whole words, case-insensitive); an answer with none
is wrong and counted as ``unparsed``. Data comes from the GLUE download's TSV files (the layout
of ``download_glue_data.py``) or, with no local folder, from ``datasets`` (needs the Hub).
"""

from __future__ import annotations

import csv
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainer.tasks import metrics
from trainer.tasks.base import MetricForBest, Task, TaskDataError

log = logging.getLogger(__name__)

STSB_RANGE = (0.0, 5.0)
STSB_FALLBACK = 2.5  # an unreadable STS-B answer scores as the middle of the scale (and is counted)
HF_DATASET = "nyu-mll/glue"
MAX_ANSWER_CHARS = 4096  # where the search for a label word stops


@dataclass(frozen=True)
class GlueSpec:
    """One GLUE task: where its text and label live, how it is asked, how it is scored."""

    name: str
    folder: str  # folder in the GLUE download, e.g. SST-2
    columns: tuple[str, ...]  # TSV columns holding the one or two texts
    label_column: str
    labels: dict[str, int] | None  # TSV label text -> label id (HF's ids); None: a float score
    label_words: tuple[str, ...]  # answer word per label id
    hf_columns: tuple[str, ...]  # the same texts in the `datasets` version
    text_names: tuple[str, ...]  # how the prompt names each text
    question: str
    metric_names: tuple[str, ...]  # the first one picks the best checkpoint
    headerless: tuple[str, ...] = ()  # column names for files without a header row (CoLA)
    # Other words an answer may use for a label ("not equivalent" then reads as "no": see parse_label).
    synonyms: dict[str, int] = field(default_factory=dict)
    extra_splits: dict[str, tuple[tuple[str, str | None], ...]] = field(default_factory=dict)

    @property
    def best(self) -> str:
        return self.metric_names[0]


_BINARY = {"0": 0, "1": 1}
_NLI2 = {"entailment": 0, "not_entailment": 1}
_PAIR = ("sentence1", "sentence2")
_SENTENCES = ("Sentence 1", "Sentence 2")
_YES_NO = "Answer yes or no."
# name, folder, TSV text columns, TSV label column, TSV labels, label words, hub columns, prompt names,
# question, metrics (the first picks the best checkpoint)
SPECS: dict[str, GlueSpec] = {
    s.name: s
    for s in (
        GlueSpec("cola", "CoLA", ("sentence",), "label", _BINARY, ("unacceptable", "acceptable"), ("sentence",),
                 ("Sentence",), "Is this sentence grammatically acceptable or unacceptable?",
                 ("matthews_correlation", "accuracy"), headerless=("source", "label", "original_label", "sentence")),
        GlueSpec("sst2", "SST-2", ("sentence",), "label", _BINARY, ("negative", "positive"), ("sentence",),
                 ("Sentence",), "Is the sentiment of this sentence positive or negative?", ("accuracy",)),
        GlueSpec("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", _BINARY, ("no", "yes"), _PAIR, _SENTENCES,
                 f"Do the two sentences mean the same thing? {_YES_NO}", ("f1", "accuracy"),
                 synonyms={"equivalent": 1, "not_equivalent": 0}),
        GlueSpec("qqp", "QQP", ("question1", "question2"), "is_duplicate", _BINARY, ("no", "yes"),
                 ("question1", "question2"), ("Question 1", "Question 2"),
                 f"Do the two questions ask the same thing? {_YES_NO}", ("f1", "accuracy"),
                 synonyms={"duplicate": 1, "duplicates": 1}),
        GlueSpec("stsb", "STS-B", _PAIR, "score", None, (), _PAIR, _SENTENCES,
                 "How similar are the two sentences, on a scale from 0 to 5?", ("pearson", "spearman")),
        GlueSpec("mnli", "MNLI", _PAIR, "gold_label", {"entailment": 0, "neutral": 1, "contradiction": 2},
                 ("entailment", "neutral", "contradiction"), ("premise", "hypothesis"), ("Premise", "Hypothesis"),
                 "Does the premise entail the hypothesis? Answer entailment, neutral or contradiction.", ("accuracy",),
                 extra_splits={
                     "validation": (("dev_matched.tsv", "matched"), ("dev_mismatched.tsv", "mismatched")),
                     "validation_matched": (("dev_matched.tsv", "matched"),),
                     "validation_mismatched": (("dev_mismatched.tsv", "mismatched"),),
                 }),
        GlueSpec("qnli", "QNLI", ("question", "sentence"), "label", _NLI2, ("yes", "no"), ("question", "sentence"),
                 ("Question", "Sentence"), f"Does the sentence answer the question? {_YES_NO}", ("accuracy",),
                 synonyms=_NLI2),
        GlueSpec("rte", "RTE", _PAIR, "label", _NLI2, ("yes", "no"), _PAIR, _SENTENCES,
                 f"Does sentence 1 entail sentence 2? {_YES_NO}", ("accuracy",), synonyms=_NLI2),
        GlueSpec("wnli", "WNLI", _PAIR, "label", _BINARY, ("no", "yes"), _PAIR, _SENTENCES,
                 f"Does sentence 1 entail sentence 2? {_YES_NO}", ("accuracy",),
                 synonyms={"entailment": 1, "not_entailment": 0}),
    )
}  # fmt: skip


# "not", "never" or "-n't" right before a label word, one word allowed between ("not really acceptable").
_NEGATED = re.compile(r"(?:\b(?:not|never)|n['\u2019]t)\s+(?:\w+\s+)?\Z", re.IGNORECASE)


def parse_label(text: str, words: tuple[str, ...], synonyms: dict[str, int] | None = None) -> int | None:
    """Label id of the first label word (or synonym) in ``text`` (whole word, any case), or None.

    A negated word ("not acceptable", "isn't equivalent") names the other label of a binary task;
    with three or more labels it names none, and the next word is read instead.
    """
    ids = {w.lower(): i for i, w in enumerate(words)}
    ids.update({w.lower(): i for w, i in (synonyms or {}).items()})
    pattern = r"\b(" + "|".join(re.escape(w) for w in sorted(ids, key=len, reverse=True)) + r")\b"
    for match in re.finditer(pattern, text, flags=re.IGNORECASE):
        label = ids[match.group(1).lower()]
        before = text[max(0, match.start() - 64) : match.start()]
        if _NEGATED.search(before) is None:
            return label
        if len(words) == 2:
            return 1 - label
    return None


_NUMBER_WORDS = {"zero": 0.0, "one": 1.0, "two": 2.0, "three": 3.0, "four": 4.0, "five": 5.0}
_NUMBER = re.compile(
    r"(?<![\w.])([-+]?(?:\d+(?:[.,]\d+)?|[.,]\d+))|\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE
)


def parse_score(text: str) -> float | None:
    """The first number in ``text`` (digits, ``3,5`` or a word up to five), clamped to 0..5; else None."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = (
        float(match.group(1).replace(",", ".")) if match.group(1) else _NUMBER_WORDS[match.group(2).lower()]
    )
    return min(max(value, STSB_RANGE[0]), STSB_RANGE[1])


def read_tsv(path: Path, headerless: tuple[str, ...] = ()) -> tuple[list[tuple[int, dict[str, str]]], int]:
    """Rows of a GLUE TSV as ``(line number, row dict)``, and how many malformed rows were skipped.

    GLUE's TSVs are not CSV-quoted (quotes are text), so QUOTE_NONE; a row whose field count
    differs from the header's is malformed (QQP and others have a few) and is skipped.
    """
    with open(path, encoding="utf-8-sig", newline="") as handle:  # -sig: MRPC starts with a BOM
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        rows = [(reader.line_num, row) for row in reader]
    header = list(headerless) if headerless else [h.strip() for h in (rows.pop(0)[1] if rows else [])]
    good = [(line, dict(zip(header, row))) for line, row in rows if len(row) == len(header)]
    return good, len(rows) - len(good)


class GlueTask(Task):
    """One GLUE task, read from ``data_dir`` (the GLUE download, or its task folder) or from the Hub."""

    def __init__(self, name: str, data_dir: str | Path | None = None, hf_dataset: str = HF_DATASET):
        if name not in SPECS:
            raise ValueError(f"unknown GLUE task {name!r}; expected one of {', '.join(SPECS)}")
        self.spec = SPECS[name]
        self.name = name
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.hf_dataset = hf_dataset
        self.metric_for_best = MetricForBest(self.spec.best)
        self.max_new_tokens = 8
        self.skipped_rows: dict[str, int] = {}  # split -> malformed or unlabelled rows skipped by load

    # -- data -------------------------------------------------------------------------------
    def load(self, split: str) -> list[dict]:
        """Examples ``{idx, text_a, text_b, label}`` (MNLI adds ``subset``); ``dev`` means validation."""
        split = "validation" if split == "dev" else split
        if split == "test":
            raise TaskDataError(f"{self.name}: GLUE's test labels are not public; evaluate on 'validation'")
        if self.data_dir is None:
            return self._load_hub(split)
        return self._load_local(split)

    def _split_files(self, split: str) -> tuple[tuple[str, str | None], ...]:
        files = {"train": (("train.tsv", None),), "validation": (("dev.tsv", None),)}
        files.update(self.spec.extra_splits)
        if split not in files:
            raise TaskDataError(f"{self.name}: unknown split {split!r}; expected one of {', '.join(files)}")
        return files[split]

    def _folder(self, first_file: str) -> Path:
        """The task's folder in a GLUE download, or ``data_dir`` itself when it holds the files."""
        assert self.data_dir is not None
        if (self.data_dir / self.spec.folder).is_dir():
            return self.data_dir / self.spec.folder
        if (self.data_dir / first_file).is_file():
            return self.data_dir
        raise TaskDataError(
            f"{self.name}: no {self.data_dir / self.spec.folder / first_file}; expected the GLUE download's "
            f"layout ({self.spec.folder}/{first_file} under data_dir) or {first_file} directly in data_dir"
        )

    def _load_local(self, split: str) -> list[dict]:
        files = self._split_files(split)
        folder = self._folder(files[0][0])
        examples: list[dict] = []
        skipped = 0
        for filename, subset in files:
            path = folder / filename
            if not path.is_file():
                raise TaskDataError(f"{self.name}: missing {path} for split {split!r}")
            rows, bad = read_tsv(path, self.spec.headerless)
            skipped += bad
            for line, row in rows:
                example = self._from_row(row, subset, len(examples), f"{path}:{line}")
                if example is None:
                    skipped += 1
                else:
                    examples.append(example)
        self.skipped_rows[split] = skipped
        if skipped:
            log.warning("%s/%s: skipped %d malformed or unlabelled rows", self.name, split, skipped)
        return examples

    def _from_row(self, row: dict[str, str], subset: str | None, idx: int, where: str) -> dict | None:
        missing = [c for c in (*self.spec.columns, self.spec.label_column) if c not in row]
        if missing:
            raise TaskDataError(f"{self.name}: TSV has no column(s) {missing}; columns are {list(row)}")
        raw = row[self.spec.label_column].strip()
        if self.spec.labels is None:
            try:
                label: float | int = float(raw)
            except ValueError:
                return None
            _check_score(label, where, self.spec.label_column)
        elif raw in self.spec.labels:
            label = self.spec.labels[raw]
        else:
            return None  # e.g. MNLI's '-' (no gold label)
        texts = [row[c] for c in self.spec.columns]
        return self._example(idx, texts, label, subset)

    def _example(self, idx: int, texts: list[str], label: float | int, subset: str | None) -> dict:
        example = {
            "idx": idx,
            "text_a": texts[0],
            "text_b": texts[1] if len(texts) > 1 else None,
            "label": label,
        }
        if subset is not None:
            example["subset"] = subset
        return example

    def _load_hub(self, split: str) -> list[dict]:
        files = self._split_files(split)  # validates the split name
        if split == "train" or not self.spec.extra_splits:
            hub_splits = [(split, None)]
        else:  # MNLI: validation_matched / validation_mismatched
            hub_splits = [(f"validation_{subset}", subset) for _, subset in files]
        try:
            import datasets

            parts = [
                (datasets.load_dataset(self.hf_dataset, self.name, split=s), sub) for s, sub in hub_splits
            ]
        except Exception as exc:  # offline, missing cache, renamed dataset: all mean the same to the user
            raise TaskDataError(
                f"{self.name}: could not load GLUE from the Hub ({self.hf_dataset!r}: {type(exc).__name__}: {exc}). "
                f"Offline? Download GLUE and pass its folder as data_dir (holding {self.spec.folder}/dev.tsv)."
            ) from exc
        examples = []
        for rows, subset in parts:
            for i, row in enumerate(rows):
                if self.spec.labels is None:
                    _check_score(row["label"], f"{self.hf_dataset} {self.name} row {i}", "label")
                texts = [row[c] for c in self.spec.hf_columns]
                examples.append(self._example(len(examples), texts, row["label"], subset))
        self.skipped_rows[split] = 0
        return examples

    # -- prompting and scoring ----------------------------------------------------------------
    def prompt(self, example: dict) -> str:
        texts = [example["text_a"], example["text_b"]][: len(self.spec.columns)]
        lines = [f"{name}: {text.strip()}" for name, text in zip(self.spec.text_names, texts)]
        return "\n".join([*lines, self.spec.question, "Answer:"])

    def target(self, example: dict) -> str:
        if self.spec.labels is None:
            return " " + f"{float(example['label']):.2f}".rstrip("0").rstrip(".")
        return " " + self.spec.label_words[example["label"]]

    def answer_words(self) -> tuple[str, ...]:
        return self.spec.label_words

    def parse(self, text: str) -> int | float | None:
        """The label (or STS-B score) an answer names, None when it names none.

        Only the first ``MAX_ANSWER_CHARS`` are read: an answer is a word or a number, and a
        runaway generation must not cost more than that.
        """
        text = text[:MAX_ANSWER_CHARS]
        if self.spec.labels is None:
            return parse_score(text)
        return parse_label(text, self.spec.label_words, self.spec.synonyms)

    def score(
        self, predictions: list[str], examples: list[dict], stop_check=None
    ) -> dict[str, float | str | None]:
        """GLUE's metrics for this task, plus ``unparsed`` (answers naming no label) and ``n``.

        A metric that is undefined (a correlation over a non-finite score) is None, never a number,
        and ``undefined`` says which and why, so a broken gold file cannot score perfectly. Parsing is
        quick and bounded per answer, so ``stop_check`` is not needed here.
        """
        self._check_aligned(predictions, examples)
        golds = [e["label"] for e in examples]
        parsed = [self.parse(p) for p in predictions]
        unparsed = sum(p is None for p in parsed)
        if self.spec.labels is None:
            preds = [STSB_FALLBACK if p is None else p for p in parsed]
        else:
            preds = [_wrong(g, len(self.spec.label_words)) if p is None else p for g, p in zip(golds, parsed)]
        result: dict = {name: _METRICS[name](golds, preds) for name in self.spec.metric_names}
        undefined = [name for name, value in result.items() if not math.isfinite(value)]
        if undefined:
            result.update(dict.fromkeys(undefined, None))
            result["undefined"] = f"{', '.join(undefined)}: a gold or predicted score is not a finite number"
        subsets = sorted({e["subset"] for e in examples if e.get("subset")})
        for subset in subsets:
            pairs = [(g, p) for g, p, e in zip(golds, preds, examples) if e.get("subset") == subset]
            result[f"accuracy_{subset}"] = metrics.accuracy([g for g, _ in pairs], [p for _, p in pairs])
        result["unparsed"] = unparsed
        result["n"] = len(examples)
        return result


def _check_score(value: float, where: str, column: str) -> None:
    """A gold similarity score must be a finite number: a NaN would make every correlation undefined."""
    if not math.isfinite(value):
        raise TaskDataError(f"{where}: gold {column} {value!r} is not a finite number; expected 0 to 5")


def _wrong(gold: int, num_labels: int) -> int:
    """A label that is not ``gold``: the other class for binary tasks (so F1/MCC count it), else -1."""
    return 1 - gold if num_labels == 2 else -1


_METRICS = {
    "accuracy": metrics.accuracy,
    "f1": metrics.f1_binary,
    "matthews_correlation": metrics.matthews_corrcoef,
    "pearson": metrics.pearson,
    "spearman": metrics.spearman,
}
