"""CUDA graphs over decoder layers that are not checkpointed (trainer/fastpath/stack_graphs.py), checked on CPU.

``ReplayOnCpu`` (tests/fastpath/test_layer_graphs.py) stands in for the device: a capture keeps the recorded
function, a replay runs it again, reading only the static tensors the capture saw. So a batch not copied in, a
layer's output not handed on, a gradient not carried down the stack or not accumulated shows up here as a wrong
loss or weight against the same model run eagerly.
"""

from __future__ import annotations

import pytest
import torch

from tests.fastpath.test_fastpath import ALL_LINEAR, checkpointed_llama, rel_err
from tests.fastpath.test_layer_graphs import (
    ReplayOnCpu,
    assert_views_of_parameters_only,
    gradients_asked_for,
)
from trainer.fastpath import decoder_layers, stack_graphs
from trainer.fastpath.lora_ops import track_updates
from trainer.fastpath.patch import patch_lora_linears


def llama(write_config):
    """tiny-llama (two layers) with LoRA on every linear layer as the fast path's nodes, no checkpointing."""
    model = checkpointed_llama(write_config, checkpointing=False)
    fused, _ = patch_lora_linears(model)
    assert fused == 2 * len(ALL_LINEAR)
    model.train()
    return model


def graphed(model, backend=None, **kwargs):
    graphs = stack_graphs.StackGraphs(decoder_layers(model), backend or ReplayOnCpu(), **kwargs)
    assert graphs.install() == 2
    return graphs


def batches(n: int, rows: int = 2, length: int = 24, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (rows, length), generator=generator) for _ in range(n)]


def train(model, ids_list, autocast: bool = False, steps_per_update: int = 2, lr: float = 0.5):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    track_updates(optimizer)
    losses = []
    for i, ids in enumerate(ids_list):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        (loss / steps_per_update).backward()
        losses.append(float(loss))
        if (i + 1) % steps_per_update == 0:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, [p.detach().clone() for p in params]


@pytest.mark.parametrize("autocast,alias", [(False, False), (True, False), (True, True)])
def test_replayed_layers_train_as_the_eager_ones(write_config, autocast, alias):
    """Eight micro-batches, four optimizer steps with accumulation and clipping: the first forward runs
    eagerly, the second captures both layers' forward and backward graphs, the rest replay them with new
    batches and the weights the optimizer changed. ``alias``: as with several processes, the layers run on
    views of their parameters made inside the forward graphs."""
    data = batches(8)
    eager_losses, eager_weights = train(llama(write_config), data, autocast)
    backend = ReplayOnCpu()
    model = llama(write_config)
    graphs = graphed(model, backend, alias_params=alias)
    losses, weights = train(model, data, autocast)
    assert backend.captured == 2 * 2 and graphs.off is None
    tolerance = 2e-2 if autocast else 1e-6
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < tolerance * max(eager_losses)
    for got, want in zip(weights, eager_weights):
        assert rel_err(got, want) < tolerance
    assert len(set(losses)) == len(losses)  # each replay saw its own batch


def test_every_layer_learns_through_the_replays(write_config):
    """One replayed micro-batch gives every LoRA weight the gradient the eager layers give it, the first
    layer's too (its input, from a frozen embedding, needs no gradient: the anchor reaches its backward)."""
    data = batches(3)
    model, reference = llama(write_config), llama(write_config)
    graphs = graphed(model)
    for ids in data[:2]:  # eager, then the capture and the first replay
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    assert graphs.fwd, "captured at the second forward"
    model(input_ids=data[2], labels=data[2], use_cache=False).loss.backward()
    reference(input_ids=data[2], labels=data[2], use_cache=False).loss.backward()
    named = dict(reference.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            assert rel_err(param.grad, named[name].grad) < 1e-5, name
            checked += 1
    assert checked == 2 * 2 * len(ALL_LINEAR)


def test_under_ddp_the_backward_graphs_ask_for_gradients_of_views_made_in_the_forward_ones(
    write_config, monkeypatch
):
    """DDP keeps each parameter's gradient accumulator on the default stream from before any capture; asked
    for the parameters' own gradients, a backward capture fails (2x H200, layer_graphs). With several
    processes the forward graphs run each layer on views made inside them and the backward graphs ask for
    those views' gradients; afterwards the layers hold their own parameters again."""
    monkeypatch.setattr(stack_graphs, "several_processes", lambda: True)
    model = llama(write_config)
    graphs = graphed(model)
    asked = gradients_asked_for(monkeypatch)
    for ids in batches(3):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert graphs.fwd and graphs.off is None and asked
    assert_views_of_parameters_only(model, asked)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_other_shapes_evaluation_and_no_grad_run_eagerly(write_config):
    """A shorter batch after the capture, an eval forward and a no-grad forward run the layers eagerly and
    leave the graphs as they were; the next batch of the captured shape replays again."""
    model, reference = llama(write_config), llama(write_config)
    graphs = graphed(model)
    data = batches(3)
    short = batches(1, length=16, seed=1)[0]
    calls = []
    for ids in [*data[:2], short, data[2]]:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        calls.append(graphs.replaying)
        loss.backward()
        model.zero_grad(set_to_none=True)
    assert calls == [False, True, False, True]
    with torch.no_grad():
        no_grad = float(model(input_ids=data[0], labels=data[0], use_cache=False).loss)
    model.eval()
    evaluated = float(model(input_ids=data[0], labels=data[0], use_cache=False).loss)
    reference.load_state_dict(model.state_dict())
    want = float(reference(input_ids=data[0], labels=data[0], use_cache=False).loss)
    assert no_grad == pytest.approx(want, rel=1e-6) and evaluated == pytest.approx(want, rel=1e-6)


def test_a_failed_capture_leaves_the_layers_eager(write_config, capsys):
    data = batches(4)
    eager_losses, _ = train(llama(write_config), data)
    model = llama(write_config)
    told = []
    graphs = graphed(model, ReplayOnCpu(fail=True))
    graphs.on_change = lambda state, detail: told.append((state, detail))
    losses, _ = train(model, data)
    assert graphs.off and "operation not permitted" in graphs.off
    assert told == [("off", graphs.off)]
    assert "CUDA graphs are off" in capsys.readouterr().err
    assert losses == pytest.approx(eager_losses, rel=1e-6)


def test_calls_the_family_marks_stay_eager(write_config):
    """``eager_call`` (GLA's varlen rows) keeps those forwards eager and captures nothing for them."""
    model = llama(write_config)
    backend = ReplayOnCpu()
    graphs = graphed(model, backend, eager_call=lambda kwargs: True)
    train(model, batches(4))
    assert backend.captured == 0 and graphs.off is None and not graphs.replaying


def test_hooks_or_dropout_keep_the_stack_eager(write_config):
    model = llama(write_config)
    layers = decoder_layers(model)
    layers[1].mlp.register_forward_hook(lambda *args: None)
    graphs = stack_graphs.StackGraphs(layers, ReplayOnCpu())
    assert graphs.install() == 0 and "hooks on mlp" in graphs.off


def test_a_layer_returning_other_tensors_is_not_replayed(write_config, capsys):
    """A layer whose output holds more tensors than its hidden states (router logits) cannot be replayed: the
    graphs go off, saying so; hidden states with plain values beside them (fla's blocks) are kept."""
    graphs = graphed(llama(write_config))
    hidden = torch.zeros(2, 3)
    graphs.recorded[0] = stack_graphs._Call(None, [], ())
    graphs._note_output(0, (hidden, None, None))
    assert graphs.off is None and graphs.recorded[0].out_spec[0] == [None, None, None]
    graphs._note_output(1, (hidden, torch.zeros(1)))
    assert graphs.off and "other tensors" in graphs.off
    assert "CUDA graphs are off" in capsys.readouterr().err


def test_the_decoder_layers_are_found_once():
    """``decoder_layers`` lists the outer blocks of a model, not blocks nested in them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.inner = GradientCheckpointingLayer()

    model = torch.nn.Sequential(Block(), Block())
    assert decoder_layers(model) == [model[0], model[1]]


def padded_batches(n: int, short: int, width: int = 24, seed: int = 0) -> list[dict]:
    """Collated batches of two one-document rows; the last batch's second row has ``short`` tokens."""
    from trainer.data.batches import collate
    from trainer.data.rows import Sequence

    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lengths = (width, short if i == n - 1 else width)
        rows = [torch.randint(3, 1024, (length,), generator=generator).tolist() for length in lengths]
        out.append(collate([Sequence(r, r, list(range(len(r)))) for r in rows], pad_id=0))
    return out


def test_right_padding_unmasked_gives_every_real_token_the_masked_logits(write_config):
    """``unmask_right_padding``: no mask, the padding's positions counting on, and the same logits and loss
    for every real token (causal attention never looks right), so graphed runs may drop the mask."""
    from trainer.families.base import causal_inputs, unmask_right_padding

    batch = padded_batches(1, short=17)[0]
    assert "attention_mask" in batch
    unmasked = unmask_right_padding(batch)
    assert "attention_mask" not in unmasked and torch.equal(unmasked["token_mask"], batch["token_mask"])
    assert torch.equal(unmasked["position_ids"], torch.arange(24).expand(2, 24))
    model = llama(write_config)
    with torch.no_grad():
        masked = model(**causal_inputs(batch), use_cache=False).logits
        plain = model(**causal_inputs(unmasked), use_cache=False).logits
    real = batch["token_mask"]
    assert rel_err(plain[real], masked[real]) < 1e-5
    assert unmask_right_padding(padded_batches(1, short=24)[0]).keys() == batch.keys() - {"attention_mask"}


def test_a_short_rows_batch_replays_and_trains_as_the_masked_eager_one(write_config):
    """With the stack graphed, the step's inputs (``step_inputs``) drop the padding mask, so a batch holding an
    epoch's last, shorter row calls the layers as the full ones did and replays, instead of running eagerly
    beside the pool; its loss and gradients are the eager, masked ones. Without graphs the mask stays."""
    import contextlib
    import types

    from trainer import fastpath
    from trainer.families.causal import CAUSAL
    from trainer.training.step import FullCrossEntropy, step_inputs

    accelerator = types.SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    data = padded_batches(3, short=17)
    model, reference = llama(write_config), llama(write_config)
    eager_inputs = step_inputs(reference, CAUSAL)
    assert "attention_mask" in eager_inputs(data[-1])
    graphs = graphed(model)
    setattr(model, fastpath.STACK_ATTRIBUTE, graphs)
    loss_fn, eager_loss_fn = FullCrossEntropy(step_inputs(model, CAUSAL)), FullCrossEntropy(eager_inputs)
    replayed = []
    for batch in data:
        loss, _ = loss_fn(model, batch, accelerator)
        replayed.append(graphs.replaying)
        want, _ = eager_loss_fn(reference, batch, accelerator)
        assert float(loss) == pytest.approx(float(want), rel=1e-5)
        loss.backward()
        want.backward()
    assert replayed == [False, True, True]
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert rel_err(param.grad, named[name].grad) < 1e-5, name


def test_a_batch_that_cannot_replay_runs_checkpointed_and_trains_as_the_eager_one(write_config, monkeypatch):
    """After the capture, a batch the graphs cannot take (packed documents after plain rows: the layers get a
    mask they were not captured with) runs eagerly under activation checkpointing, so it keeps far fewer saved
    tensors than an eager forward would beside the graphs' pool; its loss and gradients are the eager ones."""
    calls = []
    real_checkpoint = stack_graphs.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(function)
        return real_checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(stack_graphs, "checkpoint", counted)
    model, reference = llama(write_config), llama(write_config)
    graphs = graphed(model)
    ids = batches(3)
    packed = torch.arange(24).remainder(8).expand(2, 24)  # three documents in each row

    def run(m, saved: list):
        losses = []
        for i, x in enumerate(ids):
            extra = {"position_ids": packed} if i == 2 else {}
            sizes = []

            def pack(t, sizes=sizes):
                sizes.append(t.numel())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = m(input_ids=x, labels=x, use_cache=False, **extra).loss
            loss.backward()
            losses.append(float(loss))
            saved.append(sum(sizes))
        return losses

    saved, saved_eager = [], []
    losses, want = run(model, saved), run(reference, saved_eager)
    assert graphs.signature is not None and len(calls) == 2  # both layers, the packed batch only
    assert losses == pytest.approx(want, rel=1e-5)
    assert saved[2] < 0.5 * saved_eager[2]
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert rel_err(param.grad, named[name].grad) < 1e-5, name
