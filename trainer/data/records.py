"""From a record (one JSON object, TSV row or dataset row) to token ids and a target mask, in batches.

Formats: ``text`` (BOS + text + EOS, every token a target), ``instruction`` (prompt masked out of the loss),
``chat`` (``trainer.data.chat``: rendered with the chat template, loss on assistant turns). A record that
cannot train (a field missing or not a string, a chat with no assistant turn) is reported by ``why``.
"""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """Bad training data; the message starts with file:line."""


@dataclass
class Encoded:
    """One record's tokens, or why it was skipped. Targets: every token after the first ``masked`` ones
    (text: all; instruction: the response), and where ``target`` is given (chat) only those it marks."""

    ids: list[int] | None
    masked: int = 0
    target: list[bool] | None = None
    why: str | None = None


def chat_messages_key(record: dict, cfg) -> bool:
    from trainer.data.chat import is_chat_record

    return is_chat_record(record, cfg)


def detect_format(first: dict | None, cfg, source: str) -> str:
    """The format the config names, or the one the first record's fields say; a needed field must be there."""
    if cfg.format != "auto":
        fmt = cfg.format
    elif first is not None and chat_messages_key(first, cfg):
        fmt = "chat"
    elif first is not None and cfg.prompt_field in first and cfg.response_field in first:
        fmt = "instruction"
    else:
        fmt = "text"
    if fmt == "chat":
        if first is not None and not chat_messages_key(first, cfg):
            raise DataError(
                f"{source}:1: field '{cfg.messages_field}' missing (data.format is chat; set data.messages_field?)"
            )
        return fmt
    needed = (cfg.text_field,) if fmt == "text" else (cfg.prompt_field, cfg.response_field)
    for key in needed:
        if first is not None and key not in first:
            raise DataError(
                f"{source}:1: field '{key}' missing (data.format is {fmt}; set data.{fmt}_field?)"
            )
    return fmt


class Encoder:
    """Encodes batches of records for one format; picklable, so ``datasets``' worker processes get a copy."""

    def __init__(self, tokenizer, cfg, fmt: str):
        self.tokenizer, self.cfg, self.fmt = tokenizer, cfg, fmt
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if cfg.add_eos and tokenizer.eos_token_id is not None else []
        self.chat = None
        if fmt == "chat":
            from trainer.data.chat import ChatEncoder, ChatTemplateError

            try:
                self.chat = ChatEncoder(tokenizer, cfg)
            except ChatTemplateError as exc:
                raise DataError(f"data.chat_template: {exc}") from exc

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Batch encoding; straight through the Rust tokenizer when transformers' call would add nothing
        (no truncation or padding configured), which halves the cost of a batch (no per-token dicts)."""
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def encode(self, records: list[dict]) -> list[Encoded]:
        if self.fmt == "text":
            return self._text(records)
        if self.fmt == "instruction":
            return self._instruction(records)
        return self._chat(records)

    def _text(self, records: list[dict]) -> list[Encoded]:
        field = self.cfg.text_field
        good = [i for i, r in enumerate(records) if isinstance(r.get(field), str)]
        out = [Encoded(None, why=f"field '{field}' must be a string")] * len(records)
        for i, ids in zip(good, self._encode([records[i][field] for i in good])):
            out[i] = Encoded(self.bos + ids + self.eos)
        return out

    def _instruction(self, records: list[dict]) -> list[Encoded]:
        p, r = self.cfg.prompt_field, self.cfg.response_field
        good = [
            i for i, rec in enumerate(records) if isinstance(rec.get(p), str) and isinstance(rec.get(r), str)
        ]
        out = [Encoded(None, why=f"fields '{p}' and '{r}' must be strings")] * len(records)
        prompts = self._encode([records[i][p] for i in good])
        responses = self._encode([records[i][r] for i in good])
        for i, prompt, response in zip(good, prompts, responses):
            prompt_ids, response_ids = self.bos + prompt, response + self.eos
            out[i] = Encoded(prompt_ids + response_ids, masked=len(prompt_ids))
        return out

    def _chat(self, records: list[dict]) -> list[Encoded]:
        """The batch's conversations rendered one by one and tokenized together (``ChatEncoder``)."""
        from trainer.data.chat import ChatSkip, ChatTemplateError, find_messages

        out, conversations, where = [None] * len(records), [], []
        for i, record in enumerate(records):
            try:
                messages = find_messages(record, self.cfg)
            except ChatSkip as exc:
                out[i] = Encoded(None, why=str(exc))
                continue
            if messages is None:
                out[i] = Encoded(None, why=f"field '{self.cfg.messages_field}' missing")
                continue
            conversations.append(messages)
            where.append(i)
        try:
            results = self.chat.encode(conversations)
        except ChatTemplateError as exc:  # the template, not the record: every record would fail
            raise DataError(f"data.chat_template: {exc}") from exc
        for i, result in zip(where, results):
            if isinstance(result, ChatSkip):
                out[i] = Encoded(None, why=str(result))
            else:
                ids, target = result
                out[i] = Encoded(ids, target=target)
        return out
