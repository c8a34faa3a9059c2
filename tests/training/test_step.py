"""The step's pieces on their own: the micro-batch loss takes the family's inputs, rows feed micro-batches."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from trainer.data.dataset import Sequence, collate
from trainer.training.step import FullCrossEntropy, StepShape, count_targets, micro_batches, reference_kernels


class CpuAccelerator:
    device = torch.device("cpu")

    @staticmethod
    def autocast():
        return contextlib.nullcontext()


class TinyLM(torch.nn.Module):
    """Embedding + head; takes only ``input_ids``, as a family whose inputs differ from causal LMs' might."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def test_loss_uses_the_family_picked_at_set_up():
    """Kernels are picked once from the loaded family: its model_inputs shape every micro-batch's forward."""
    calls = []

    def only_ids(batch):
        calls.append(sorted(batch))
        return {"input_ids": batch["input_ids"]}

    family = SimpleNamespace(model_inputs=only_ids)
    model = TinyLM()
    kernels = reference_kernels(model, family)
    assert isinstance(kernels.loss, FullCrossEntropy) and kernels.prepare(model) is model
    batch = collate(
        [Sequence([1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3]), Sequence([5, 6], [-100, 6], [0, 1])], 0
    )
    ce_sum, aux = kernels.loss(model, batch, CpuAccelerator())
    logits = model(batch["input_ids"]).logits[:, :-1]
    expected = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    assert (
        len(calls) == 1 and "position_ids" in calls[0]
    )  # the family saw the whole batch, took what it needs
    assert aux is None and torch.allclose(ce_sum, expected)
    assert count_targets(batch) == 4  # 3 in the first row, 1 in the second (its first label is masked)


def test_micro_batches_interleave_ranks_and_split_rows():
    data = [Sequence([i] * 8, [i] * 8, list(range(8))) for i in range(8)]
    rows = list(range(8))
    rank1 = micro_batches(rows, data, StepShape(2, 2), world=2, rank=1, pad_id=0)
    assert [b["input_ids"][:, 0].tolist() for b in rank1] == [[2, 3], [6, 7]]  # slices 1 and 3 of 4
    split = micro_batches(rows[:2], data, StepShape(1, 2, split_length=3), world=1, rank=0, pad_id=0)
    assert [b["input_ids"].shape[1] for b in split] == [3, 3, 2, 3, 3, 2]  # every token kept, one piece each


class CountingAccelerator(CpuAccelerator):
    """Two ranks' bookkeeping on one process: records which micro-batches skip the gradient sync."""

    num_processes, process_index = 2, 0

    def __init__(self, distributed_type):
        self.distributed_type, self.skipped = distributed_type, 0

    def reduce(self, tensor, op):
        return tensor * 2

    @contextlib.contextmanager
    def no_sync(self, model):
        self.skipped += 1
        yield

    def backward(self, loss):
        loss.backward()


def test_fsdp_syncs_every_micro_batch_where_ddp_syncs_only_the_last():
    """DDP all-reduces once per step (no_sync before); FSDP reduce-scatters each micro-batch, since no_sync
    would hold every rank's whole unsharded gradients through the accumulation."""
    from accelerate.utils import DistributedType

    from trainer.training.step import Step

    rows = [Sequence([1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3]) for _ in range(8)]
    counter = SimpleNamespace(start_micro_batch=lambda mask: None)
    family = SimpleNamespace(model_inputs=lambda batch: {"input_ids": batch["input_ids"]})
    skipped = {}
    for kind in (DistributedType.MULTI_GPU, DistributedType.FSDP):
        model = TinyLM()
        accelerator = CountingAccelerator(kind)
        step = Step(model, accelerator, reference_kernels(model, family).loss, counter, 0.0, rows, 0)
        step(list(range(8)), StepShape(micro=1, accum=4))
        skipped[kind] = accelerator.skipped
    assert skipped == {DistributedType.MULTI_GPU: 3, DistributedType.FSDP: 0}


class TinyHeadLM(TinyLM):
    """TinyLM with its head found where the loss looks (``get_output_embeddings``), its output converted to
    fp32 as accelerate's ``convert_outputs_to_fp32`` does under bf16 mixed precision."""

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)).float())


def test_the_head_loss_gets_the_heads_own_input_not_the_fp32_copy_of_the_output():
    """Under mixed precision the forward's outputs come back in fp32: the loss takes the tensor the head was
    handed (bf16 here), not a copy of twice its size, and the loss is the same."""
    from trainer.training.step import HeadLoss

    model = TinyHeadLM().to(torch.bfloat16)
    seen = []

    def head_loss(head, hidden, labels):
        seen.append(hidden)
        return F.cross_entropy(
            head(hidden[:, :-1]).float().reshape(-1, 11), labels[:, 1:].reshape(-1), reduction="sum"
        )

    batch = collate([Sequence([1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3])], 0)
    loss = HeadLoss(lambda b: {"input_ids": b["input_ids"]}, head_loss)
    ce_sum, _ = loss(model, batch, CpuAccelerator())
    assert seen[0].dtype == torch.bfloat16 and seen[0].shape == (1, 4, 8)
    assert torch.equal(seen[0], model.embed(batch["input_ids"]))
    expected = head_loss(model.head, model.embed(batch["input_ids"]), batch["labels"])
    assert torch.equal(ce_sum, expected)
    ce_sum.backward()
    assert model.embed.weight.grad is not None  # the gradient reaches the model through the head's input


def test_a_prefetched_step_trains_as_one_built_on_the_spot():
    """``Step.prefetch`` builds the next step's batches while the GPU works; the call with the same rows and shape
    takes them (the same gradients as building them then), any other call builds its own."""
    from trainer.training.step import Step

    data = [Sequence([i, i + 1, i + 2, i + 3], [i, i + 1, i + 2, i + 3], [0, 1, 2, 3]) for i in range(8)]
    counter = SimpleNamespace(start_micro_batch=lambda mask: None)
    family = SimpleNamespace(model_inputs=lambda batch: {"input_ids": batch["input_ids"]})
    accelerator = CountingAccelerator("one")
    accelerator.num_processes = 1
    grads = []
    for prefetch in (False, True):
        torch.manual_seed(0)
        model = TinyLM()
        step = Step(model, accelerator, reference_kernels(model, family).loss, counter, 0.0, data, 0)
        if prefetch:
            step.prefetch([0, 1, 2, 3], StepShape(2, 2))
            step.batches = None  # the call below must not build any
        result = step([0, 1, 2, 3], StepShape(2, 2))
        grads.append([p.grad.clone() for p in model.parameters()])
        assert step.prefetched is None and result.target_count == 12
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    step = Step(model, accelerator, reference_kernels(model, family).loss, counter, 0.0, data, 0)
    step.prefetch([0, 1, 2, 3], StepShape(2, 2))
    built = []
    step.batches = lambda rows, shape: built.append(rows) or Step.batches(step, rows, shape)
    step([4, 5, 6, 7], StepShape(2, 2))  # other rows (an OOM fallback's retry would bring another shape)
    assert built == [[4, 5, 6, 7]] and step.prefetched is None


def test_a_host_tensor_bound_for_a_gpu_is_pinned_first():
    """Copies from pageable memory go through the driver's staging on the host's time: the kit pins first."""
    from trainer.data.batches import pinned_for, to_device

    host = torch.arange(4)
    assert pinned_for(host, torch.device("cuda")) and pinned_for(host, "cuda:1")
    assert not pinned_for(host, torch.device("cpu"))
    assert to_device(host, torch.device("cpu")) is host  # nothing to copy on the CPU
