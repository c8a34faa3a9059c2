"""GLUE as text generation: metrics against scikit-learn/scipy, TSV loading in GLUE's layout, parsing, scoring."""

from __future__ import annotations

import math
import random

import pytest
import scipy.stats
import sklearn.metrics

from trainer.tasks import GLUE_TASKS, TaskDataError, get_task, metrics
from trainer.tasks.glue import STSB_FALLBACK, parse_label, parse_score

# -- metrics -------------------------------------------------------------------------------------

_rng = random.Random(0)
BINARY_CASES = [
    ([1, 0, 1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 1, 1, 1]),
    ([0, 0, 0, 1], [1, 1, 1, 1]),
    ([1, 1, 0, 0], [0, 0, 1, 1]),  # all wrong
    ([0, 0, 0, 0], [0, 0, 0, 0]),  # no positives at all: F1 0 (sklearn's zero_division), MCC 0
    ([1, 0, 1, 0, 1], [1, 1, 1, 1, 1]),  # constant prediction: MCC 0
    *[([_rng.randint(0, 1) for _ in range(50)], [_rng.randint(0, 1) for _ in range(50)]) for _ in range(5)],
]
MULTICLASS_CASES = [
    ([0, 1, 2, 2, 1, 0, 2], [0, 2, 2, 2, 1, 1, 0]),
    ([0, 1, 2, 0], [-1, 1, -1, 0]),  # -1: an unparsed answer, never equal to a gold label
    *[([_rng.randint(0, 2) for _ in range(40)], [_rng.randint(0, 2) for _ in range(40)]) for _ in range(3)],
]
REAL_CASES = [
    ([0.0, 1.2, 3.4, 3.4, 5.0, 2.2], [0.5, 1.0, 3.0, 4.0, 4.5, 2.5]),
    ([1, 2, 2, 2, 3, 4], [2, 2, 1, 3, 3, 3]),  # ties on both sides
    ([5, 4, 3, 2, 1], [1, 2, 3, 4, 5]),
    *[
        (
            [round(_rng.uniform(0, 5), 1) for _ in range(30)],
            [_rng.choice([0, 1, 2.5, 4, 5]) for _ in range(30)],
        )
        for _ in range(3)
    ],
]


@pytest.mark.filterwarnings("ignore:A single label was found")
@pytest.mark.parametrize("golds, preds", BINARY_CASES + MULTICLASS_CASES)
def test_accuracy_and_matthews_match_sklearn(golds, preds):
    assert metrics.accuracy(golds, preds) == pytest.approx(sklearn.metrics.accuracy_score(golds, preds))
    assert metrics.matthews_corrcoef(golds, preds) == pytest.approx(
        sklearn.metrics.matthews_corrcoef(golds, preds)
    )


@pytest.mark.parametrize("golds, preds", BINARY_CASES)
def test_f1_matches_sklearn(golds, preds):
    expected = sklearn.metrics.f1_score(golds, preds, pos_label=1, zero_division=0)
    assert metrics.f1_binary(golds, preds) == pytest.approx(expected)


@pytest.mark.parametrize("xs, ys", REAL_CASES)
def test_correlations_match_scipy(xs, ys):
    assert metrics.pearson(xs, ys) == pytest.approx(scipy.stats.pearsonr(xs, ys)[0])
    assert metrics.spearman(xs, ys) == pytest.approx(scipy.stats.spearmanr(xs, ys)[0])
    assert metrics.average_ranks(xs) == pytest.approx(list(scipy.stats.rankdata(xs)))


def test_undefined_correlation_is_zero_not_nan():
    # scipy returns NaN for a constant input; 0.0 keeps best-checkpoint comparisons well-defined.
    assert metrics.pearson([2.5, 2.5, 2.5], [1.0, 2.0, 3.0]) == 0.0
    assert metrics.spearman([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]) == 0.0


def test_correlation_over_a_non_finite_value_is_undefined_not_perfect():
    # max(-1, min(1, nan)) is 1.0: a NaN anywhere used to read as a perfect correlation.
    for xs, ys in [([math.nan, 1.0, 2.0], [1.0, 2.0, 3.0]), ([1.0, math.inf, 2.0], [1.0, 2.0, 3.0])]:
        assert math.isnan(metrics.pearson(xs, ys))
        assert math.isnan(metrics.spearman(ys, xs))
    assert math.isnan(metrics.pearson([1e200, 1.0, 2.0], [1.0, 2.0, 3.0]))  # squares overflow


def test_metrics_refuse_misaligned_inputs():
    with pytest.raises(ValueError, match="differ in length"):
        metrics.accuracy([1, 0], [1])


# -- GLUE files in the published layout ------------------------------------------------------------

MNLI_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
    "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
)


def mnli_row(i, premise, hypothesis, gold):
    return f"{i}\t{i}\t{i}e\tfiction\t( x )\t( y )\t(ROOT x)\t(ROOT y)\t{premise}\t{hypothesis}\t{gold}\t\t\t\t\t{gold}"


GLUE_FILES = {
    # CoLA: no header; source, label, original judgement, sentence
    "CoLA/dev.tsv": [
        "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.",
        "gj04\t0\t*\tThey drank the pub.",
        "bc01\t1\t\tThe more we study verbs, the crazier they get.",
        "bc01\t0\t*\tmalformed row with a stray\ttab",
    ],
    "SST-2/dev.tsv": [
        "sentence\tlabel",
        "it 's a charming and often affecting journey . \t1",
        'the " best " film of the year , if you like " bad "\t0',
        "unflinchingly bleak and desperate \t0",
    ],
    "MRPC/dev.tsv": [
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
        "1\t1355540\t1355592\tHe said the foodservice pie business doesn 't fit.\tThe foodservice pie business does not fit.",
        '0\t2029631\t2029565\tMagnarelli said Racicot hated the Iraqi regime.\tHis wife said he was " 100 percent behind " it.',
    ],
    "QQP/dev.tsv": [
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
        "201359\t303345\t303346\tWhy are African-Americans so beautiful?\tWhy are hispanics so beautiful?\t0",
        "263843\t69383\t380476\tI want to pursue PhD in Computer Science?\tI handle social media for a non-profit.\t0",
        "172974\t267879\t267880\tIs there a reason why we should travel alone?\tWhat are some reasons to travel alone?\t1",
        "5\t6\t7\ta question cut short\t1",  # malformed: five fields
    ],
    "STS-B/dev.tsv": [
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
        "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing.\tA man wearing a hard hat is dancing.\t5.000",
        "1\tmain-captions\tMSRvid\t2012test\t0002\tnone\tnone\tA young child is riding a horse.\tA child is riding a horse.\t4.750",
        "2\tmain-captions\tMSRvid\t2012test\t0003\tnone\tnone\tA man is feeding a mouse to a snake.\tThe man is feeding a mouse to the snake.\t5.000",
        "3\tmain-captions\tMSRvid\t2012test\t0007\tnone\tnone\tA woman is playing the guitar.\tA man is playing guitar.\t2.400",
    ],
    "MNLI/dev_matched.tsv": [
        MNLI_HEADER,
        mnli_row(0, "The new rights are nice enough", "Everyone really likes the newest benefits", "neutral"),
        mnli_row(
            1,
            "This site includes a list of all award winners",
            "The Government Executive articles",
            "contradiction",
        ),
        mnli_row(2, "uh i don't know i i have mixed emotions", "I like him for the most part", "entailment"),
        mnli_row(3, "no agreement among annotators", "so no gold label", "-"),
    ],
    "MNLI/dev_mismatched.tsv": [
        MNLI_HEADER,
        mnli_row(
            0,
            "Your contribution helped make it possible",
            "Your contributions were of no help",
            "contradiction",
        ),
        mnli_row(
            1, "The answer has nothing to do with their cause", "Dictionaries are indeed exercises", "neutral"
        ),
    ],
    "QNLI/dev.tsv": [
        "index\tquestion\tsentence\tlabel",
        "0\tWhat came into force after the new constitution was herald?\tAs of that day, the new constitution came into force.\tentailment",
        "1\tWhat is the first major city in the stream of the Rhine?\tThe most important tributaries in this area are the Ill.\tnot_entailment",
    ],
    "RTE/dev.tsv": [
        "index\tsentence1\tsentence2\tlabel",
        "0\tDana Reeve, the widow of the actor, died at 44.\tChristopher Reeve had an accident.\tnot_entailment",
        "1\tYet, we now are discovering that antibiotics are losing their effectiveness.\tBacteria is winning the war.\tentailment",
    ],
    "WNLI/dev.tsv": [
        "index\tsentence1\tsentence2\tlabel",
        "0\tThe drain is clogged with hair. It has to be cleaned.\tThe hair has to be cleaned.\t0",
        "1\tJane knocked on Susan's door but she did not answer.\tSusan did not answer.\t1",
    ],
}
# task -> (examples in the validation split, rows skipped, gold labels)
EXPECTED = {
    "cola": (3, 1, [1, 0, 1]),
    "sst2": (3, 0, [1, 0, 0]),
    "mrpc": (2, 0, [1, 0]),
    "qqp": (3, 1, [0, 0, 1]),
    "stsb": (4, 0, [5.0, 4.75, 5.0, 2.4]),
    "mnli": (5, 1, [1, 2, 0, 2, 1]),
    "qnli": (2, 0, [0, 1]),
    "rte": (2, 0, [1, 0]),
    "wnli": (2, 0, [0, 1]),
}


@pytest.fixture()
def glue_dir(tmp_path):
    for name, lines in GLUE_FILES.items():
        path = tmp_path / "glue" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp_path / "glue"


def test_every_glue_task_is_covered():
    assert set(GLUE_TASKS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_local_tsv_loads_in_the_published_layout(glue_dir, name):
    task = get_task(name, glue_dir)
    examples = task.load("validation")
    count, skipped, labels = EXPECTED[name]
    assert len(examples) == count
    assert task.skipped_rows["validation"] == skipped
    assert [e["label"] for e in examples] == labels
    assert all(e["text_a"] for e in examples)
    # the gold answer round-trips through the parser
    assert [task.parse(task.target(e)) for e in examples] == labels
    # a perfect set of answers gets a perfect score on every metric
    perfect = task.score([task.target(e) for e in examples], examples)
    assert all(perfect[m] == pytest.approx(1.0) for m in task.spec.metric_names), perfect
    assert perfect["unparsed"] == 0 and perfect["n"] == count
    assert task.metric_for_best.name == task.spec.metric_names[0]


def test_text_keeps_glue_quote_characters_and_loses_the_bom(glue_dir):
    sst2 = get_task("sst2", glue_dir).load("validation")
    assert sst2[1]["text_a"] == 'the " best " film of the year , if you like " bad "'
    mrpc = get_task("mrpc", glue_dir).load("validation")
    assert mrpc[1]["text_b"] == 'His wife said he was " 100 percent behind " it.'


def test_a_task_folder_itself_works_as_data_dir(glue_dir):
    assert len(get_task("rte", glue_dir / "RTE").load("dev")) == 2


def test_prompts_name_the_texts_and_end_where_the_answer_starts(glue_dir):
    task = get_task("mnli", glue_dir)
    example = task.load("validation_mismatched")[0]
    assert example["subset"] == "mismatched"
    assert task.prompt(example) == (
        "Premise: Your contribution helped make it possible\n"
        "Hypothesis: Your contributions were of no help\n"
        "Does the premise entail the hypothesis? Answer entailment, neutral or contradiction.\n"
        "Answer:"
    )
    assert task.target(example) == " contradiction"
    assert task.record(example) == {"prompt": task.prompt(example), "completion": " contradiction"}
    cola = get_task("cola", glue_dir)
    assert cola.prompt(cola.load("validation")[1]).startswith("Sentence: They drank the pub.\n")


@pytest.mark.parametrize(
    "task, answer, label",
    [
        ("cola", " not acceptable", 0),
        ("cola", " The sentence is not grammatically acceptable.", 0),
        ("cola", " It isn't acceptable", 0),
        ("cola", " not unacceptable", 1),
        ("sst2", " not positive", 0),
        ("rte", " not entailment", 1),
        ("rte", " not_entailment", 1),
        ("rte", " entailment", 0),
        ("rte", " No", 1),
        ("qnli", " Not entailment.", 1),
        ("wnli", " not_entailment", 0),
        ("mrpc", " not equivalent", 0),
        ("mrpc", " equivalent", 1),
        ("mrpc", " no", 0),
        ("qqp", " not a duplicate", 0),
        ("qqp", " no, not a duplicate", 0),
        ("qqp", " yes, duplicates", 1),
        ("mnli", " not entailment", None),  # three labels: a negation names none of them
        ("mnli", " not entailment but neutral", 1),
    ],
)
def test_negated_label_words_read_as_the_other_label(task, answer, label):
    assert get_task(task).parse(answer) == label


def test_parse_label_takes_the_first_whole_label_word_in_any_case():
    words = ("unacceptable", "acceptable")
    assert parse_label(" Unacceptable.", words) == 0
    assert parse_label(" acceptable, not unacceptable", words) == 1
    assert parse_label(" it is UNACCEPTABLE", words) == 0  # 'acceptable' inside it does not count
    assert parse_label(" maybe", words) is None
    assert parse_label("", words) is None
    assert parse_label(" nope, yes", ("no", "yes")) == 1  # 'nope' is not the word 'no'


def test_unparsed_answers_are_wrong_and_counted(glue_dir):
    task = get_task("cola", glue_dir)
    examples = task.load("validation")  # gold 1, 0, 1
    answers = [" acceptable", " I am not sure", " unacceptable"]
    result = task.score(answers, examples)
    # the unparsed answer counts as the wrong label: predictions 1, 1, 0
    assert result["unparsed"] == 1
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert result["matthews_correlation"] == pytest.approx(
        sklearn.metrics.matthews_corrcoef([1, 0, 1], [1, 1, 0])
    )


def test_mrpc_and_qqp_report_f1_and_accuracy(glue_dir):
    task = get_task("qqp", glue_dir)
    examples = task.load("validation")  # gold 0, 0, 1
    result = task.score([" yes", " no", " yes"], examples)
    assert result["f1"] == pytest.approx(sklearn.metrics.f1_score([0, 0, 1], [1, 0, 1]))
    assert result["accuracy"] == pytest.approx(2 / 3)


def test_mnli_reports_matched_and_mismatched_accuracy(glue_dir):
    task = get_task("mnli", glue_dir)
    examples = task.load("validation")  # matched: 1, 2, 0; mismatched: 2, 1
    answers = [" neutral", " contradiction", " neutral", " Contradiction.", " entailment"]
    result = task.score(answers, examples)
    assert result["accuracy_matched"] == pytest.approx(2 / 3)
    assert result["accuracy_mismatched"] == pytest.approx(1 / 2)
    assert result["accuracy"] == pytest.approx(3 / 5)


def test_stsb_parses_numbers_robustly():
    assert parse_score(" 3.8") == 3.8
    assert parse_score(" about 4,5 out of 5") == 4.5
    assert parse_score(" .5") == 0.5
    assert parse_score(" Five.") == 5.0
    assert parse_score(" 7") == 5.0  # clamped to the scale
    assert parse_score(" -2") == 0.0
    assert parse_score(" no idea") is None
    assert parse_score("") is None


def test_stsb_scores_pearson_and_spearman_with_a_counted_fallback(glue_dir):
    task = get_task("stsb", glue_dir)
    examples = task.load("validation")  # 5.0, 4.75, 5.0, 2.4
    answers = [" 4.8", " 4", " no idea", " 1.5 or so"]
    result = task.score(answers, examples)
    preds = [4.8, 4.0, STSB_FALLBACK, 1.5]
    golds = [5.0, 4.75, 5.0, 2.4]
    assert result["unparsed"] == 1
    assert result["pearson"] == pytest.approx(scipy.stats.pearsonr(golds, preds)[0])
    assert result["spearman"] == pytest.approx(scipy.stats.spearmanr(golds, preds)[0])
    assert task.target(examples[1]) == " 4.75"


def test_an_undefined_correlation_is_reported_as_undefined(glue_dir):
    task = get_task("stsb", glue_dir)
    examples = [dict(e) for e in task.load("validation")]
    examples[0]["label"] = math.nan  # a gold file the loader would refuse, handed to score directly
    result = task.score([" 4.8", " 4", " 5", " 1.5"], examples)
    assert result["pearson"] is None and result["spearman"] is None
    assert result["undefined"].startswith("pearson, spearman: ")


@pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-inf"])
def test_a_non_finite_stsb_gold_score_is_refused_with_file_and_line(glue_dir, bad):
    path = glue_dir / "STS-B" / "dev.tsv"
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[3] = lines[3].rsplit("\t", 1)[0] + "\t" + bad
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TaskDataError) as error:
        get_task("stsb", glue_dir).load("validation")
    message = str(error.value)
    assert message.startswith(f"{path}:4: gold score ") and "not a finite number" in message
    assert "\n" not in message


def test_a_non_finite_stsb_gold_score_from_the_hub_is_refused(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [
        {"sentence1": "a", "sentence2": "b", "label": 3.0},
        {"sentence1": "c", "sentence2": "d", "label": math.nan},
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name, split: rows)
    with pytest.raises(
        TaskDataError, match=r"nyu-mll/glue stsb row 1: gold label nan is not a finite number"
    ):
        get_task("stsb").load("validation")


def test_missing_data_says_where_it_looked(tmp_path, glue_dir):
    with pytest.raises(TaskDataError, match=r"SST-2/dev.tsv"):
        get_task("sst2", tmp_path / "nowhere").load("validation")
    with pytest.raises(TaskDataError, match="dev_matched.tsv"):
        (glue_dir / "MNLI" / "dev_matched.tsv").unlink()
        get_task("mnli", glue_dir).load("validation")
    with pytest.raises(TaskDataError, match="test labels are not public"):
        get_task("rte", glue_dir).load("test")
    with pytest.raises(TaskDataError, match="unknown split"):
        get_task("rte", glue_dir).load("validation_matched")
    with pytest.raises(ValueError, match="unknown task"):
        get_task("squad")


def test_score_refuses_misaligned_predictions(glue_dir):
    task = get_task("rte", glue_dir)
    with pytest.raises(ValueError, match="1 predictions for 2 examples"):
        task.score([" yes"], task.load("validation"))


def test_hub_path_fails_clearly_when_offline(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TaskDataError, match=r"could not load GLUE from the Hub.*pass its folder as data_dir"):
        get_task("sst2").load("validation")


def test_hub_rows_map_to_the_same_examples(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name, split):
        calls.append((path, name, split))
        return [{"premise": f"p {split}", "hypothesis": "h", "label": 2, "idx": 0}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = get_task("mnli").load("validation")
    assert calls == [
        ("nyu-mll/glue", "mnli", "validation_matched"),
        ("nyu-mll/glue", "mnli", "validation_mismatched"),
    ]
    assert [(e["text_a"], e["text_b"], e["label"], e["subset"]) for e in examples] == [
        ("p validation_matched", "h", 2, "matched"),
        ("p validation_mismatched", "h", 2, "mismatched"),
    ]
