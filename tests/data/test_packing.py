"""No token attends across packed documents: each document's loss and gradients, packed with others
through the kit's own path (pack, collate, the family's model inputs, the forward), equal the same
document's computed alone, for llama-, qwen2- and qwen3-shaped models and each attention kernel that
runs on CPU."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen3Config

from trainer.data.dataset import IGNORE, Sequence, collate, pack
from trainer.families import family_for, family_inputs
from trainer.families.base import causal_inputs, has_document_boundaries
from trainer.fastpath import attention
from trainer.training.step import FullCrossEntropy

PAD = 0
SMALL = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=PAD,
)
CONFIGS = {
    "llama": lambda: AutoConfig.from_pretrained("configs/tiny-llama"),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=16),
}
CPU = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)


def documents(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def packed_batch(layout: str) -> dict:
    """Rows as the loop builds them. 'packed': full rows, so collate adds no attention mask.
    'packed+padded': packed rows of two widths, so collate right-pads and adds one (the case where
    transformers would ignore the position ids)."""
    docs = documents((7, 12, 5, 9, 20, 3), seed=0)  # the 20-token one is split across rows
    rows = pack([(d, list(d)) for d in docs], 24, PAD)
    if layout == "packed+padded":
        rows += pack([(d, list(d)) for d in documents((6, 4, 8), seed=1)], 16, PAD)
    batch = collate(rows, PAD)
    assert ("attention_mask" in batch) == (layout == "packed+padded")
    return batch


def segments(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document: maximal runs of real tokens whose positions go up by one."""
    found = []
    for row, (positions, real) in enumerate(
        zip(batch["position_ids"].tolist(), batch["token_mask"].tolist())
    ):
        start = 0
        for t in range(1, len(positions) + 1):
            if t == len(positions) or not real[t] or positions[t] != positions[t - 1] + 1:
                if real[start]:
                    found.append((row, start, t))
                start = t
    return found


def build(arch: str, implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        CONFIGS[arch](), attn_implementation=implementation, dtype=torch.float32
    )
    return model.train()


def summed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one document, summed: logits (n, V), labels (n,)."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")


def embedding_grads(model):
    """Run the model with the input embeddings' gradient kept, so a loss's dependence on each token shows."""
    kept = {}

    def keep(module, args, output):
        output.retain_grad()
        kept["embeds"] = output

    return kept, model.get_input_embeddings().register_forward_hook(keep)


ARCHS = ["llama", "qwen2", "qwen3"]
KERNELS = ["sdpa", "eager"]
LAYOUTS = ["packed", "packed+padded"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_document_losses_and_gradients_equal_alone(arch, implementation, layout):
    model = build(arch, implementation)
    batch = packed_batch(layout)
    kept, hook = embedding_grads(model)
    out = model(**family_inputs(model, batch), use_cache=False)
    packed_embeds = kept["embeds"]
    # The loop's own loss of the whole micro-batch, too.
    total = FullCrossEntropy(family_for(model.config.model_type).model_inputs)(model, batch, CPU)[0]
    alone_total = 0.0
    for row, start, end in segments(batch):
        labels = batch["labels"][row, start:end]
        if (labels[1:] == IGNORE).all():
            continue  # the padding segment at the end of the last packed row
        ids = batch["input_ids"][row, start:end]
        packed_loss = summed_ce(out.logits[row, start:end], labels)
        packed_embeds.grad = None
        packed_loss.backward(retain_graph=True)
        packed_grad = packed_embeds.grad.clone()

        alone_out = model(input_ids=ids[None], use_cache=False)
        alone_loss = summed_ce(alone_out.logits[0], labels)
        alone_loss.backward()
        alone_total += alone_loss.item()

        where = f"{arch}/{implementation}/{layout} row {row} tokens {start}:{end}"
        torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-5, msg=where)
        outside = packed_grad.clone()
        outside[row, start:end] = 0
        assert outside.abs().max() == 0, f"{where}: its loss depends on tokens of other documents"
        alone_grad = kept["embeds"].grad[0]
        scale = float(alone_grad.abs().max())
        torch.testing.assert_close(
            packed_grad[row, start:end], alone_grad, rtol=1e-4, atol=max(1e-4 * scale, 1e-7), msg=where
        )
    hook.remove()
    assert abs(float(total) - alone_total) <= 1e-5 * alone_total


def test_packed_lora_gradients_equal_alone():
    """Per document, the LoRA gradients from its packed loss are those from the document alone."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build("llama", "sdpa"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    )
    for module in model.modules():  # B starts at zero; random B makes every LoRA path matter
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.1)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    batch = packed_batch("packed+padded")
    out = model(**family_inputs(model, batch), use_cache=False)
    compared = 0
    for row, start, end in segments(batch):
        labels = batch["labels"][row, start:end]
        if (labels[1:] == IGNORE).all():
            continue
        packed = torch.autograd.grad(summed_ce(out.logits[row, start:end], labels), lora, retain_graph=True)
        alone_logits = model(input_ids=batch["input_ids"][row, start:end][None], use_cache=False).logits[0]
        alone = torch.autograd.grad(summed_ce(alone_logits, labels), lora)
        for got, want in zip(packed, alone):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=max(1e-4 * float(want.abs().max()), 1e-7))
        compared += 1
    assert compared >= 8


def test_flex_attention_packed_losses_equal_alone():
    """FlexAttention, switched on through the fast path's attention module, keeps documents apart.
    On CPU it runs forward only (torch has no FlexAttention backward there), so no gradients here."""
    model = build("llama", "sdpa")
    assert attention.use(model, attention.FLEX) == attention.FLEX
    batch = packed_batch("packed+padded")
    with torch.no_grad():
        logits = model(**family_inputs(model, batch), use_cache=False).logits
        compared = 0
        for row, start, end in segments(batch):
            labels = batch["labels"][row, start:end]
            if (labels[1:] == IGNORE).all():
                continue
            alone = model(input_ids=batch["input_ids"][row, start:end][None], use_cache=False).logits[0]
            torch.testing.assert_close(
                summed_ce(logits[row, start:end], labels), summed_ce(alone, labels), rtol=1e-5, atol=1e-5
            )
            compared += 1
    assert compared >= 8


def test_padding_mask_kept_for_unpacked_rows_dropped_for_packed_ones():
    """Unpacked right-padded rows keep their mask (a MoE router's aux loss reads it); packed and
    padded rows lose it, since transformers only reads position ids when no mask is given."""
    unpacked = collate([Sequence([5, 6, 7], [5, 6, 7], [0, 1, 2]), Sequence([5, 6], [5, 6], [0, 1])], PAD)
    assert not has_document_boundaries(unpacked)
    assert "attention_mask" in causal_inputs(unpacked)
    packed = collate([Sequence([5, 6, 7], [5, 6, 7], [0, 1, 0]), Sequence([5, 6], [5, 6], [0, 1])], PAD)
    assert has_document_boundaries(packed)
    assert sorted(causal_inputs(packed)) == ["input_ids", "position_ids"]
    full = collate([Sequence([5, 6, 7, 8], [5, 6, 7, 8], [0, 1, 0, 1])], PAD)
    assert "attention_mask" not in full and sorted(causal_inputs(full)) == ["input_ids", "position_ids"]


def test_default_positions_are_not_passed():
    """Rows counting 0, 1, 2, ... need no position ids (transformers' default; passing them makes it look for
    packed documents with a GPU sync); a window that starts elsewhere keeps its own."""
    plain = collate(
        [Sequence([5, 6, 7], [5, 6, 7], [0, 1, 2]), Sequence([8, 9, 4], [8, 9, 4], [0, 1, 2])], PAD
    )
    assert sorted(causal_inputs(plain)) == ["input_ids"]
    shifted = collate([Sequence([5, 6, 7], [5, 6, 7], [4, 5, 6])], PAD)
    assert sorted(causal_inputs(shifted)) == ["input_ids", "position_ids"]


def test_attention_choice():
    """sdpa unless the config names another kernel: FlexAttention measured no faster on the GPU."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention.choose(cpu, packing=True).implementation == attention.SDPA
    assert attention.choose(cuda, packing=False).implementation == attention.SDPA
    assert attention.choose(cuda, packing=True).implementation == attention.SDPA
    assert attention.choose(cuda, packing=True, configured="flex_attention").implementation == attention.FLEX
    assert attention.choose(cuda, packing=True, configured="eager").implementation == "eager"


def test_attention_apply_switches_a_peft_model_and_reports():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama", "sdpa"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert attention.apply(model, torch.device("cpu"), packing=True, configured="eager") == {
        "attention": "eager",
        "attention_reason": "model.attn_implementation",
    }
    assert model.get_base_model().config._attn_implementation == "eager"
    assert attention.apply(model, torch.device("cpu"), packing=True)["attention"] == attention.SDPA


def test_block_density_counts_blocks_shared_by_a_document():
    one_document = torch.arange(512)[None]
    assert attention.block_density(one_document, block=128) == pytest.approx(10 / 16)  # causal: 4*5/2 of 4*4
    four_documents = torch.arange(128).repeat(4)[None]
    assert attention.block_density(four_documents, block=128) == pytest.approx(4 / 16)  # the diagonal only
    straddling = torch.cat([torch.arange(192), torch.arange(320)])[None]  # documents of 192 and 320 tokens
    # blocks 0,1 | 1,2,3: pairs (0,0) (1,0) (1,1) (2,1) (2,2) (3,1) (3,2) (3,3)
    assert attention.block_density(straddling, block=128) == pytest.approx(8 / 16)
    assert attention.block_density(torch.arange(200)[None], block=128) == pytest.approx(3 / 4)
    assert attention.document_ids(torch.tensor([[3, 4, 0, 1, 0, 0]])).tolist() == [[0, 0, 1, 1, 2, 3]]
