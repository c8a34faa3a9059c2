"""Chat records: turns found and normalised, rendered by a template, only assistant turns learned.

The masks are checked turn by turn against the rendered text: the learned tokens of each assistant
turn decode to its content plus the template's end-of-turn marker, and what is masked decodes to the
rest of the conversation.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from tests.helpers import REPO
from trainer.config import DataConfig
from trainer.data.chat import (
    DEFAULT_CHAT_TEMPLATE,
    IGNORE,
    ChatEncoder,
    ChatSkip,
    ChatTemplateError,
    encode_chat,
    encode_chat_record,
    find_messages,
    is_chat_record,
    normalise_messages,
    resolve_template,
)
from trainer.data.records import Encoder

END = "<|im_end|>"
TWO_ANSWERS = [
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Five."},
    {"role": "user", "content": "And what does a (baker) make?"},
    {"role": "assistant", "content": "A baker makes bread, of course."},
]
# A Llama-like template with the tokenizer's EOS (a special token) as the end-of-turn marker.
EOS_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def load_tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "configs" / "tiny-moe")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def learned_runs(ids, labels) -> list[list[int]]:
    """The learned tokens, one list per contiguous run (one run per assistant turn)."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token  # labels are the ids themselves; the model shifts them
            current.append(token)
    return runs + ([current] if current else [])


def masked_text(tokenizer, ids, labels) -> str:
    return decode(tokenizer, [t for t, label in zip(ids, labels) if label == IGNORE])


def test_default_template_learns_each_assistant_turn_and_its_end_marker(tokenizer):
    ids, labels = encode_chat(TWO_ANSWERS, tokenizer, DataConfig())
    rendered = tokenizer.apply_chat_template(TWO_ANSWERS, tokenize=False, chat_template=DEFAULT_CHAT_TEMPLATE)
    assert decode(tokenizer, ids) == rendered  # nothing added beyond the template: no BOS, no EOS
    assert rendered.startswith("<|im_start|>user\nWhat is two plus three?<|im_end|>\n<|im_start|>assistant\n")

    runs = learned_runs(ids, labels)
    assert [decode(tokenizer, run) for run in runs] == [
        "Five." + END,
        "A baker makes bread, of course." + END,
    ]
    masked = masked_text(tokenizer, ids, labels)
    assert masked == (
        "<|im_start|>user\nWhat is two plus three?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nAnd what does a (baker) make?<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_offsets_are_characters_so_non_ascii_turns_are_masked_exactly(tokenizer):
    messages = [
        {"role": "user", "content": "Où est le café? 😀"},
        {"role": "assistant", "content": "Dans la rue – naïve 😀 ünïcode."},
    ]
    ids, labels = encode_chat(messages, tokenizer, DataConfig())
    assert [decode(tokenizer, run) for run in learned_runs(ids, labels)] == [messages[1]["content"] + END]
    assert "Où est le café? 😀" in masked_text(tokenizer, ids, labels)


def test_an_assistant_turn_that_renders_as_nothing_is_skipped(tokenizer):
    bare = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "Q"}]
    with pytest.raises(ChatSkip, match="^turn 3: the template renders nothing to learn"):
        encode_chat(
            [*messages, {"role": "assistant", "content": ""}], tokenizer, DataConfig(chat_template=bare)
        )


def test_sharegpt_turns_are_mapped_to_roles_and_encode_like_openai_style(tokenizer):
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is two plus three?"},
            {"from": "gpt", "value": "Five."},
            {"from": "user", "value": "And four plus one?"},
            {"from": "chatgpt", "value": "Five."},
            {"from": "function", "value": "{}"},
            {"from": "observation", "value": "ok"},
            {"from": "tool", "value": "ok"},
            {"from": "bing", "value": "Done."},
            {"from": "bard", "value": "Done."},
            {"from": "assistant", "value": "Done."},
        ]
    }
    cfg = DataConfig()
    messages = find_messages(record, cfg)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"] + [
        "tool"
    ] * 3 + ["assistant"] * 3
    assert messages[1] == {"role": "user", "content": "What is two plus three?"}
    assert is_chat_record(record, cfg)
    assert encode_chat_record(record, tokenizer, cfg) == encode_chat_record(
        {"messages": messages}, tokenizer, cfg
    )


def test_messages_field_is_configurable_and_non_chat_records_are_recognised(tokenizer):
    cfg = DataConfig(messages_field="dialog")
    record = {"dialog": TWO_ANSWERS, "messages": "ignored"}
    assert is_chat_record(record, cfg) and find_messages(record, cfg) == TWO_ANSWERS
    assert not is_chat_record({"text": "hello"}, DataConfig())
    assert find_messages({"text": "hello"}, DataConfig()) is None
    with pytest.raises(ChatSkip, match="no 'messages' .* list"):
        encode_chat_record({"text": "hello"}, tokenizer, DataConfig())


def test_system_prompt_is_inserted_only_where_the_record_has_no_system_turn(tokenizer):
    cfg = DataConfig(system_prompt="Answer in one word.")
    ids, labels = encode_chat(TWO_ANSWERS, tokenizer, cfg)
    assert decode(tokenizer, ids).startswith(
        "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user"
    )
    assert masked_text(tokenizer, ids, labels).startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
    assert len(learned_runs(ids, labels)) == 2

    own = [{"role": "system", "content": "Be kind."}, *TWO_ANSWERS]
    ids, labels = encode_chat(own, tokenizer, cfg)
    assert "Answer in one word." not in decode(tokenizer, ids)
    assert decode(tokenizer, ids).startswith("<|im_start|>system\nBe kind.<|im_end|>\n")
    assert [decode(tokenizer, run) for run in learned_runs(ids, labels)][0] == "Five." + END


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": [{"role": "user", "content": "Hello?"}]}, "^no assistant turn$"),
        ({"messages": []}, "^no assistant turn$"),
        ({"messages": [{"role": "assistant", "content": "Hi."}]}, "^no assistant turn after the first turn$"),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
            "^turn 2: 'content' must be a string, got null$",
        ),
        (
            {"conversations": [{"from": "human", "value": ["a", "list"]}]},
            "^turn 1: 'value' must be a string, got list$",
        ),
        ({"messages": [{"role": "narrator", "content": "Once."}]}, "^turn 1: unknown role 'narrator'"),
        ({"messages": [{"content": "Once."}]}, "^turn 1: no 'role'"),
        ({"messages": ["Hi"]}, "^turn 1: must be an object"),
        ({"messages": {"role": "user"}}, "^'messages' must be a list of turns, got dict$"),
    ],
)
def test_records_that_cannot_train_are_skipped_with_their_reason(tokenizer, record, reason):
    with pytest.raises(ChatSkip, match=reason):
        encode_chat_record(record, tokenizer, DataConfig())


def test_an_opening_assistant_turn_is_context_and_later_ones_are_learned(tokenizer):
    messages = [{"role": "assistant", "content": "Hello, ask me."}, *TWO_ANSWERS]
    ids, labels = encode_chat(messages, tokenizer, DataConfig())
    assert [decode(tokenizer, run) for run in learned_runs(ids, labels)] == [
        "Five." + END,
        "A baker makes bread, of course." + END,
    ]
    assert "Hello, ask me." in masked_text(tokenizer, ids, labels)


def test_custom_template_string_with_a_special_end_token(tokenizer):
    cfg = DataConfig(chat_template=EOS_TEMPLATE)
    assert resolve_template(tokenizer, cfg) == EOS_TEMPLATE
    ids, labels = encode_chat(TWO_ANSWERS, tokenizer, cfg, resolve_template(tokenizer, cfg))
    assert decode(tokenizer, ids).startswith(
        "### user:\nWhat is two plus three?</s>\n### assistant:\nFive.</s>\n"
    )
    runs = learned_runs(ids, labels)
    assert [decode(tokenizer, run) for run in runs] == ["Five.</s>", "A baker makes bread, of course.</s>"]
    assert all(run[-1] == tokenizer.eos_token_id for run in runs)  # the model learns to emit EOS
    assert ids.count(tokenizer.eos_token_id) == 4  # one per turn, as rendered; none added


def test_template_from_a_file(tokenizer, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(EOS_TEMPLATE)
    cfg = DataConfig(chat_template=str(path))
    assert resolve_template(tokenizer, cfg) == EOS_TEMPLATE
    assert encode_chat(TWO_ANSWERS, tokenizer, cfg) == encode_chat(
        TWO_ANSWERS, tokenizer, DataConfig(chat_template=EOS_TEMPLATE)
    )


def test_a_missing_template_file_is_not_taken_for_a_template(tokenizer, tmp_path):
    with pytest.raises(ChatTemplateError, match="neither an existing file nor a Jinja template"):
        resolve_template(tokenizer, DataConfig(chat_template=str(tmp_path / "missing.jinja")))


def test_the_tokenizer_own_template_is_used_unless_the_config_names_one():
    tokenizer = load_tokenizer()
    assert resolve_template(tokenizer, DataConfig()) == DEFAULT_CHAT_TEMPLATE
    tokenizer.chat_template = EOS_TEMPLATE
    assert resolve_template(tokenizer, DataConfig()) == EOS_TEMPLATE
    ids, labels = encode_chat(TWO_ANSWERS, tokenizer, DataConfig())
    assert [decode(tokenizer, run) for run in learned_runs(ids, labels)][0] == "Five.</s>"
    assert (
        resolve_template(tokenizer, DataConfig(chat_template=DEFAULT_CHAT_TEMPLATE)) == DEFAULT_CHAT_TEMPLATE
    )


def test_a_template_that_is_not_prefix_stable_is_refused(tokenizer):
    # The last turn is rendered differently, so a conversation's start depends on what follows it.
    unstable = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        encode_chat(TWO_ANSWERS, tokenizer, DataConfig(chat_template=unstable))


def test_template_errors_a_template_raises_skip_the_record_and_bad_jinja_is_refused(tokenizer):
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
    )
    strict += DEFAULT_CHAT_TEMPLATE
    assert encode_chat(TWO_ANSWERS, tokenizer, DataConfig(chat_template=strict))
    with pytest.raises(ChatSkip, match="refused the conversation: first turn must be user"):
        encode_chat(TWO_ANSWERS, tokenizer, DataConfig(chat_template=strict, system_prompt="Hi."))
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        encode_chat(TWO_ANSWERS, tokenizer, DataConfig(chat_template="{% for m in messages %}"))


def test_a_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="needs a fast tokenizer"):
        encode_chat(TWO_ANSWERS, Slow(), DataConfig())


def test_the_shipped_sample_trains_but_for_its_two_records_without_an_answer(tokenizer):
    cfg = DataConfig()
    template = resolve_template(tokenizer, cfg)
    records = [json.loads(line) for line in (REPO / "data" / "tiny_chat.jsonl").read_text().splitlines()]
    skipped, learned_turns = [], 0
    for number, record in enumerate(records, start=1):
        assert is_chat_record(record, cfg)
        try:
            ids, labels = encode_chat_record(record, tokenizer, cfg, template)
        except ChatSkip as exc:
            skipped.append((number, str(exc)))
            continue
        answers = [m["content"] + END for m in find_messages(record, cfg) if m["role"] == "assistant"]
        assert [decode(tokenizer, run) for run in learned_runs(ids, labels)] == answers
        learned_turns += len(answers)
    assert skipped == [(58, "no assistant turn"), (144, "no assistant turn")]
    assert sum("conversations" in r for r in records) >= 10
    assert learned_turns > len(records)  # multi-turn records are in it


# Templates unlike ChatML, for checking the compiled template against apply_chat_template.
# A default system prompt, and raise_exception() for roles that do not alternate (Llama-2 / Mistral).
SYSTEM_DEFAULT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set turns = messages %}{%- endif %}"
    "{{- '[SYS] ' + system + ' [/SYS]\\n' }}"
    "{%- for message in turns %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token + '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
# Llama-3: BOS (a special token) from the template's variables, assistant turns in {% generation %}.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Zephyr: the generation prompt inside the loop on its last turn; contents through transformers' tojson.
LOOP_LAST_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] | tojson + eos_token + '\\n' }}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)
# Beside the shipped sample: an opening assistant turn, roles out of turn, markup and non-ASCII, an
# empty answer.
EXTRA_RECORDS = [
    {
        "messages": [
            {"role": "assistant", "content": "Hello, ask me."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "How can I help?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": "Anyone?"},
            {"role": "assistant", "content": "Yes."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": 'Use <b>tags</b> & "quotes".'},
            {"role": "user", "content": "Is 1 < 2? Où est le café 😀"},
            {"role": "assistant", "content": "  Yes – 1 < 2 & naïve ünïcode.  "},
            {"role": "user", "content": "Say nothing."},
            {"role": "assistant", "content": ""},
        ]
    },
]


def reference_encode(messages, tokenizer, cfg, template) -> tuple[list[int], list[int]]:
    """The plain way: apply_chat_template for the conversation and each prefix, one tokenizer call."""

    def render(turns, generation=False):
        try:
            return tokenizer.apply_chat_template(
                turns, tokenize=False, chat_template=template, add_generation_prompt=generation
            )
        except TemplateError as exc:
            raise ChatSkip(f"the chat template refused the conversation: {exc}") from exc

    messages = normalise_messages(messages)
    if cfg.system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    learned = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0]
    if not learned:
        raise ChatSkip("no assistant turn")
    text, spans = render(messages), []
    for k in learned:
        start, end = len(render(messages[:k], generation=True)), len(render(messages[: k + 1]))
        assert text.startswith(render(messages[: k + 1]))
        spans.append((start, len(text[:end].rstrip())))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if end > start and any(a <= start < b for a, b in spans) else IGNORE
        for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"])
    ]
    return encoding["input_ids"], labels


@pytest.mark.parametrize(
    ("template", "system_prompt"),
    [
        (DEFAULT_CHAT_TEMPLATE, None),
        (DEFAULT_CHAT_TEMPLATE, "Answer in one word."),
        (SYSTEM_DEFAULT_TEMPLATE, None),
        (LLAMA3_TEMPLATE, None),
        (LOOP_LAST_TEMPLATE, "Be brief."),
    ],
    ids=[
        "chatml",
        "chatml-system-prompt",
        "system-default-raise",
        "llama3-bos-generation",
        "loop-last-tojson",
    ],
)
def test_batches_encode_as_apply_chat_template_renders_each_record(tokenizer, template, system_prompt):
    cfg = DataConfig(chat_template=template, system_prompt=system_prompt)
    records = [json.loads(line) for line in (REPO / "data" / "tiny_chat.jsonl").read_text().splitlines()]
    records += EXTRA_RECORDS
    # As datasets' worker processes get it: pickled, the compiled template rebuilt on arrival.
    encoder = pickle.loads(pickle.dumps(Encoder(tokenizer, cfg, "chat")))
    assert encoder.chat.compiled is not None  # the fast path, not apply_chat_template

    skipped = []
    for record, got in zip(records, encoder.encode(records), strict=True):
        messages = find_messages(record, cfg)
        try:
            ids, labels = reference_encode(messages, tokenizer, cfg, template)
        except ChatSkip as exc:
            assert (got.ids, got.why) == (None, str(exc))
            skipped.append(got.why)
            continue
        assert got.ids == ids
        assert got.target == [label != IGNORE for label in labels]
        assert encode_chat(messages, tokenizer, cfg, template) == (ids, labels)
    assert skipped.count("no assistant turn") == 2
    # raise_exception(): the opening assistant turn and the roles out of turn
    refused = [why for why in skipped if why.startswith("the chat template refused the conversation")]
    assert len(refused) == (2 if template == SYSTEM_DEFAULT_TEMPLATE else 0)


def test_a_tokenizer_of_no_transformers_class_renders_through_its_own_apply_chat_template(tokenizer):
    class Wrapped:  # fast, but nothing of it is known beyond its methods: no backend_tokenizer
        is_fast, chat_template = True, None

        def apply_chat_template(self, *args, **kwargs):
            return tokenizer.apply_chat_template(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

    cfg = DataConfig(chat_template=LLAMA3_TEMPLATE)
    assert ChatEncoder(Wrapped(), cfg).compiled is None
    assert encode_chat(TWO_ANSWERS, Wrapped(), cfg) == encode_chat(TWO_ANSWERS, tokenizer, cfg)
    assert encode_chat(TWO_ANSWERS, tokenizer, cfg) == reference_encode(
        TWO_ANSWERS, tokenizer, cfg, LLAMA3_TEMPLATE
    )


def test_chat_module_does_not_import_torch():
    code = "import sys, trainer.data.chat; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
