"""A frozen head's fused loss (trainer/fastpath/frozen_head_loss.py), checked on CPU.

Liger's forward is stood in for by ``tests.cpu_liger.cpu_flce_forward`` (the same contract: the loss and the
hidden states' gradient), and the pool's lent memory by
``ReplayOnCpu.run_in_free_memory``, which writes NaN over everything it lent once the results are copied out,
as the next replay writes over the pool on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import trainer.fastpath as fastpath
from tests.cpu_liger import cpu_flce_forward, cpu_fused_linear_cross_entropy
from tests.fastpath.test_layer_graphs import ReplayOnCpu
from trainer.fastpath import frozen_head_loss, layer_graphs


@pytest.fixture
def cpu_liger(monkeypatch):
    monkeypatch.setattr(fastpath, "_flce_forward", cpu_flce_forward)
    monkeypatch.setattr(fastpath, "_liger_flce", lambda: cpu_fused_linear_cross_entropy)


def batch(dtype=torch.float32):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).to(dtype).requires_grad_(False)
    hidden = torch.randn(3, 7, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    labels[2, 4] = -100
    return head, hidden, labels


def loss_and_grad(loss_fn, head, hidden, labels, scale=0.25):
    hidden.grad = None
    loss = loss_fn(head, hidden, labels)
    (loss * scale).backward()  # a scale, as the step's normalisation by all target tokens gives
    return loss.detach(), hidden.grad.clone()


def lent_and_reference(head, hidden, labels, backend):
    """Loss and gradient computed in ``backend``'s lent memory, and over full fp32 logits."""
    lent = loss_and_grad(
        lambda h, x, y: fastpath.fused_cross_entropy(h, x, y, lend=backend.run_in_free_memory),
        head,
        hidden,
        labels,
    )
    return lent, loss_and_grad(fastpath.reference_cross_entropy, head, hidden, labels)


def test_the_lent_loss_is_the_plain_shifted_cross_entropy_and_its_gradient(cpu_liger):
    """Against cross-entropy over full fp32 logits, and nothing read from lent memory after the call."""
    head, hidden, labels = batch()
    backend = ReplayOnCpu()
    lent, reference = lent_and_reference(head, hidden, labels, backend)
    assert backend.lent == 1
    assert torch.allclose(lent[0], reference[0], rtol=1e-6)
    assert torch.allclose(lent[1], reference[1], atol=1e-7)
    assert lent[1][0, :2].abs().sum() == 0 and lent[1][:, -1].abs().sum() == 0  # no target, no gradient


def test_fp32_states_from_accelerate_get_an_fp32_gradient_through_a_bf16_head(cpu_liger):
    head, hidden, labels = batch()
    head = head.to(torch.bfloat16)
    plain = loss_and_grad(fastpath.fused_cross_entropy, head, hidden, labels)
    lent = loss_and_grad(
        lambda h, x, y: fastpath.fused_cross_entropy(h, x, y, lend=frozen_head_loss.copied_out),
        head,
        hidden,
        labels,
    )
    assert lent[1].dtype == torch.float32
    assert torch.allclose(lent[0], plain[0]) and torch.allclose(lent[1], plain[1], atol=1e-6)


def test_lent_memory_only_for_a_frozen_head_in_training(cpu_liger):
    """A trainable head keeps Liger's own node (its gradient would be a vocabulary-sized copy); so does a
    forward without gradients (evaluation)."""
    head, hidden, labels = batch()
    backend = ReplayOnCpu()
    head.weight.requires_grad_(True)
    fastpath.fused_cross_entropy(head, hidden, labels, lend=backend.run_in_free_memory)
    head.weight.requires_grad_(False)
    with torch.no_grad():
        fastpath.fused_cross_entropy(head, hidden, labels, lend=backend.run_in_free_memory)
    assert backend.lent == 0
    fastpath.fused_cross_entropy(head, hidden, labels, lend=backend.run_in_free_memory)
    assert backend.lent == 1


def test_the_graphs_lend_their_pool_only_while_layers_replay():
    backend = ReplayOnCpu()
    graphs = layer_graphs.LayerGraphs(backend)
    assert graphs.lender() is None  # nothing captured: no pool yet
    graphs.graphs[("layer", "forward")] = object()
    assert graphs.lender() == backend.run_in_free_memory
    graphs.off = "capturing failed"
    assert graphs.lender() is None


def test_a_model_without_checkpointed_graphs_keeps_the_plain_fused_loss():
    assert fastpath.fused_loss_of(torch.nn.Linear(2, 2)) is fastpath.fused_cross_entropy


def test_a_frozen_heads_loss_takes_the_kits_node_without_lent_memory_too(cpu_liger, monkeypatch):
    """No graphs: the kit's node all the same (its backward scales on the device), the same loss and gradient
    as Liger's own node (stood in for by ``cpu_fused_linear_cross_entropy``)."""
    head, hidden, labels = batch()
    ours = loss_and_grad(fastpath.fused_cross_entropy, head, hidden, labels)
    assert "FrozenHeadLoss" in type(fastpath.fused_cross_entropy(head, hidden, labels).grad_fn).__name__
    monkeypatch.setattr(
        frozen_head_loss.FrozenHeadLoss, "apply", None
    )  # a call would fail: Liger's node only
    head.weight.requires_grad_(True)
    liger = loss_and_grad(fastpath.fused_cross_entropy, head, hidden, labels)
    assert torch.allclose(ours[0], liger[0]) and torch.allclose(ours[1], liger[1], atol=1e-7)


def test_the_backward_never_asks_the_host_for_the_scale(cpu_liger, monkeypatch):
    """Liger's backward compares the scale with 1.0 on the host (``torch.equal``: a device sync on a GPU); the
    kit's multiplies on the device whatever it is, 1.0 included."""
    head, hidden, labels = batch()
    asked = []
    monkeypatch.setattr(torch, "equal", lambda *args: asked.append(args) or True)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: asked.append(self) or 0.0)
    for scale in (1.0, 0.25):
        loss_and_grad(fastpath.fused_cross_entropy, head, hidden, labels, scale=scale)
    assert asked == []


def test_the_self_check_covers_the_lent_node_and_a_trainable_head(cpu_liger):
    """Both loss checks pass the shipped paths (Liger stood in for) and catch a wrong one."""
    from trainer.fastpath import selfcheck

    device = torch.device("cpu")
    assert selfcheck.check_fused_cross_entropy_lent(device, torch.float32) < 1e-5
    assert selfcheck.check_fused_cross_entropy_trainable_head(device, torch.float32) < 1e-5

    def scaled_by_mistake(head, hidden, labels):
        return 1.1 * fastpath.fused_cross_entropy(head, hidden, labels)

    wrong = selfcheck.check_fused_cross_entropy_trainable_head(
        device, torch.float32, kernel=scaled_by_mistake
    )
    assert wrong > 0.05


def test_the_chunk_loop_is_the_fp32_loss_and_gradient_over_uneven_chunks():
    """The kit's loop over Liger's kernel (stood in for by ``cpu_rows_kernel``): Liger's chunk sizes, the last
    chunk short, the same summed loss and hidden states' gradient as eager fp32 cross-entropy."""
    from tests.cpu_liger import cpu_rows_kernel

    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16), torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    seen = []

    def counting(logits, rows_labels, losses):
        seen.append(len(rows_labels))
        cpu_rows_kernel(logits, rows_labels, losses)

    loss, grad = frozen_head_loss.chunked_forward(counting)(hidden, weight, labels, chunk_mem_const=1)
    assert seen == [16, 16, 5]  # 50 / 16 -> 4 chunks' worth, rounded to 16 rows as Liger does
    h = hidden.clone().requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(h @ weight.t(), labels, reduction="sum")
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-6) and torch.allclose(grad, h.grad, atol=1e-6)
    _, whole = frozen_head_loss.chunked_forward(cpu_rows_kernel)(hidden, weight, labels, chunk_mem_const=64)
    assert torch.allclose(whole, grad, atol=1e-6)  # one chunk when the budget allows


def test_the_chunk_loop_never_asks_the_host_how_many_targets(monkeypatch):
    """Liger's own forward reads the count of targets with ``.item()``, a device sync mid-step on a GPU; the
    kit's loop, under the frozen head's node and in lent memory, asks the host nothing."""
    from tests.cpu_liger import cpu_rows_kernel

    monkeypatch.setattr(fastpath, "_flce_forward", lambda: frozen_head_loss.chunked_forward(cpu_rows_kernel))
    head, hidden, labels = batch()
    asked = []

    def recording(name):
        real = getattr(torch.Tensor, name)
        return lambda self: asked.append(self) or real(self)

    monkeypatch.setattr(torch.Tensor, "item", recording("item"))
    monkeypatch.setattr(torch.Tensor, "tolist", recording("tolist"))
    backend = ReplayOnCpu()
    lent = loss_and_grad(
        lambda h, x, y: fastpath.fused_cross_entropy(h, x, y, lend=backend.run_in_free_memory),
        head,
        hidden,
        labels,
    )
    assert asked == [] and backend.lent == 1
    monkeypatch.undo()
    reference = loss_and_grad(fastpath.reference_cross_entropy, head, hidden, labels)
    assert torch.allclose(lent[0], reference[0], rtol=1e-6)
    assert torch.allclose(lent[1], reference[1], atol=1e-7)


def test_the_chunk_loop_only_where_its_logits_are_autocasts():
    """``torch.mm(out=)`` escapes autocast: the loop runs where the inputs' dtype is what autocast would give,
    and Liger's own forward elsewhere (an fp32 head under bf16 autocast)."""
    bf16, fp32 = torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2)
    assert frozen_head_loss.same_logits_dtype(bf16, bf16) and frozen_head_loss.same_logits_dtype(fp32, fp32)
    assert not frozen_head_loss.same_logits_dtype(bf16, fp32)
    assert not frozen_head_loss.same_logits_dtype(bf16.long(), bf16.long())
