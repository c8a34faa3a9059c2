"""CUDA graphs over offloaded checkpointed layers (trainer/fastpath/layer_graphs.py), checked on CPU.

A CPU has no CUDA graphs, so ``ReplayOnCpu`` stands in for the device side: capturing keeps the recorded
function and a replay runs it again. That keeps what a graph would get wrong wrong here too: a replay reads the
tensors the capture saw (the static ones), never the call's own, so a batch not copied in, a side input left
stale or a gradient not accumulated shows up as a wrong loss or gradient against the eager layers.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fastpath.test_fastpath import ALL_LINEAR, checkpointed_llama, rel_err
from trainer.fastpath import layer_graphs, offload
from trainer.fastpath.patch import patch_lora_linears


class ReplayOnCpu:
    """The device side of ``LayerGraphs`` on a CPU: ``capture`` records, ``replay`` runs the recording."""

    def __init__(self, fail: bool = False, fail_after: int | None = None) -> None:
        self.captured = 0
        self.fail = fail
        self.fail_after = fail_after  # captures that succeed before every later one fails
        self.released = False
        self.lent = 0  # calls of run_in_free_memory

    def capture(self, body):
        if self.fail or (self.fail_after is not None and self.captured >= self.fail_after):
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        return types.SimpleNamespace(replay=body)

    def release(self) -> None:
        self.released = True

    def run_in_free_memory(self, compute):
        """The pool's lent memory: ``compute()``'s results copied out, then written over as the next replay
        would write over the pool, so a later read of lent memory shows up as NaN losses."""
        if not self.lent:
            print("CPU graphs: the loss computes in the pool's free memory", flush=True)
        self.lent += 1
        results = compute()
        copies = tuple(t.clone() for t in results)
        for t in results:
            t.fill_(float("nan"))
        return copies


def train(model, batches, autocast: bool, graphs=None, steps_per_update: int = 2, lr: float = 0.5):
    """A few optimizer steps of SGD over ``batches`` (accumulating ``steps_per_update`` micro-batches each);
    returns the losses and the final LoRA weights."""
    if graphs is not None or not hasattr(model, offload.ATTRIBUTE):
        offload.offload_checkpointed_layers(model, graphs)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    from trainer.fastpath.lora_ops import track_updates

    track_updates(optimizer)
    losses = []
    for i, (ids, positions) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss
        (loss / steps_per_update).backward()
        losses.append(float(loss))
        if (i + 1) % steps_per_update == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return losses, [p.detach().clone() for p in params]


def packed_batches(n: int, seed: int = 0):
    """``n`` micro-batches of one shape whose rows hold documents of varying lengths (restarting positions),
    so the attention mask the layers get differs from batch to batch."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, 1024, (2, 24), generator=generator)
        cut = int(torch.randint(4, 20, (1,), generator=generator))
        positions = torch.cat([torch.arange(cut), torch.arange(24 - cut)]).repeat(2, 1)
        batches.append((ids, positions))
    return batches


def fused_llama(write_config):
    model = checkpointed_llama(write_config)
    fused, _ = patch_lora_linears(model)  # the fast path's LoRA nodes, whose casts the graphs must record
    assert fused == 2 * len(ALL_LINEAR)
    return model


@pytest.mark.parametrize("autocast,alias", [(False, False), (True, False), (True, True)])
def test_graphed_layers_train_as_the_eager_ones(write_config, autocast, alias):
    """Six micro-batches, three optimizer steps: the graphs are captured at each layer's second call, then
    replayed with new batches, new masks, accumulated gradients and weights the optimizer changed; also where
    the backward graphs read views of the parameters (as under DDP, ``reading_views``)."""
    batches = packed_batches(6)
    eager_losses, eager_weights = train(fused_llama(write_config), batches, autocast)
    backend = ReplayOnCpu()
    graphs = layer_graphs.LayerGraphs(backend, alias_params=alias)
    losses, weights = train(fused_llama(write_config), batches, autocast, graphs)
    assert backend.captured == 2 * 2, "a forward and a backward graph for each of the two layers"
    assert graphs.off is None and graphs.describe()["graphs"] == 4
    tolerance = 2e-2 if autocast else 1e-6
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < tolerance * max(eager_losses)
    for got, want in zip(weights, eager_weights):
        assert rel_err(got, want) < tolerance
    assert len(set(losses)) == len(losses)  # the replays saw each batch, not the captured one


def test_replays_read_each_batch_not_the_captured_one(write_config):
    """The loss of a replayed forward follows its own batch: graphed and eager agree batch by batch, also where
    only the side input (the mask of another document split) changes."""
    model = fused_llama(write_config)
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    offload.offload_checkpointed_layers(model, graphs)
    ids = torch.randint(3, 1024, (2, 24))
    splits = [torch.cat([torch.arange(c), torch.arange(24 - c)]).repeat(2, 1) for c in (6, 6, 12, 18)]
    got = []
    for positions in splits:
        loss = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss
        loss.backward()
        got.append(float(loss))
    assert graphs.captured == 4
    reference = checkpointed_llama(write_config)
    reference.load_state_dict(model.state_dict())
    want = [float(reference(input_ids=ids, labels=ids, position_ids=p, use_cache=False).loss) for p in splits]
    assert got == pytest.approx(want, rel=1e-6)
    assert got[2] != got[1] and got[3] != got[2]


def gradients_asked_for(monkeypatch) -> list:
    """Every ``torch.autograd.grad`` call's inputs from now on (the graphs' backward bodies ask through it)."""
    asked = []
    grad = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        asked.append(list(inputs))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    return asked


def assert_views_of_parameters_only(model, asked: list) -> None:
    """Each call asked for gradients of views of the trainable parameters, never of the parameters."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    for inputs in asked:
        views = [t for t in inputs if t._base is not None and id(t._base) in trainable]
        assert views and not any(id(t) in trainable for t in inputs)


def test_under_ddp_the_backward_graph_asks_for_gradients_of_views_made_in_it_not_of_the_parameters(
    write_config, monkeypatch
):
    """DDP keeps each parameter's gradient accumulator from before any capture, on the default stream; asking
    for the parameters' gradients inside a capture makes that stream wait on the capturing one, which ends the
    capture. With several processes the graph asks for the gradients of views made inside it instead, and the
    layer's parameters are its own again afterwards."""
    model = fused_llama(write_config)
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    offload.offload_checkpointed_layers(model, graphs)
    monkeypatch.setattr(layer_graphs, "several_processes", lambda: True)
    asked = gradients_asked_for(monkeypatch)
    ids = torch.randint(3, 1024, (2, 24))
    for _ in range(3):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert graphs.captured == 4 and asked
    assert_views_of_parameters_only(model, asked)
    layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    assert all(type(p) is torch.nn.Parameter for p in layer.parameters())


def test_a_failed_capture_leaves_every_layer_eager(write_config, capsys):
    batches = packed_batches(4)
    eager_losses, eager_weights = train(fused_llama(write_config), batches, False)
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu(fail=True))
    told = []
    graphs.on_change = lambda state, detail: told.append((state, detail))
    losses, weights = train(fused_llama(write_config), batches, False, graphs)
    assert graphs.captured == 0 and "operation not permitted" in graphs.off
    assert told == [("off", graphs.off)]
    assert "CUDA graphs are off" in capsys.readouterr().err
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(weights, eager_weights))


def test_a_capture_failing_after_others_drops_those_graphs_and_gives_their_memory_back(write_config):
    """As under DDP before views (2x H200): every forward graph captured, then the first backward capture
    failed. The forward graphs are never replayed after that, so their pool goes back; training is eager."""
    batches = packed_batches(4)
    eager_losses, _ = train(fused_llama(write_config), batches, False)
    backend = ReplayOnCpu(fail_after=2)  # the two layers' forward graphs
    graphs = layer_graphs.LayerGraphs(backend, alias_params=False)
    losses, _ = train(fused_llama(write_config), batches, False, graphs)
    assert backend.captured == 2 and "operation not permitted" in graphs.off
    assert backend.released and graphs.captured == 0 and graphs.statics is None
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    never = ReplayOnCpu(fail=True)
    train(fused_llama(write_config), batches, False, layer_graphs.LayerGraphs(never))
    assert not never.released  # nothing was captured, nothing to give back


def test_layers_with_dropout_or_hooks_stay_eager(write_config):
    model = fused_llama(write_config)
    layers = model.base_model.model.model.layers
    layers[0].self_attn.attention_dropout = 0.1
    layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "attention dropout" in layer_graphs.why_eager(layers[0])
    assert "hooks on mlp" in layer_graphs.why_eager(layers[1])
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    train(model, packed_batches(4), False, graphs)
    assert graphs.captured == 0 and graphs.off is None
    assert len(graphs.describe()["eager_layers"]) == 2


def test_a_second_shape_runs_eagerly_beside_the_captured_one(write_config):
    model = fused_llama(write_config)
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    batches = packed_batches(4)
    short = [(ids[:, :16], positions[:, :16]) for ids, positions in packed_batches(2, seed=1)]
    losses, _ = train(model, batches + short, False, graphs)
    eager_losses, _ = train(fused_llama(write_config), batches + short, False)
    assert graphs.captured == 4
    assert losses == pytest.approx(eager_losses, rel=1e-6)


def test_graph_gradients_accumulate_into_whatever_grad_holds():
    """The buffers a backward graph adds into become ``.grad``: from nothing (zero_grad set it to None), from
    a gradient an eager backward left, and on top of themselves."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    buffers = [torch.full((3,), 7.0), torch.full((2,), 7.0)]
    params[1].grad = torch.full((2,), 2.0)
    layer_graphs.adopt_grads(params, buffers)
    assert params[0].grad is buffers[0] and params[1].grad is buffers[1]
    assert params[0].grad.tolist() == [0.0] * 3 and params[1].grad.tolist() == [2.0, 2.0]
    buffers[1].add_(1.0)  # what a replay does
    layer_graphs.adopt_grads(params, buffers)
    assert params[1].grad.tolist() == [3.0, 3.0]


def test_graphs_record_the_lora_casts_not_the_cached_copies(write_config, monkeypatch):
    """A cast cached before a capture would be replayed as that one tensor forever, though the cache makes new
    copies after each optimizer step: inside a graph every cast is computed (``lora_ops.inline_casts``)."""
    from trainer.fastpath import lora_ops

    seen, replaying = [], [False]
    real_cast = lora_ops.cast
    monkeypatch.setattr(
        lora_ops, "cast", lambda p, d: seen.append((replaying[0], lora_ops._inline)) or real_cast(p, d)
    )

    class Flagged(ReplayOnCpu):
        def capture(self, body):
            def replay():
                replaying[0] = True
                try:
                    body()
                finally:
                    replaying[0] = False

            self.captured += 1
            return types.SimpleNamespace(replay=replay)

    graphs = layer_graphs.LayerGraphs(Flagged())
    train(fused_llama(write_config), packed_batches(4), True, graphs)
    assert graphs.captured == 4
    in_graphs = [inline for replayed, inline in seen if replayed]
    assert in_graphs and all(in_graphs)
    assert not any(inline for replayed, inline in seen if not replayed)
    weight = torch.nn.Parameter(torch.ones(2))
    with lora_ops.inline_casts():
        first, second = real_cast(weight, torch.bfloat16), real_cast(weight, torch.bfloat16)
    assert first is not second and getattr(weight, "_kit_cast", None) is None


def lora_run(checkpointing: bool, save_steps: int) -> dict:
    """Four fp32 LoRA steps on every linear layer of the tiny Llama: the graphed runs' config."""
    return {
        "training": {"method": "lora", "max_steps": 4, "save_steps": save_steps},
        "lora": {"target_modules": ALL_LINEAR},
        "memory": {"gradient_checkpointing": checkpointing},
        "model": {"dtype": "fp32"},
        "eval": {"interval": 100},
    }


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_run_with_graphed_layers_logs_the_losses_of_an_eager_run(tmp_path, checkpointing):
    """The whole loop (accumulation, clipping, zero_grad, the cast cache's refresh after each step, checkpoints)
    on graphed layers: ``tests.fast_path_on_cpu`` with KIT_TEST_CPU_GRAPHS=1 forces the fast path and the graphs
    on a CPU; the same run with ``performance.cuda_graphs: off`` gives the same losses. Checkpointed layers
    replay through ``layer_graphs``, the whole stack without checkpointing through ``stack_graphs``."""
    import subprocess
    import sys

    from tests.helpers import REPO, trainer_env
    from tests.training.test_fsdp import assert_same_losses, fast_path_report, llama_config, losses

    extra = lora_run(checkpointing, save_steps=2)
    runs, printed = {}, {}
    for name, graphs in (("graphed", "auto"), ("eager", "off")):
        cfg, runs[name] = llama_config(tmp_path, name, {**extra, "performance": {"cuda_graphs": graphs}})
        result = subprocess.run(
            [sys.executable, "-m", "tests.fast_path_on_cpu", "train", "--config", str(cfg)],
            cwd=REPO, env={**trainer_env(), "KIT_TEST_CPU_GRAPHS": "1"}, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        printed[name] = result.stdout
    assert "replay from graphs now" in printed["graphed"]
    assert "replay from graphs" not in printed["eager"]
    lent = "the loss computes in the pool's free memory"  # checkpointed layers' graphs only (loss_in_pool)
    assert (lent in printed["graphed"]) is checkpointing and lent not in printed["eager"]
    from trainer import runfolder
    from trainer.runfolder import iter_records

    said = [
        e
        for e in iter_records(runs["graphed"] / "logs" / runfolder.EVENTS_LOG)
        if e["event"] == "cuda_graphs"
    ]
    assert [e["state"] for e in said] == ["replaying"] and "hidden states" in said[0]["detail"]
    graphed, eager = (fast_path_report(runs[n]) for n in ("graphed", "eager"))
    if checkpointing:
        assert graphed["cuda_graphs"] == "layers" and graphed["offloaded_layers"] == 2, graphed
    else:
        assert graphed["cuda_graphs"] == "layer stack" and graphed["offloaded_layers"] == 0, graphed
    assert eager["cuda_graphs"] == "off: performance.cuda_graphs: off", eager
    assert_same_losses(losses(runs["graphed"]), losses(runs["eager"]))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [True, False])
def test_two_ddp_ranks_replaying_graphs_average_the_gradients_the_graphs_add(tmp_path, checkpointing):
    """A graph adds its gradients straight into ``.grad``, unseen by DDP's hooks. By default (``cuda_graphs:
    auto``), two LoRA ranks whose gradients are averaged once after each step (``memory.oom_fallback``, the
    default) replay their layers from graphs (the CPU stand-in; checkpointed layers, or the whole stack) on
    views of their parameters, and train the losses of one eager process over the same rows: a rank that
    stepped on its own gradients alone would drift from them after the first step."""
    import subprocess

    from tests.helpers import REPO, run_trainer
    from tests.training.test_fsdp import (
        assert_same_losses,
        fast_path_report,
        llama_config,
        losses,
        two_process_command,
        two_process_env,
    )

    extra = lora_run(checkpointing=checkpointing, save_steps=4)
    one_cfg, one = llama_config(tmp_path, "one", {**extra, "performance": {"cuda_graphs": "off"}})
    assert run_trainer("train", "--config", str(one_cfg)).returncode == 0
    two_cfg, two = llama_config(tmp_path, "two", extra)
    command = two_process_command(two_cfg)
    at = command.index("trainer")
    command[at - 1 : at + 1] = ["-m", "tests.fast_path_on_cpu"]
    env = {**two_process_env(), "KIT_TEST_CPU_GRAPHS": "1"}
    ranks = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "replay from graphs now" in ranks.stdout
    assert fast_path_report(two)["cuda_graphs"] == ("layers" if checkpointing else "layer stack")
    assert_same_losses(losses(two), losses(one))


def test_both_forms_of_transformers_checkpointed_call_are_recognised(capsys):
    """transformers has wrapped the layer's forward (``partial(forward, layer, **kw)``) and its ``__call__``
    (``partial(super().__call__, **kw)``, a bound method); anything else turns the graphs off, saying so."""
    import functools

    layer = torch.nn.Linear(2, 2)
    assert layer_graphs.layer_of(functools.partial(torch.nn.Linear.forward, layer)) == (
        layer,
        torch.nn.Linear.forward,
    )
    found, func = layer_graphs.layer_of(functools.partial(super(torch.nn.Linear, layer).__call__))
    assert found is layer and func is torch.nn.Module.__call__
    graphs = layer_graphs.LayerGraphs(ReplayOnCpu())
    x = torch.ones(1, 2)
    assert graphs.plan(lambda h: h, (), {}, x, {}) is None
    assert "not a layer's forward" in graphs.off and "CUDA graphs are off" in capsys.readouterr().err


def test_each_shape_gets_its_eager_warm_up_before_a_capture(write_config):
    """A first micro-batch of another shape does not count as the warm-up of the shape captured later: its
    first call runs eagerly (Triton tunes there), its second is captured."""
    model = fused_llama(write_config)
    backend = ReplayOnCpu()
    graphs = layer_graphs.LayerGraphs(backend)
    short = [(ids[:, :16], positions[:, :16]) for ids, positions in packed_batches(1, seed=1)]
    train(model, short + packed_batches(1), False, graphs, steps_per_update=1)
    assert backend.captured == 0
    train(model, packed_batches(1, seed=2), False, graphs, steps_per_update=1)
    assert backend.captured == 4


def test_a_capture_failing_mid_step_leaves_the_rest_of_that_step_eager(write_config):
    """Calls planned before a capture failed (the other layers of that forward, their backward) run eagerly
    and give the eager gradients; nothing is captured after the failure."""

    class FailsThird(ReplayOnCpu):
        def capture(self, body):
            if self.captured == 2:  # both layers' forward graphs, then the first backward capture fails
                raise RuntimeError("capture failed")
            return super().capture(body)

    batches = packed_batches(4)
    eager_losses, eager_weights = train(fused_llama(write_config), batches, False)
    backend = FailsThird()
    graphs = layer_graphs.LayerGraphs(backend)
    losses, weights = train(fused_llama(write_config), batches, False, graphs)
    assert backend.captured == 2 and graphs.off and graphs.captured == 0
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(weights, eager_weights))


def test_where_the_graphs_apply_and_what_on_insists_on():
    from trainer.fastpath import FastPathUnavailable, graphs_unavailable

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_unavailable("auto", cuda, offload=True, processes=1) is None
    assert graphs_unavailable("off", cuda, True, 1) == "performance.cuda_graphs: off"
    assert graphs_unavailable("auto", cpu, True, 1) == "not a CUDA device"
    assert graphs_unavailable("auto", cuda, True, 1, fast=False) == "the fast path is off"
    assert "offloaded inputs" in graphs_unavailable("auto", cuda, False, 1, checkpointing=True)
    assert graphs_unavailable("auto", cuda, False, 1) is None  # no checkpointing: the whole layer stack
    assert "data.packing: false" in graphs_unavailable("auto", cuda, False, 1, packing=False)
    assert graphs_unavailable("auto", cuda, True, 1, checkpointing=True, packing=False) is None  # one layer's
    assert "DDP's gradient hooks" in graphs_unavailable("auto", cuda, True, 2)
    # gradients averaged once after the step: several processes replay graphs, checkpointed or not
    assert graphs_unavailable("auto", cuda, True, 2, checkpointing=True, grads_synced_after_step=True) is None
    assert graphs_unavailable("auto", cuda, False, 2, grads_synced_after_step=True) is None
    assert graphs_unavailable("on", cuda, True, 2, checkpointing=True, grads_synced_after_step=True) is None
    with pytest.raises(FastPathUnavailable, match="cuda_graphs: on, but 2 processes"):
        graphs_unavailable("on", cuda, True, 2)
    # MoE layers run eagerly, checkpointed or not
    assert "mixture-of-experts" in graphs_unavailable("auto", cuda, False, 1, routed_experts=True)
    assert "mixture-of-experts" in graphs_unavailable("auto", cuda, True, 1, True, True, routed_experts=True)
    with pytest.raises(FastPathUnavailable, match="cuda_graphs: on, but mixture-of-experts"):
        graphs_unavailable("on", cuda, False, 1, routed_experts=True)


@pytest.mark.parametrize("model, routed", [("tiny-moe", True), ("tiny-llama", False)])
def test_loading_tells_the_graphs_whether_the_model_routes_experts(write_config, monkeypatch, model, routed):
    """The embedded default's tiny MoE reaches ``graphs_unavailable`` as a model with routers."""
    from tests.helpers import REPO
    from trainer import fastpath
    from trainer.config import load_config
    from trainer.model.loading import load_for_training

    seen = []
    real = fastpath.graphs_unavailable
    monkeypatch.setattr(fastpath, "graphs_unavailable", lambda *a: seen.append(a[-1]) or real(*a))
    cfg = load_config(
        write_config({"model": {"name_or_path": str(REPO / "configs" / model), "random_init": True}})
    )
    load_for_training(cfg, torch.device("cpu"))
    assert seen == [routed]


@pytest.mark.parametrize("model", ["llama", "gla", "mamba"])
def test_cuda_graphs_on_where_they_cannot_apply_stops_the_run_with_one_line(write_config, model):
    from tests.helpers import REPO, run_trainer

    extra = {"performance": {"cuda_graphs": "on"}, "training": {"max_steps": 1}}
    if model != "llama":
        extra["model"] = {"name_or_path": str(REPO / "configs" / f"tiny-{model}")}
    result = run_trainer("train", "--config", str(write_config(extra)))
    assert result.returncode == 2, result.stderr[-2000:]
    expected = "the mamba family's layers are not graphed" if model == "mamba" else "not a CUDA device"
    assert "performance.cuda_graphs: on, but" in result.stderr and expected in result.stderr


def test_a_family_run_without_packing_keeps_its_stack_eager(write_config):
    """The config's data.packing reaches the decision (GLA, no checkpointing, its kernels checked on a GPU)."""
    from tests.helpers import REPO
    from trainer.config import load_config
    from trainer.families.gla import GLA
    from trainer.model.loading import family_graphs_unavailable

    def reason(packing: bool):
        cfg = load_config(
            write_config(
                {
                    "model": {"name_or_path": str(REPO / "configs" / "tiny-gla")},
                    "data": {"packing": packing},
                    "memory": {"gradient_checkpointing": False},
                }
            )
        )
        return family_graphs_unavailable(cfg, GLA, torch.device("cuda"), checked=True)

    assert reason(True) is None
    assert "data.packing: false" in reason(False)
