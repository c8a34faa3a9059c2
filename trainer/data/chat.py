"""Chat records: find a record's turns, render them with a chat template, learn the assistant turns only.

A record holds its turns in ``data.messages_field`` (OpenAI style, ``{"role", "content"}``) or in
ShareGPT's ``conversations`` (``{"from", "value"}``); both become one list of ``{"role", "content"}``
dicts. The whole conversation is rendered once by the chat template and tokenized once; the labels
keep the tokens of each assistant turn (its content and the template's end-of-turn marker, so the
model learns to stop) and are ``IGNORE`` everywhere else.

Where an assistant turn sits in the text is found by rendering prefixes of the conversation, as TRL
and torchtune do, so any template works that renders a conversation as its earlier turns followed by
the later ones ("prefix-stable"): turn k spans from the end of ``render(turns[:k],
add_generation_prompt=True)`` to the end of ``render(turns[:k + 1])``, less trailing whitespace (the
newline between turns is not learned). A template that is not prefix-stable is refused with
``ChatTemplateError``; a record that cannot train raises ``ChatSkip`` with the reason.

Nothing is added beyond what the template renders: no BOS, no EOS (``data.add_eos`` does not apply to
chat); a template that wants them writes ``{{ bos_token }}`` / ``{{ eos_token }}`` itself.

A batch of records goes through one ``ChatEncoder`` (the template compiled once, the batch's texts
tokenized together); ``encode_chat`` is the same for one conversation.

Torch-free: transformers' fast tokenizers and their Jinja renderer only.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError

IGNORE = -100  # the label of a token that is not learned (torch's cross-entropy ignore_index)

# ChatML, used when data.chat_template is null and the tokenizer has no chat_template. Each turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
# No BOS or EOS: for a tokenizer without ChatML's markers as special tokens they are ordinary text,
# and a model trained on it stops by writing "<|im_end|>".
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SHAREGPT_FIELD = "conversations"

# Role names as found in OpenAI-style and ShareGPT data, mapped to the four the templates know.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class ChatSkip(ValueError):
    """A chat record that cannot train; the message says why (e.g. "no assistant turn")."""


class ChatTemplateError(ValueError):
    """A chat template that cannot be used for training (every record would fail the same way)."""


def is_chat_record(record: dict, cfg) -> bool:
    """Whether a record looks like chat: a list under ``data.messages_field`` or ShareGPT's field."""
    return isinstance(record.get(cfg.messages_field), list) or isinstance(record.get(SHAREGPT_FIELD), list)


def find_messages(record: dict, cfg) -> list[dict] | None:
    """The record's turns as ``[{"role", "content"}, ...]``; None when it has no chat field at all.

    ``record[cfg.messages_field]`` is read first, then ShareGPT's ``conversations``; each turn may use
    ``role``/``content`` or ``from``/``value``. Raises ChatSkip for turns that cannot be read.
    """
    for name in (cfg.messages_field, SHAREGPT_FIELD):
        if name in record:
            return normalise_messages(record[name], name)
    return None


def normalise_messages(turns, name: str = "messages") -> list[dict]:
    """Checked copies of the turns as ``{"role", "content"}`` with the role mapped (see ROLES).

    Turns are numbered from 1 in the reasons ChatSkip gives.
    """
    if not isinstance(turns, list):
        raise ChatSkip(f"'{name}' must be a list of turns, got {_kind(turns)}")
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise ChatSkip(f"turn {number}: must be an object with 'role' and 'content', got {_kind(turn)}")
        role_key, content_key = (
            ("role", "content") if "role" in turn or "from" not in turn else ("from", "value")
        )
        if role_key not in turn:
            raise ChatSkip(f"turn {number}: no 'role' (or ShareGPT's 'from')")
        role = turn[role_key]
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise ChatSkip(
                f"turn {number}: unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})"
            )
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise ChatSkip(f"turn {number}: '{content_key}' must be a string, got {_kind(content)}")
        messages.append({"role": ROLES[role.lower()], "content": content})
    return messages


def resolve_template(tokenizer, cfg) -> str:
    """The Jinja template chat records are rendered with.

    ``data.chat_template`` (the contents of the file it names, else the string itself), else the
    tokenizer's own ``chat_template``, else DEFAULT_CHAT_TEMPLATE.
    """
    given = cfg.chat_template
    if given is not None:
        path = Path(given).expanduser()
        try:
            is_file = path.is_file()
        except (OSError, ValueError):  # a long template string, or one with a NUL, is no valid path
            is_file = False
        if is_file:
            return path.read_text(encoding="utf-8")
        if "{{" not in given and "{%" not in given:
            raise ChatTemplateError(
                f"data.chat_template {given!r} is neither an existing file nor a Jinja template "
                "(no '{{' or '{%' in it)"
            )
        return given
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.get_chat_template()  # picks "default" where a tokenizer has several
    return DEFAULT_CHAT_TEMPLATE


def encode_chat(messages: list, tokenizer, cfg, template: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids and labels of one conversation; labels are IGNORE except on the assistant turns.

    ``cfg.system_prompt`` becomes a first system turn when the conversation has no system turn.
    Every assistant turn is learned except one that opens the conversation (it answers nothing, and
    no template can render the empty prompt before it). ``template`` defaults to
    ``resolve_template(tokenizer, cfg)``; pass it in to resolve it once. Raises ChatSkip for a record
    that cannot train, ChatTemplateError for a template that cannot be used, ValueError for a slow
    tokenizer (no character offsets). Many conversations are encoded faster by one ChatEncoder.
    """
    (result,) = ChatEncoder(tokenizer, cfg, template).encode([normalise_messages(messages)])
    if isinstance(result, ChatSkip):
        raise result
    ids, target = result
    return ids, [token if learned else IGNORE for token, learned in zip(ids, target)]


def encode_chat_record(
    record: dict, tokenizer, cfg, template: str | None = None
) -> tuple[list[int], list[int]]:
    """``encode_chat`` of a record's turns; ChatSkip when the record has no chat field."""
    messages = find_messages(record, cfg)
    if messages is None:
        raise ChatSkip(f"no '{cfg.messages_field}' (or ShareGPT's '{SHAREGPT_FIELD}') list")
    return encode_chat(messages, tokenizer, cfg, template)


class ChatEncoder:
    """``encode_chat`` for a batch of conversations, with the template compiled once.

    What ``apply_chat_template`` spends on each call (copying and checking the messages, a fresh
    Jinja context for its arguments) outweighs rendering a short conversation, and a conversation
    takes one rendering per prefix. So the template is compiled once by transformers' own compiler
    (the same sandbox, ``raise_exception``, ``tojson``, ``strftime_now`` and ``{% generation %}``)
    and rendered with the variables ``apply_chat_template`` passes, and a batch's texts are tokenized
    by one call of the Rust tokenizer. Where that would not give what the tokenizer's own methods
    give (a tokenizer class with its own ``apply_chat_template`` or encoding, truncation or padding
    set on the Rust tokenizer), those methods are called instead: ``compiled`` is None where
    ``apply_chat_template`` renders. Picklable: a worker process compiles the template again.
    """

    def __init__(self, tokenizer, cfg, template: str | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"chat data needs a fast tokenizer (character offsets for the assistant mask); "
                f"{type(tokenizer).__name__} is not one (load it with use_fast=True, or convert it with tokenizers)"
            )
        self.tokenizer, self.system_prompt = tokenizer, cfg.system_prompt
        self.template = resolve_template(tokenizer, cfg) if template is None else template
        self._compile()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("compiled", "_variables")}

    def __setstate__(self, state: dict):
        self.__dict__.update(state)
        self._compile()

    def encode(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[bool]] | ChatSkip]:
        """Per conversation (turns as ``normalise_messages`` gives them), its token ids and which of them
        are learned, or the ChatSkip saying why it cannot train. Raises ChatTemplateError for a template
        that cannot be used."""
        results, texts, spans = [], [], []
        for messages in conversations:
            try:
                text, turn_spans = self._locate(messages)
            except ChatSkip as exc:
                results.append(exc)
                continue
            results.append(None)
            texts.append(text)
            spans.append(turn_spans)
        marked = iter([_mark(ids, offsets, s) for (ids, offsets), s in zip(self._tokenize(texts), spans)])
        return [next(marked) if result is None else result for result in results]

    def _locate(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each learned assistant turn in it."""
        inserted = self.system_prompt is not None and not any(m["role"] == "system" for m in messages)
        if inserted:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        learned = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0]
        if not learned:
            opens = messages and messages[0]["role"] == "assistant"
            raise ChatSkip("no assistant turn after the first turn" if opens else "no assistant turn")

        text = self._render(messages)
        spans = []
        for k in learned:
            start = self._prefix(messages[:k], text, k, generation=True)
            # Rendering the whole conversation again would give the text itself.
            last = k + 1 == len(messages)
            end = len(text) if last else self._prefix(messages[: k + 1], text, k, generation=False)
            while end > start and text[end - 1].isspace():
                end -= 1
            if end <= start:  # e.g. empty content under a template without an end-of-turn marker
                raise ChatSkip(
                    f"turn {k + 1 - inserted}: the template renders nothing to learn for this assistant turn"
                )
            spans.append((start, end))
        return text, spans

    def _compile(self):
        """The compiled template and its variables, where rendering it gives what apply_chat_template gives."""
        self.compiled = None
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # a private helper, which another transformers may lack
            return
        if (
            getattr(type(self.tokenizer), "apply_chat_template", None)
            is not PreTrainedTokenizerBase.apply_chat_template
        ):
            return
        try:
            self.compiled = _compile_jinja_template(self.template)
        except TemplateSyntaxError as exc:
            raise _syntax_error(exc) from exc
        # What the template sees besides the messages: its globals and what apply_chat_template passes (no
        # tools, documents or extra kwargs here), merged once rather than by each Template.render.
        self._variables = {
            **self.compiled.globals,
            "tools": None,
            "documents": None,
            **self.tokenizer.special_tokens_map,
        }

    def _render(self, messages: list[dict], generation: bool = False) -> str:
        try:
            if self.compiled is None:
                return self.tokenizer.apply_chat_template(
                    messages, tokenize=False, chat_template=self.template, add_generation_prompt=generation
                )
            variables = {**self._variables, "messages": messages, "add_generation_prompt": generation}
            context = self.compiled.new_context(variables, shared=True)  # shared: the globals are in it
            try:
                return "".join(self.compiled.root_render_func(context))  # Template.render's own steps
            except Exception:
                self.compiled.environment.handle_exception()  # as Template.render: the template's line
        except TemplateSyntaxError as exc:
            raise _syntax_error(exc) from exc
        except TemplateError as exc:  # the template's raise_exception(), e.g. "roles must alternate"
            raise ChatSkip(f"the chat template refused the conversation: {exc}") from exc

    def _prefix(self, messages: list[dict], text: str, k: int, generation: bool) -> int:
        """The length of the rendered prefix, which must be the start of the whole conversation's text."""
        rendered = self._render(messages, generation)
        if not text.startswith(rendered):
            what = f"turns 1-{k} with the generation prompt" if generation else f"turns 1-{k + 1}"
            raise ChatTemplateError(
                f"the chat template is not prefix-stable: its rendering of {what} is not the start of its rendering "
                "of the whole conversation, so the assistant turns cannot be located for the loss mask "
                "(set data.chat_template to a template that renders each turn the same whatever follows it)"
            )
        return len(rendered)

    def _tokenize(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Token ids and character offsets of each text, without special tokens added."""
        if not texts:
            return []
        backend = _direct_backend(self.tokenizer)
        if backend is not None:
            return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
        out = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(out["input_ids"], out["offset_mapping"]))


def _direct_backend(tokenizer):
    """The Rust tokenizer, where encoding with it gives what the tokenizer's own call gives; else None.

    Read at each batch: a call with truncation or padding leaves them set on the Rust tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    # A class with its own encoding (e.g. CodeLlama's infilling on <FILL_ME>) must be called.
    return (
        backend if getattr(type(tokenizer), "_encode_plus", None) is TokenizersBackend._encode_plus else None
    )


def _mark(ids: list[int], offsets, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """The ids and, per token, whether it is learned: whether its first character is in a span."""
    target = [False] * len(ids)
    span, (start, end) = 0, spans[0]
    for i, (token_start, token_end) in enumerate(offsets):
        while token_start >= end:
            span += 1
            if span == len(spans):
                return ids, target
            start, end = spans[span]
        # A token belongs to the turn its first character is in; empty offsets belong to no turn.
        if token_end > token_start and token_start >= start:
            target[i] = True
    return ids, target


def _syntax_error(exc: TemplateSyntaxError) -> ChatTemplateError:
    return ChatTemplateError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})")


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
