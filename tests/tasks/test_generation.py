"""Generation-based evaluation on tiny random-init models built from the offline configs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.helpers import REPO
from trainer.tasks import get_task
from trainer.training.generation import evaluate_task, generate, generate_texts, max_positions

CONFIGS = REPO / "configs"
PROMPTS = [
    "hello world",
    "SELECT name FROM singer WHERE age > 3 ORDER BY age",
    "a",
    "The quick brown fox jumps over",
    "Sentence: it was great\nAnswer:",
]


def tiny_model(name: str = "tiny-llama", **overrides):
    config = AutoConfig.from_pretrained(CONFIGS / name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture()
def tokenizer():
    return AutoTokenizer.from_pretrained(CONFIGS / "tiny-llama")


def alone(model, tokenizer, prompt: str, **kwargs) -> list[int]:
    """The oracle: plain model.generate on one unpadded prompt, new tokens up to the first eos."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=2, **kwargs
    )
    new = out[0, ids.shape[1] :].tolist()
    return new[: new.index(2)] if 2 in new else new


@contextlib.contextmanager
def eos_bias(model, value: float):
    """Push the eos logit up (the model wants to stop) or down (it never stops)."""

    def hook(module, inputs, output):
        output = output.clone()
        output[..., 2] += value
        return output

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("config_name", ["tiny-llama", "tiny-moe"])
def test_left_padded_batch_matches_each_prompt_alone(config_name, tokenizer):
    model = tiny_model(config_name)
    batched = generate(model, tokenizer, PROMPTS, max_new_tokens=8, batch_size=len(PROMPTS))
    for prompt, ids, text in zip(PROMPTS, batched.token_ids, batched.texts):
        expected = alone(model, tokenizer, prompt, max_new_tokens=8, do_sample=False)
        assert ids == expected, prompt
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert any(len(ids) == 8 for ids in batched.token_ids)  # real continuations, not empty strings


def test_batch_size_and_tokenizer_padding_side_do_not_change_results(model, tokenizer):
    reference = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=1)
    tokenizer.padding_side = "right"
    assert generate_texts(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=2) == reference
    assert tokenizer.padding_side == "right"  # the caller's tokenizer is left as it was


def test_tokenizer_without_pad_token_falls_back_to_eos(model, tokenizer):
    reference = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=5)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert generate_texts(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=5) == reference
    assert tokenizer.pad_token is None


def test_stops_at_eos_and_strips_the_prompt(model, tokenizer):
    with eos_bias(model, 1e4):
        result = generate(model, tokenizer, PROMPTS, max_new_tokens=10)
    assert result.texts == [""] * len(PROMPTS)
    assert result.token_ids == [[]] * len(PROMPTS)


def test_min_new_tokens_holds_off_eos(model, tokenizer):
    with eos_bias(model, 1e4):
        result = generate(model, tokenizer, PROMPTS, max_new_tokens=10, min_new_tokens=3)
    assert [len(ids) for ids in result.token_ids] == [3] * len(PROMPTS)
    assert all(2 not in ids for ids in result.token_ids)


def test_beam_search_matches_plain_generate(model, tokenizer):
    result = generate(model, tokenizer, PROMPTS[:2], max_new_tokens=5, num_beams=3, batch_size=2)
    for prompt, ids in zip(PROMPTS[:2], result.token_ids):
        assert ids == alone(model, tokenizer, prompt, max_new_tokens=5, num_beams=3, do_sample=False)


def test_length_guard_caps_new_tokens_at_max_total_length(model, tokenizer):
    prompt = "The quick brown fox jumps over"
    prompt_len = len(tokenizer(prompt)["input_ids"])
    limit = prompt_len * 2 + 2  # half the limit is more than the prompt: no truncation, only a cap
    with eos_bias(model, -1e4):  # never stops by itself
        result = generate(model, tokenizer, [prompt], max_new_tokens=50, max_total_length=limit)
    assert len(result.token_ids[0]) == limit - prompt_len
    assert (result.capped_batches, result.prompts_truncated, result.limit) == (1, 0, limit)


def test_length_guard_truncates_prompts_past_the_model_positions(tokenizer):
    model = tiny_model(max_position_embeddings=16)
    assert max_positions(model) == 16
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 16
    with eos_bias(model, -1e4):
        result = generate(model, tokenizer, [prompt], max_new_tokens=4)
        kept = tokenizer.decode(ids[-12:])  # 16 positions - 4 new tokens
        assert result.token_ids[0] == alone(model, tokenizer, kept, max_new_tokens=4, do_sample=False)
    assert len(result.token_ids[0]) == 4
    assert (result.prompts_truncated, result.capped_batches) == (1, 0)


def test_eval_mode_no_grad_and_train_mode_restored_on_a_peft_model(tokenizer):
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    expected = generate_texts(base, tokenizer, PROMPTS, max_new_tokens=5)
    peft_model = get_peft_model(
        base, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"])
    )
    peft_model.train()
    seen = []
    handle = base.model.layers[0].register_forward_hook(
        lambda module, inputs, output: seen.append((module.training, torch.is_grad_enabled()))
    )
    try:
        # LoRA's B starts at zero, so the adapter model generates what the base model did.
        assert generate_texts(peft_model, tokenizer, PROMPTS, max_new_tokens=5) == expected
    finally:
        handle.remove()
    assert seen and set(seen) == {(False, False)}
    assert peft_model.training and base.model.layers[0].training


def test_train_mode_restored_when_generation_fails(tokenizer):
    model = tiny_model()
    model.train()
    with pytest.raises(ValueError, match="not used by the model"):
        generate(model, tokenizer, ["fine"], max_new_tokens=2, not_a_generate_argument=1)
    assert model.training


def test_eval_mode_model_stays_in_eval_mode(model, tokenizer):
    model.eval()
    generate(model, tokenizer, ["fine"], max_new_tokens=2)
    assert not any(module.training for module in model.modules())


def test_impossible_requests_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, tokenizer, ["fine", ""], max_new_tokens=2)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        generate(model, tokenizer, ["fine"], max_new_tokens=8, min_new_tokens=8, max_total_length=8)


def test_evaluate_task_generates_scores_and_samples(model, tokenizer, tmp_path):
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "dev.tsv").write_text("sentence\tlabel\ngreat fun \t1\na dull mess \t0\nfine \t1\n")
    task = get_task("sst2", tmp_path)
    examples = task.load("validation")
    with eos_bias(model, 1e4):  # answers are empty: nothing parses
        report = evaluate_task(model, tokenizer, task, examples, {"max_new_tokens": 3}, num_samples=2)
    assert report["task"] == "sst2"
    assert report["metrics"] == {"accuracy": 0.0, "unparsed": 3, "n": 3}
    assert report["samples"][1] == {
        "prompt": task.prompt(examples[1]),
        "prediction": "",
        "target": " negative",
    }
    assert len(report["samples"]) == 2
    assert report["generation"]["prompts_truncated"] == 0
