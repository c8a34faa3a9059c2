"""A checkpointed layer's recompute skips its MLP's output projection where nothing reads it
(trainer/fastpath/recompute_tail.py), checked on CPU: the same gradients as a whole recompute, the projection
really skipped, and layers whose MLP output feeds anything but sums kept whole."""

from __future__ import annotations

import pytest
import torch

from tests.fastpath.test_fastpath import ALL_LINEAR, checkpoint_grads, checkpointed_llama, mlp_case, rel_err
from tests.fastpath.test_layer_graphs import ReplayOnCpu, packed_batches, train
from trainer.fastpath import layer_graphs, offload, recompute_tail
from trainer.fastpath.patch import patch_lora_linears, patch_swiglu_mlps


def fused_mlp_llama(write_config):
    model = checkpointed_llama(write_config)
    assert patch_swiglu_mlps(model) == 2
    patch_lora_linears(model)
    return model


def decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@pytest.fixture
def skips_seen(monkeypatch) -> list:
    """What each fused MLP forward was told: True where it skipped its output projection."""
    seen = []
    asked = recompute_tail.output_unused

    def spy():
        seen.append(asked())
        return seen[-1]

    monkeypatch.setattr(recompute_tail, "output_unused", spy)
    return seen


def test_only_a_summed_mlp_output_counts_as_unused(write_config):
    model = fused_mlp_llama(write_config)
    mlp, norm = decoder_layers(model)[0].mlp, decoder_layers(model)[0].post_attention_layernorm
    x = torch.randn(1, 5, mlp.gate_proj.in_features, requires_grad=True)
    y = mlp(x)
    assert recompute_tail.only_summed(x + y)  # the pre-norm residual add
    assert recompute_tail.only_summed((x - y.float()).view(5, -1))  # casts and views hand gradients on too
    assert not recompute_tail.only_summed(norm(x + y))  # a post-MLP norm reads the output
    assert not recompute_tail.only_summed(x + y + y.sigmoid())  # one sum path, one that reads values
    assert not recompute_tail.only_summed(x + y * 2.0)  # a scale is not taken as a sum (conservative)
    assert not recompute_tail.only_summed(x + x.sigmoid())  # no fused MLP at all
    assert not recompute_tail.only_summed(x.detach())


@pytest.mark.parametrize("by_rows", [False, True])
def test_recompute_skips_the_projection_and_gives_the_gradients_of_a_whole_one(
    write_config, skips_seen, monkeypatch, by_rows
):
    """Step 1's recompute runs whole and learns; step 2's skips, with the gradients of plain checkpointing;
    also where the blocks are large enough to run by rows (the forward without autograd then never asks)."""
    from trainer.fastpath import lora_ops

    model = fused_mlp_llama(write_config)
    ids = torch.randint(3, 1024, (2, 24))
    ref_loss, ref_grads = checkpoint_grads(model, ids)  # transformers' own checkpointing: no skip
    assert skips_seen == [False] * 4
    if by_rows:
        monkeypatch.setattr(lora_ops, "BLOCK_BYTES", 0)
    assert offload.offload_checkpointed_layers(model) == 2
    forward = [] if by_rows else [False, False]
    skips_seen.clear()
    checkpoint_grads(model, ids)
    assert skips_seen == forward + [False, False], "the first recompute of each layer runs whole"
    assert all(recompute_tail.may_skip(layer) for layer in decoder_layers(model))
    skips_seen.clear()
    loss, grads = checkpoint_grads(model, ids)
    assert skips_seen == forward + [True, True], "the recompute without the projection"
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert grads.keys() == ref_grads.keys() and any("down_proj" in name for name in grads)
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-6, name


def test_a_layer_whose_mlp_output_is_normed_recomputes_whole(write_config, skips_seen, monkeypatch):
    """A post-MLP norm (as Gemma's layers have) reads the output: that layer never skips, and its gradients
    stay those of plain checkpointing."""
    model = fused_mlp_llama(write_config)
    first, layer = decoder_layers(model)
    fused_forward = layer.mlp.forward
    monkeypatch.setattr(layer.mlp, "forward", lambda x: layer.post_attention_layernorm(fused_forward(x)))
    ids = torch.randint(3, 1024, (2, 24))
    _, ref_grads = checkpoint_grads(model, ids)
    offload.offload_checkpointed_layers(model)
    for _ in range(2):
        skips_seen.clear()
        _, grads = checkpoint_grads(model, ids)
    assert recompute_tail.may_skip(first) and not recompute_tail.may_skip(layer)
    assert skips_seen == [False, False, False, True], "backward order: layer 1 whole, layer 0 skipped"
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-6, name


def test_graphed_recomputes_skip_and_train_as_the_eager_layers(write_config, skips_seen):
    """The backward graphs are captured after each layer's whole first recompute and record the skip; losses
    and weights over three optimizer steps are those of eager layers that never skip."""
    batches = packed_batches(6)
    plain = fused_mlp_llama(write_config)
    setattr(plain, offload.ATTRIBUTE, None)  # ``train`` leaves it on transformers' own checkpointing
    eager_losses, eager_weights = train(plain, batches, autocast=False)
    assert True not in skips_seen
    skips_seen.clear()
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    losses, weights = train(fused_mlp_llama(write_config), batches, autocast=False, graphs=graphs)
    assert graphs.off is None and graphs.captured == 4
    assert skips_seen.count(True) == 2 * 5, "every recompute after each layer's first skips"
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    for got, want in zip(weights, eager_weights):
        assert rel_err(got, want) < 1e-6


def test_a_skipping_recompute_runs_the_mlp_backward_by_row_blocks_with_eager_gradients(monkeypatch):
    """Inside a skipping recompute the fused MLP returns zeros and its backward computes the block in row
    blocks: every (tokens x intermediate) tensor is a block's rows, and the gradients are eager fp32's."""
    from trainer.fastpath import lora_ops

    parts, lora_leaves, reference = mlp_case()
    x = torch.randn(2, 7, 32, requires_grad=True)
    grad = torch.randn(2, 7, 32)
    monkeypatch.setattr(lora_ops, "BLOCK_BYTES", 14 * 80 * 4)  # this block's size: by rows
    rows_seen = []
    swiglu = lora_ops._swiglu
    monkeypatch.setattr(lora_ops, "_swiglu", lambda e, g: rows_seen.append(e.shape[0]) or swiglu(e, g))
    layer = torch.nn.Linear(1, 1)
    monkeypatch.setitem(recompute_tail._verdicts, layer, True)
    with recompute_tail.skipping(layer):
        out = lora_ops.lora_mlp(x, *parts)
    assert not out.any() and rows_seen == [], "the forward computed nothing"
    out.backward(grad)
    assert rows_seen == [7, 7], "14 rows in two blocks"
    leaves = [x] + lora_leaves
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    reference(x).backward(grad)
    for mine, theirs in zip(got, [t.grad for t in leaves]):
        assert rel_err(mine, theirs) < 1e-5


def test_row_blocks_cover_every_row_once_and_only_large_blocks_run_by_rows():
    from trainer.fastpath.lora_ops import BLOCK_BYTES, BLOCKS, row_blocks

    for rows in (1, 7, 8192, 8193):
        blocks = row_blocks(rows, BLOCK_BYTES, torch.int8)
        assert len(blocks) <= BLOCKS and blocks[0].start == 0 and blocks[-1].stop == rows
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    assert len(row_blocks(8192, 8192, torch.bfloat16)) == 2  # Llama-1B at 4 x 2048: 128 MiB
    assert row_blocks(8192, 3072, torch.bfloat16) is None  # Qwen3-0.6B: 48 MiB, whole


def test_an_mlp_without_autograd_computes_a_large_block_by_rows(monkeypatch):
    """Checkpointing's first pass (no autograd): a large block's output row block by row block, the same
    output as the whole block's."""
    from trainer.fastpath import lora_ops

    parts, _, _ = mlp_case()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        whole = lora_ops.lora_mlp(x, *parts)
        monkeypatch.setattr(lora_ops, "BLOCK_BYTES", 0)
        rows_seen = []
        swiglu = lora_ops._swiglu
        monkeypatch.setattr(lora_ops, "_swiglu", lambda e, g: rows_seen.append(e.shape[0]) or swiglu(e, g))
        by_rows = lora_ops.lora_mlp(x, *parts)
    assert rows_seen == [7, 7]
    assert rel_err(by_rows, whole) < 1e-6


def test_olmo2s_post_feedforward_norm_keeps_its_recompute_whole(skips_seen):
    """A real architecture whose MLP output is normed before the residual add (OLMo-2): the fused MLP runs,
    no layer skips, and the gradients stay those of transformers' own checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = get_peft_model(Olmo2ForCausalLM(config), LoraConfig(r=4, target_modules=list(ALL_LINEAR)))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert patch_swiglu_mlps(model) == 2
    patch_lora_linears(model)
    ids = torch.randint(0, 128, (2, 16))
    _, ref_grads = checkpoint_grads(model, ids)
    assert offload.offload_checkpointed_layers(model) == 2
    for _ in range(2):
        skips_seen.clear()
        _, grads = checkpoint_grads(model, ids)
    assert skips_seen == [False] * 4 and not any(recompute_tail.may_skip(m) for m in decoder_layers(model))
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-6, name
