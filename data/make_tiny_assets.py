"""Regenerate the shipped tiny assets: a synthetic corpus, instruction pairs, chat records, offline tokenizers.

Everything the default run needs must exist without network access, so the corpus is generated
(no licence question) and the tokenizer is a byte-level BPE trained on it. The text has enough
structure (templated facts about made-up towns) that a tiny model's loss falls visibly in minutes.

    python data/make_tiny_assets.py          # rewrites data/*.jsonl and the tokenizer in configs/tiny-*/

The chat records come from their own random stream and stay out of the tokenizer's training text, so
adding them changed neither the corpus, the instructions nor the tokenizers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234

NAMES = ["Ada", "Boris", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Luca"]
TOWNS = ["Marlow", "Tessin", "Brava", "Quillon", "Odessa Bay", "Karst", "Velden", "Norrby", "Aubel", "Sintra"]
JOBS = ["baker", "weaver", "pilot", "teacher", "miller", "doctor", "painter", "smith", "farmer", "clerk"]
THINGS = ["bread", "cloth", "maps", "lessons", "flour", "medicine", "portraits", "tools", "apples", "letters"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "grey", "orange"]
WEATHER = ["rain", "snow", "sun", "fog", "wind"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def sentence(rng: random.Random) -> str:
    name, town, job = rng.choice(NAMES), rng.choice(TOWNS), rng.choice(JOBS)
    thing = THINGS[JOBS.index(job)]
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    templates = [
        f"{name} lives in {town} and works as a {job}.",
        f"Every morning the {job} of {town} makes {thing} for the market.",
        f"In {town} the houses are {rng.choice(COLOURS)} and the roofs are {rng.choice(COLOURS)}.",
        f"{name} counted {NUMBER_WORDS[a]} and {NUMBER_WORDS[b]} and got {NUMBER_WORDS[a + b]}.",
        f"When there is {rng.choice(WEATHER)} in {town}, {name} stays at home.",
        f"A {job} needs {thing}, and {name} knows it well.",
        f"The road from {town} to {rng.choice(TOWNS)} is long.",
    ]
    return rng.choice(templates)


def document(rng: random.Random) -> str:
    paragraphs = []
    for _ in range(rng.randint(1, 3)):
        paragraphs.append(" ".join(sentence(rng) for _ in range(rng.randint(2, 8))))
    return "\n\n".join(paragraphs)


def instruction(rng: random.Random) -> dict:
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    job = rng.choice(JOBS)
    choices = [
        (f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?", f"{NUMBER_WORDS[a + b]}."),
        (f"What does a {job} make?", f"A {job} makes {THINGS[JOBS.index(job)]}."),
    ]
    prompt, response = rng.choice(choices)
    return {"prompt": f"Question: {prompt}\nAnswer:", "response": f" {response}"}


def chat_exchange(rng: random.Random) -> tuple[str, str]:
    """One question about the tiny world and its answer."""
    name, town, job = rng.choice(NAMES), rng.choice(TOWNS), rng.choice(JOBS)
    a, b = rng.randint(0, 5), rng.randint(0, 5)
    choices = [
        (f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?", f"{NUMBER_WORDS[a + b].capitalize()}."),
        (f"What does a {job} make?", f"A {job} makes {THINGS[JOBS.index(job)]}."),
        (f"{name} lives in {town}. Where does {name} live?", f"{name} lives in {town}."),
        (f"{name} works as a {job} in {town}. What is {name}'s job?", f"{name} is a {job}."),
    ]
    return rng.choice(choices)


def chat_record(rng: random.Random, number: int) -> dict:
    """A conversation: mostly OpenAI-style messages, some ShareGPT, some multi-turn, a few with a system
    turn, and two (numbers 57 and 143: lines 58 and 144) with no assistant turn, which a trainer skips."""
    turns = []
    if rng.random() < 0.1:
        turns.append({"role": "system", "content": "You answer in one short sentence."})
    for _ in range(rng.choice([1, 1, 2, 3])):
        question, answer = chat_exchange(rng)
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if number in (57, 143):
        turns = [turn for turn in turns if turn["role"] != "assistant"]
    if number % 10 == 3:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in turns]}
    return {"messages": turns}


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = 1024) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    fast.save_pretrained(out_dir)


def main() -> None:
    rng = random.Random(SEED)
    corpus = [{"text": document(rng)} for _ in range(2400)]
    instructions = [instruction(rng) for _ in range(600)]
    chat_rng = random.Random(f"{SEED}-chat")
    chats = [chat_record(chat_rng, number) for number in range(200)]
    write_jsonl(ROOT / "data" / "tiny_corpus.jsonl", corpus)
    write_jsonl(ROOT / "data" / "tiny_instructions.jsonl", instructions)
    write_jsonl(ROOT / "data" / "tiny_chat.jsonl", chats)
    texts = [r["text"] for r in corpus] + [r["prompt"] + r["response"] for r in instructions]
    for model_dir in sorted((ROOT / "configs").glob("tiny-*")):
        if (model_dir / "config.json").exists():
            train_tokenizer(texts, model_dir)
    print(
        f"wrote {len(corpus)} documents, {len(instructions)} instruction pairs, {len(chats)} chats, tokenizers"
    )


if __name__ == "__main__":
    main()
