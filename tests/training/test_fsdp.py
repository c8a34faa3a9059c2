"""FSDP2 (training.distributed: fsdp): config rules, the wrapping policy, 4-bit storage, the planner's per-GPU
figure, and real runs of two CPU processes (gloo) against one process over the same rows."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from tests.helpers import REPO, TINY, deep_merge, run_trainer, trainer_env, wait_for
from trainer import runfolder
from trainer.config import ConfigError, load_config
from trainer.runfolder import iter_records, last_per_step
from trainer.training import fsdp

# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.family=gla"], "model.family: the gla family runs its own kernels"),
        (
            ["lora.target_parameters=null", "lora.init=lora_ga"],
            "lora.init: lora_ga prepares the adapters from whole base weights",
        ),
        (["training.mixed_precision=fp16"], "training.mixed_precision: fp16's loss scaling"),
        (
            ["optimization.optimizer=paged_adamw_8bit"],
            "optimization.optimizer: paged_adamw_8bit: bitsandbytes' optimizers cannot step FSDP's sharded",
        ),
        (
            ["fsdp.activation_checkpointing=true", "memory.gradient_checkpointing=true"],
            "fsdp.activation_checkpointing: recomputes every decoder layer",
        ),
        (["fsdp.wrap_classes=LlamaDecoderLayer"], "fsdp.wrap_classes: expected a list of strings or null"),
        (["fsdp.cpu_offlaod=true"], "unknown key 'fsdp.cpu_offlaod' (did you mean 'cpu_offload'?)"),
    ],
)
def test_fsdp_combinations_that_cannot_work_are_one_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "training_config.yaml", ["training.distributed=fsdp", *overrides])
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_ddp_is_the_default_and_the_fsdp_section_is_ignored_there():
    cfg = load_config(REPO / "training_config.yaml", ["fsdp.activation_checkpointing=true"])
    assert cfg.training.distributed == "ddp"
    with pytest.raises(ConfigError, match="training.distributed: expected one of 'ddp', 'fsdp'"):
        load_config(REPO / "training_config.yaml", ["training.distributed=zero3"])


def test_plugin_carries_the_fsdp_section():
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    cfg = load_config(
        REPO / "training_config.yaml",
        [
            "training.distributed=fsdp",
            "fsdp.reshard_after_forward=false",
            "fsdp.cpu_offload=true",
        ],
    )
    plugin = fsdp.make_plugin(cfg)
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.activation_checkpointing is False


# ---------------------------------------------------------------- wrapping


def tiny_causal_lm(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type, layer", [("llama", "LlamaDecoderLayer"), ("qwen3", "Qwen3DecoderLayer")]
)
def test_wrapping_takes_the_decoder_layer_class_also_through_peft(model_type, layer):
    from peft import LoraConfig, get_peft_model

    model = tiny_causal_lm(model_type)
    assert fsdp.wrap_classes(model) == [layer]
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert fsdp.wrap_classes(peft_model) == [layer]


def test_wrap_classes_named_in_the_config_must_exist():
    model = tiny_causal_lm("llama")
    assert fsdp.wrap_classes(model, ["LlamaMLP"]) == ["LlamaMLP"]
    with pytest.raises(
        fsdp.FsdpError, match="fsdp.wrap_classes: no module of class LlamaLayer .*LlamaDecoderLayer"
    ):
        fsdp.wrap_classes(model, ["LlamaLayer"])
    with pytest.raises(fsdp.FsdpError, match="names no decoder-layer class"):
        fsdp.wrap_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ---------------------------------------------------------------- 4-bit storage


def test_qlora_storage_is_the_compute_dtype_under_fsdp_only():
    from trainer.model.loading import quant_storage

    ddp = load_config(REPO / "training_config.yaml", ["quantization.compute_dtype=fp16"])
    sharded = load_config(
        REPO / "training_config.yaml", ["quantization.compute_dtype=fp16", "training.distributed=fsdp"]
    )
    assert quant_storage(ddp) == torch.uint8
    assert quant_storage(sharded) == torch.float16
    # bf16 mixed precision gathers every weight as bf16: fp32 storage would be converted, not passed through
    mixed = load_config(
        REPO / "training_config.yaml",
        ["quantization.compute_dtype=fp32", "training.mixed_precision=bf16", "training.distributed=fsdp"],
    )
    assert quant_storage(mixed) == torch.bfloat16


def test_packed_experts_become_frozen_parameters_that_dequantize_alike():
    """FSDP shards parameters, not buffers: under FSDP the experts' packed bytes are floating parameters."""
    from trainer.moe_quant import QuantizedExpertWeights

    weight = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0))
    as_bytes = QuantizedExpertWeights(weight, "nf4", True)
    as_floats = QuantizedExpertWeights(weight, "nf4", True, torch.float32)
    assert list(as_bytes.parameters()) == []
    params = list(as_floats.parameters())
    assert len(params) == 3 and all(p.dtype == torch.float32 and not p.requires_grad for p in params)
    assert as_floats.stored_bytes() == as_bytes.stored_bytes()
    for i in range(3):
        assert torch.equal(as_floats[i], as_bytes[i])
        # NF4 on Gaussian weights: ~0.36 of the mean |w| (bitsandbytes, CPU); unrelated values would give ~1.4
        assert (as_floats[i] - weight[i]).abs().mean() < 0.5 * weight[i].abs().mean()


def test_a_frozen_embedding_is_not_gathered_again_in_backward(tmp_path):
    """One gloo process is enough for fully_shard: the frozen, untied embedding is marked to stay sharded in
    backward (FSDP2 would gather it for nothing: it computes no gradient), and LoRA's gradients are those of
    the unsharded model; a trainable or tied embedding is left alone."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    def sharded_lora(tied: bool):
        torch.manual_seed(0)
        base = tiny_causal_lm("llama")
        if tied:
            base.lm_head.weight = base.model.embed_tokens.weight
        model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        return model

    ids = torch.tensor([[1, 5, 9, 3, 7]])
    reference = sharded_lora(False)
    reference(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.requires_grad}

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = sharded_lora(False)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model.get_input_embeddings())
        fully_shard(model)
        assert fsdp.after_prepare(model)
        groups = model.get_input_embeddings()._get_fsdp_state()._fsdp_param_groups
        assert [g.unshard_in_backward for g in groups] == [False]
        model(input_ids=ids, labels=ids).loss.backward()
        for name, param in model.named_parameters():
            if param.requires_grad:
                assert torch.allclose(param.grad.full_tensor(), expected[name], atol=1e-6), name

        trainable = sharded_lora(False)
        trainable.get_input_embeddings().weight.requires_grad_(True)
        fully_shard(trainable.get_input_embeddings())
        assert not fsdp.after_prepare(trainable)
        tied = sharded_lora(True)  # one unit with the head, as accelerate groups tied weights
        fully_shard([tied.get_input_embeddings(), tied.get_output_embeddings()])
        assert not fsdp.after_prepare(tied)
    finally:
        dist.destroy_process_group()


def test_forward_prefetch_issues_the_next_units_gather_before_this_one_runs(tmp_path, monkeypatch):
    """fsdp.forward_prefetch: with 1, each unit's start issues the next one's all-gather (embedding, layers,
    head in forward order), so it can run beside this unit's kernels; with 0 (torch's implicit prefetch) the
    next gather waits for the host to reach the next unit. Losses are the same either way."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    events: list[str] = []
    unshard = FSDPParamGroup.unshard

    def logged_unshard(self, async_op=False):
        pending = self._all_gather_result is not None
        unshard(self, async_op)
        if not pending and self._all_gather_result is not None:  # this call issued an all-gather
            events.append(f"gather {self._module_fqn.split('.')[-1] or 'root'}")

    monkeypatch.setattr(FSDPParamGroup, "unshard", logged_unshard)

    def sharded(ahead: int, tied: bool = False, checkpointed: bool = False):
        torch.manual_seed(0)
        base = tiny_causal_lm("llama")
        if checkpointed:
            base.gradient_checkpointing_enable({"use_reentrant": False})
        if tied:
            base.lm_head.weight = base.model.embed_tokens.weight
        model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        layers = model.base_model.model.model.layers
        for layer in layers:
            fully_shard(layer)
        if tied:
            fully_shard(
                [
                    model.base_model.model.model.norm,
                    model.get_input_embeddings(),
                    model.get_output_embeddings(),
                ]
            )
        else:
            fully_shard(model.get_input_embeddings())
            fully_shard(
                [model.base_model.model.model.norm, model.get_output_embeddings()],
                reshard_after_forward=False,
            )
        fully_shard(model)
        fsdp.after_prepare(model)
        for at, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, at=at: events.append(f"run {at}"))
            layer.self_attn.register_forward_pre_hook(lambda *_, at=at: events.append(f"attention {at}"))
        return model, fsdp.forward_prefetch(model, ["LlamaDecoderLayer"], ahead)

    ids = torch.tensor([[1, 5, 9, 3, 7]])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        losses = []
        for ahead in (0, 1):
            model, prefetching = sharded(ahead)
            events.clear()
            loss = model(input_ids=ids, labels=ids).loss
            losses.append(float(loss.detach()))
            loss.backward()
            forward = events[: events.index("run 1") + 1]
            if ahead:
                assert prefetching == 3  # embedding -> layer 0 -> layer 1 -> head
                assert forward.index("gather 1") < forward.index("run 0"), events
                assert events.index("gather lm_head") < events.index("run 1"), events
            else:
                assert prefetching == 0
                assert forward.index("gather 1") > forward.index("run 0"), events
        assert losses[0] == losses[1]
        # A micro-batch gathers each layer twice (forward, backward: checkpointing's recompute reuses the
        # backward's gather), the embedding and the head once (a frozen embedding computes nothing in backward;
        # the head stays gathered from the loss through backward).
        model, _ = sharded(1, checkpointed=True)
        model.train()
        events.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        twice = ["gather 0", "gather 0", "gather 1", "gather 1", "gather embed_tokens", "gather lm_head"]
        assert sorted(e for e in events if e.startswith("gather")) == twice
        assert events.count("attention 1") == 2, events  # the recompute ran
        # The last layer kept gathered from its forward to its backward: one all-gather less.
        assert fsdp.keep_last_layer_gathered(model, ["LlamaDecoderLayer"])
        events.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        once = ["gather 0", "gather 0", "gather 1", "gather embed_tokens", "gather lm_head"]
        assert sorted(e for e in events if e.startswith("gather")) == once
        _, prefetching = sharded(2, tied=True)  # one unit with the head: only the layers chain
        assert prefetching == 1
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- sharded loading (QLoRA)


def test_sharded_loading_keeps_one_chunk_of_each_weight_and_its_ties(tmp_path):
    """Rank 1 of 3 loading a 4-bit model with tied embeddings: each weight transformers loads is cut to the
    chunk fully_shard will give rank 1 (the ordinary load's bytes, bit for bit), an empty stand-in stays in
    the model, the tie survives, and to_meta restores the true shapes for sharding."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from trainer.model.sharded_loading import ShardedLoad, local_chunk

    config = AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama", tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_storage=torch.float32, bnb_4bit_compute_dtype=torch.float32
    )
    kwargs = {"quantization_config": quant, "device_map": {"": "cpu"}, "dtype": torch.float32}
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)
    shards = ShardedLoad(rank=1, world=3)
    with shards.capture():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs)

    reference = dict(whole.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.numel() == 0 for p in model.parameters())
    q_proj = model.model.layers[0].self_attn.q_proj
    kept = shards.kept[id(q_proj.weight)]
    expected = local_chunk(reference["model.layers.0.self_attn.q_proj.weight"].detach(), 1, 3)
    assert torch.equal(kept.chunk.view(torch.uint8), expected.view(torch.uint8))  # packed bytes, not floats
    # the 4-bit state stays whole, as on the ordinary path
    assert torch.equal(q_proj.quant_state.absmax, whole.model.layers[0].self_attn.q_proj.quant_state.absmax)
    total = sum(p.numel() * p.element_size() for p in reference.values())
    assert shards.whole_bytes == total
    assert total / 3 - 4096 < shards.held_bytes < total / 3 + 4096  # chunks of uneven dims round up

    shards.to_meta(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        assert param.is_meta and param.shape == reference[name].shape, name


def test_sharded_loading_refuses_lora_on_fused_experts():
    from trainer.model.loading import ModelLoadError, load_for_training

    cfg = load_config(
        REPO / "training_config.yaml",
        [
            f"model.name_or_path={REPO / 'configs' / 'tiny-moe'}",
            "model.random_init=true",
            "training.method=qlora",
            "training.distributed=fsdp",
            "fsdp.cpu_ram_efficient_loading=true",
            "quantization.quantize_experts=false",
        ],
    )
    from unittest import mock

    with mock.patch("trainer.model.loading.sharded_loading", return_value=object()):
        with pytest.raises(ModelLoadError, match="lora.target_parameters: LoRA on fused expert weights"):
            load_for_training(cfg, torch.device("cpu"))


# ---------------------------------------------------------------- planner and info


def test_planner_divides_the_sharded_state_not_the_activations_nor_the_head():
    from trainer.tools.planner import fsdp_per_gpu_mb, sharded_state_mb

    model = tiny_causal_lm("llama")
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    state = sharded_state_mb(model, optimizer)
    params_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    head_mb = model.lm_head.weight.numel() * 4 / 2**20
    # weights, gradients, Adam's two moments (fp32) and its step counters
    assert state.sharded_mb == pytest.approx(4 * params_mb, rel=1e-3)
    assert 0 < state.layer_mb < params_mb and state.head_mb == head_mb
    activations = 100.0
    peak = activations + state.sharded_mb
    assert fsdp_per_gpu_mb(peak, state, 1) == peak
    # the head stays gathered whole from the loss on (accelerate's tail unit): not divided
    expected = activations + (state.sharded_mb - head_mb) / 4 + head_mb + 1.5 * state.layer_mb
    assert fsdp_per_gpu_mb(peak, state, 4) == pytest.approx(expected)
    assert fsdp_per_gpu_mb(peak, state, 4, prefetch=0) == pytest.approx(expected)  # torch's own prefetch
    # fsdp.forward_prefetch: 3 keeps up to three layers gathered beside the one running
    assert fsdp_per_gpu_mb(peak, state, 4, prefetch=3) == pytest.approx(expected + 0.75 * 2 * state.layer_mb)

    # Full fine-tuning in bf16 under mixed precision: accelerate keeps FSDP's master weights in fp32, so the
    # trainable parameters, their gradients and Adam's moments count twice their bf16 bytes.
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    as_trained = sharded_state_mb(model, optimizer).sharded_mb
    assert as_trained == pytest.approx(2 * params_mb, rel=1e-3)
    masters = sharded_state_mb(model, optimizer, master_fp32=True)
    assert masters.sharded_mb == pytest.approx(4 * params_mb, rel=1e-3)
    assert masters.held_mb == pytest.approx(as_trained)
    # the dry run's bf16 state leaves the peak whole, FSDP's fp32 state comes back divided: on 4 GPUs the
    # prediction is the activations, a quarter of the fp32 state, and the gathered head and two layers
    peak = activations + as_trained
    gathered = 0.75 * (masters.head_mb + 2 * masters.layer_mb)
    assert fsdp_per_gpu_mb(peak, masters, 4) == pytest.approx(activations + masters.sharded_mb / 4 + gathered)


def test_info_names_how_many_gpus_fsdp_needs():
    from trainer.tools.hardware import fsdp_gpus_needed, recommend

    assert fsdp_gpus_needed("70B", 45, 24) == 2  # Answer.AI's 70B on two 24 GB cards
    assert fsdp_gpus_needed("70B", 45, 16) == 4
    advice = next(r for r in recommend(24) if r["model"] == "70B")
    assert not advice["fits"] and "training.distributed: fsdp across 2" in advice["advice"]


# ---------------------------------------------------------------- two CPU processes (gloo)


def llama_config(tmp_path, name: str, extra: dict) -> tuple:
    base = deep_merge(
        TINY,
        {
            "paths": {"output_dir": str(tmp_path / name)},
            "model": {"name_or_path": str(REPO / "configs" / "tiny-llama"), "random_init": True},
            "training": {
                "max_steps": 6,
                "save_steps": 2,
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 4,
            },
            "lora": {"dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
            "eval": {"interval": 3, "max_batches": 3, "at_end": False},
        },
    )
    cfg = deep_merge(base, extra)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path / name


def two_process_command(config, module: str = "trainer") -> list[str]:
    """accelerate launch of two CPU processes; accumulation halves so the rows per step stay those of one.
    ``module``: the entry point (a test's, e.g. ``tests.fast_path_on_cpu``, wraps the trainer's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
            "-m", module, "train", "--config", str(config),
            "--set", "training.gradient_accumulation_steps=2"]  # fmt: skip


def two_process_env() -> dict:
    return {**trainer_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def launch_two(config) -> subprocess.CompletedProcess:
    return subprocess.run(
        two_process_command(config),
        cwd=REPO,
        env=two_process_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (torch's elastic agent starts the ranks in new sessions)."""
    import psutil

    launcher = psutil.Process(proc.pid)
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def losses(run) -> dict:
    return {
        r["step"]: r["loss"] for r in last_per_step(list(iter_records(run / "logs" / runfolder.TRAINING_LOG)))
    }


def assert_same_losses(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b), (a, b)
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=tol), (step, a[step], b[step])


@pytest.mark.slow
def test_lora_under_fsdp_equals_one_process_resumes_exactly_and_its_adapter_loads(tmp_path):
    """Two ranks sharding a LoRA run give the one-process losses; SIGKILL after checkpoint-2, a restart,
    and the replayed steps are the same again; the consolidated adapter loads on one process."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    one_cfg, one = llama_config(tmp_path, "one", {})
    result = run_trainer("train", "--config", str(one_cfg))
    assert result.returncode == 0, result.stderr[-3000:]

    two_cfg, two = llama_config(tmp_path, "two", {"training": {"distributed": "fsdp"}})
    proc = subprocess.Popen(
        two_process_command(two_cfg), cwd=REPO, env=two_process_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert wait_for(lambda: (two / "checkpoint-2" / "trainer_state.json").exists() or proc.poll() is not None)
    kill_tree(proc)  # the launcher and both ranks, as a lost node would

    assert (two / "checkpoint-2").is_dir() and not (two / "final-checkpoint-6").exists()
    resumed = launch_two(two_cfg)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_same_losses(losses(two), losses(one))
    assert json.loads((two / "run.json").read_text())["world_size"] == 2

    # The training state is sharded: one optimizer file per rank, no copy of the frozen base model.
    state = two / "final-checkpoint-6" / "training_state"
    assert sorted(p.name for p in (state / "optimizer_0").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (state / "pytorch_model_fsdp_0").exists()
    assert {p.name for p in state.glob("random_states_*.pkl")} == {
        "random_states_0.pkl",
        "random_states_1.pkl",
    }

    # The consolidated adapter: the one-process run's, loadable by PEFT on one process.
    final_two = load_file(str(two / "final-checkpoint-6" / "adapter_model.safetensors"))
    final_one = load_file(str(one / "final-checkpoint-6" / "adapter_model.safetensors"))
    assert sorted(final_two) == sorted(final_one)
    for key, tensor in final_one.items():
        assert torch.allclose(final_two[key], tensor, atol=1e-5), key
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-llama"))
    loaded = PeftModel.from_pretrained(base, two / "final-checkpoint-6")
    weights = dict(loaded.named_parameters())
    key = next(k for k in final_two if "lora_B" in k)
    assert torch.equal(weights[key.replace(".weight", ".default.weight")].detach(), final_two[key])
    exported = run_trainer("export", str(two / "final-checkpoint-6"), "--out", str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "export" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_under_fsdp_saves_one_sharded_checkpoint_and_the_same_command_resumes_exactly(tmp_path):
    """A scheduler's SIGTERM to every process of a two-rank FSDP run (scancel, preemption): the ranks agree on
    one step, save its sharded checkpoint together and stop; the same command resumes from it to the
    losses of one process."""
    import psutil

    one_cfg, one = llama_config(tmp_path, "one", {})
    assert run_trainer("train", "--config", str(one_cfg)).returncode == 0
    two_cfg, two = llama_config(tmp_path, "two", {"training": {"distributed": "fsdp", "save_steps": 100}})
    proc = subprocess.Popen(
        two_process_command(two_cfg), cwd=REPO, env=two_process_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert wait_for(lambda: len(losses(two)) >= 2 or proc.poll() is not None)
    launcher = psutil.Process(proc.pid)
    for process in [launcher, *launcher.children(recursive=True)]:
        process.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)

    info = json.loads((two / "run.json").read_text())
    assert info["status"] == "interrupted" and info["step"] < 6
    events = list(iter_records(two / "logs" / runfolder.EVENTS_LOG))
    assert [e["signal"] for e in events if e["event"] == "signal"] == ["SIGTERM"]  # one step, both ranks
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [(e["kind"], e["step"]) for e in saved] == [("signal", info["step"])]
    shards = two / f"checkpoint-{info['step']}" / "training_state" / "optimizer_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    resumed = launch_two(two_cfg)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {shards.parent.parent}" in resumed.stdout
    assert_same_losses(losses(two), losses(one))


@pytest.mark.slow
def test_fsdp_with_the_fused_adamw_decides_on_the_device_reads_late_and_equals_one_process(tmp_path):
    """Under FSDP the fused AdamW (forced on the CPU: tests/fused_adamw_on_cpu.py) takes the skip decision as a
    tensor for its sharded parameters, so every update is queued before the host reads the step's figures,
    which are read a step late: the losses and token counts of one process all the same."""
    fused = [sys.executable, "-m", "tests.fused_adamw_on_cpu", "train", "--config"]
    one_cfg, one = llama_config(tmp_path, "one", {})
    single = subprocess.run([*fused, str(one_cfg)], cwd=REPO, env=two_process_env(), capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]

    two_cfg, two = llama_config(tmp_path, "two", {"training": {"distributed": "fsdp"}})
    command = two_process_command(two_cfg, "tests.fused_adamw_on_cpu")
    result = subprocess.run(
        command, cwd=REPO, env=two_process_env(), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp sharded" in result.stdout, result.stdout[-2000:]
    assert result.stdout.count("updates decided on the device: 6/6") == 2, result.stdout[-2000:]  # both ranks
    assert_same_losses(losses(two), losses(one))
    records = {r["step"]: r for r in iter_records(two / "logs" / runfolder.TRAINING_LOG)}
    reference = {r["step"]: r for r in iter_records(one / "logs" / runfolder.TRAINING_LOG)}
    assert [records[s]["tokens"] for s in range(1, 7)] == [reference[s]["tokens"] for s in range(1, 7)]


def held_bytes(result) -> dict[int, int]:
    """Each rank's ``fsdp loading`` line: the weights it holds right before sharding."""
    import re

    return {
        int(r): int(b) for r, b in re.findall(r"fsdp loading: rank (\d+) holds (\d+) bytes", result.stdout)
    }


def assert_loaded_in_shards(config, run, one, whole: int, slack: int, weights: str = "adapter_model") -> None:
    """Two ranks loading in shards: each holds half of one process's weight bytes (plus ``slack``) before
    sharding, and the losses and the consolidated adapter are the one-process run's."""
    from safetensors.torch import load_file

    in_shards = launch_two(config)
    assert in_shards.returncode == 0, in_shards.stderr[-3000:]
    assert "loaded in shards" in in_shards.stdout
    held = held_bytes(in_shards)
    assert sorted(held) == [0, 1] and all(whole / 2 < b < whole / 2 + slack for b in held.values()), held
    assert_same_losses(losses(run), losses(one))
    adapter = load_file(str(run / "final-checkpoint-3" / f"{weights}.safetensors"))
    reference = load_file(str(one / "final-checkpoint-3" / f"{weights}.safetensors"))
    assert sorted(adapter) == sorted(reference)
    for key, tensor in reference.items():
        assert torch.allclose(adapter[key], tensor, atol=1e-5), key


def fast_path_report(run) -> dict:
    return next(e for e in iter_records(run / "logs" / runfolder.EVENTS_LOG) if e["event"] == "model_report")[
        "fast_path"
    ]


def fast_path_runs(tmp_path, extra: dict) -> tuple:
    """The same config three ways: the reference path in one process, the fast path's nodes (forced on a
    CPU) in one process, and those nodes under FSDP on two ranks; their run folders."""
    reference_cfg, reference = llama_config(tmp_path, "reference", extra)
    assert run_trainer("train", "--config", str(reference_cfg)).returncode == 0
    one_cfg, one = llama_config(tmp_path, "one", extra)
    fast_one = subprocess.run(
        [sys.executable, "-m", "tests.fast_path_on_cpu", "train", "--config", str(one_cfg)],
        cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert fast_one.returncode == 0, fast_one.stderr[-3000:]
    two_cfg, two = llama_config(tmp_path, "two", deep_merge(extra, {"training": {"distributed": "fsdp"}}))
    command = two_process_command(two_cfg, "tests.fast_path_on_cpu")
    sharded = subprocess.run(
        command, cwd=REPO, env=two_process_env(), capture_output=True, text=True, timeout=900
    )
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "fsdp sharded" in sharded.stdout
    return reference, one, two


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_fast_path_nodes_under_fsdp_equal_one_process(tmp_path, method):
    """The fast path's fused LoRA nodes (forced on a CPU: tests/fast_path_on_cpu.py) read each layer's weights
    as FSDP2 gathers them (QLoRA: 4-bit weights stored in the compute dtype, their quantization state put back
    on the gathered copy), and the fused loss reads the gathered head (full fine-tuning: its gradient, computed
    outside the head's forward, is reduce-scattered like any other): two ranks give the losses of one process
    on the same nodes, and of the reference path, over the same rows (fp32, within 1e-5), with Q/K/V and the
    SwiGLU blocks fused where there are LoRA adapters."""
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    extra = {
        "training": {"method": method, "max_steps": 4, "save_steps": 4},
        "lora": {
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        },
        "model": {"dtype": "fp32"},
        "quantization": {"compute_dtype": "fp32"},
        "eval": {"interval": 100},
    }
    reference, one, two = fast_path_runs(tmp_path, extra)
    for run in (one, two):
        report = fast_path_report(run)
        assert report["enabled"] and report["fused_loss"] is True, report
        if method != "full":
            assert report["lora_modules_fused"] > 0, report
            assert report["qkv_groups_fused"] == report["mlp_blocks_fused"] == 2, report
    assert fast_path_report(reference)["enabled"] is False
    assert_same_losses(losses(two), losses(one))
    assert_same_losses(losses(one), losses(reference))


@pytest.mark.slow
def test_grouped_4bit_experts_under_fsdp_equal_one_process(tmp_path):
    """QLoRA on the tiny MoE with the fast path's nodes (forced on a CPU): one process packs the experts' 4-bit
    bytes once; two FSDP ranks shard them as floating parameters, and the grouped path concatenates them as
    gathered at each call. Both group every experts module, and give the reference path's losses (fp32)."""
    pytest.importorskip("bitsandbytes")
    extra = {
        "model": {"name_or_path": str(REPO / "configs" / "tiny-moe"), "dtype": "fp32"},
        "training": {"method": "qlora", "max_steps": 3, "save_steps": 3},
        "quantization": {"compute_dtype": "fp32"},
        "eval": {"interval": 100},
    }
    reference, one, two = fast_path_runs(tmp_path, extra)
    grouped = [fast_path_report(run)["moe_experts_grouped"] for run in (one, two)]
    assert grouped[0] > 0 and grouped[0] == grouped[1], grouped
    assert fast_path_report(reference)["enabled"] is False
    assert_same_losses(losses(two), losses(one))
    assert_same_losses(losses(one), losses(reference))


@pytest.mark.slow
def test_qlora_moe_under_fsdp_equals_one_process(tmp_path):
    """QLoRA on the tiny MoE (fused experts quantized, stored as shardable parameters) over two ranks gives the
    losses of one process over the same rows (fp32 compute, so within 1e-5). Loaded as usual each rank holds the
    whole 4-bit model before sharding; loaded in shards (fsdp.cpu_ram_efficient_loading) each holds half, and
    training and the consolidated adapter are the same."""

    extra = {
        "model": {"name_or_path": str(REPO / "configs" / "tiny-moe"), "dtype": "fp32"},
        "training": {"method": "qlora", "distributed": "fsdp", "max_steps": 3, "save_steps": 3},
        "quantization": {"compute_dtype": "fp32"},
        "eval": {"interval": 100},
        "logging": {"expert_interval": 1},
    }
    one_cfg, one = llama_config(tmp_path, "one", extra)
    result = run_trainer("train", "--config", str(one_cfg))  # fsdp with one process: trains as one process
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fsdp with one process shards nothing" in result.stdout
    whole = held_bytes(result)[0]
    two_cfg, two = llama_config(tmp_path, "two", extra)
    sharded = launch_two(two_cfg)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert_same_losses(losses(two), losses(one))
    assert held_bytes(sharded) == {0: whole, 1: whole}
    assert (two / "final-checkpoint-3" / "adapter_model.safetensors").is_file()
    # Expert routing is still counted (hooks on the sharded routers) and logged by rank 0.
    routed = list(iter_records(two / "logs" / runfolder.EXPERT_LOG))
    assert [r["step"] for r in routed] == [1, 2, 3]

    loaded_cfg, loaded = llama_config(
        tmp_path, "loaded", deep_merge(extra, {"fsdp": {"cpu_ram_efficient_loading": True}})
    )
    # half the weights, plus what is not yet sharded either way (the adapters, a rotary buffer): a few KiB
    assert_loaded_in_shards(loaded_cfg, loaded, one, whole, slack=32 * 1024)


def sharded_params(result) -> dict[int, tuple[int, dict]]:
    """Each rank's ``fsdp sharded`` line: the parameter bytes it holds after prepare, by role and dtype."""
    import re

    found = re.findall(r"fsdp sharded: rank (\d+) holds (\d+) bytes .* of parameters (\{.*\})", result.stdout)
    return {int(rank): (int(total), json.loads(parts)) for rank, total, parts in found}


@pytest.mark.slow
def test_bf16_qlora_moe_under_fsdp_keeps_frozen_weights_in_bf16_and_halves_them(tmp_path):
    """bf16 mixed precision, as on GPUs: the frozen weights (embeddings, head, norms, the 4-bit storage and
    the packed experts) stay bf16 under FSDP instead of PEFT's fp32 upcast for QLoRA, which doubled the
    embedding and head shards and converted the packed experts' bytes as numbers (the step failed). Each of
    two ranks holds about half of the weights one process holds, and trains the one-process losses."""
    extra = {
        "model": {"name_or_path": str(REPO / "configs" / "tiny-moe"), "dtype": "bf16"},
        "training": {"method": "qlora", "distributed": "fsdp", "max_steps": 2, "save_steps": 100,
                     "mixed_precision": "bf16"},
        "quantization": {"compute_dtype": "bf16"},
        "eval": {"interval": 100},
    }  # fmt: skip
    one_cfg, one = llama_config(tmp_path, "one", extra)
    result = run_trainer("train", "--config", str(one_cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    whole = held_bytes(result)[0]  # the model as one process holds it (params and buffers)
    two_cfg, two = llama_config(tmp_path, "two", extra)
    command = [*two_process_command(two_cfg)]
    command[command.index("--mixed_precision") + 1] = "bf16"
    sharded = subprocess.run(
        command, cwd=REPO, env=two_process_env(), capture_output=True, text=True, timeout=900
    )
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    ranks = sharded_params(sharded)
    assert sorted(ranks) == [0, 1]
    for total, parts in ranks.values():
        assert set(parts["frozen"]) == {"bfloat16"}, parts
        assert total < 0.6 * whole, (total, whole)
    assert_same_losses(losses(two), losses(one), tol=0.05)


@pytest.mark.slow
def test_full_fine_tune_under_fsdp_saves_sharded_state_and_a_consolidated_model(tmp_path):
    """Also with the other FSDP options: layers kept gathered after forward (an evaluation right before the
    save must free them, or the optimizer no longer knows the parameters) and FSDP's activation checkpointing."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    extra = {"training": {"method": "full", "max_steps": 2, "save_steps": 2}, "eval": {"interval": 1}}
    one_cfg, one = llama_config(tmp_path, "one", extra)
    assert run_trainer("train", "--config", str(one_cfg)).returncode == 0
    options = {"reshard_after_forward": False, "activation_checkpointing": True}
    two_cfg, two = llama_config(
        tmp_path, "two", deep_merge(extra, {"training": {"distributed": "fsdp"}, "fsdp": options})
    )
    sharded = launch_two(two_cfg)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert_same_losses(losses(two), losses(one))
    evals = [r["eval_loss"] for r in iter_records(two / "logs" / runfolder.EVAL_LOG)]
    assert evals == pytest.approx([r["eval_loss"] for r in iter_records(one / "logs" / runfolder.EVAL_LOG)])
    final = two / "final-checkpoint-2"
    assert len(list((final / "training_state" / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    model = AutoModelForCausalLM.from_pretrained(final)  # the consolidated model, on one process
    reference = load_file(str(one / "final-checkpoint-2" / "model.safetensors"))
    for name, param in model.state_dict().items():
        if name in reference:
            assert torch.allclose(param, reference[name], atol=1e-5), name


def n_process_command(config, processes: int, accumulation: int) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
            "-m", "trainer", "train", "--config", str(config),
            "--set", f"training.gradient_accumulation_steps={accumulation}"]  # fmt: skip


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_other_process_counts(tmp_path):
    """Killed after checkpoint-2 on two FSDP ranks, a run resumes on three (the optimizer shards resharded
    as they load) and, from a copy, on one process without FSDP (the shards reassembled); with the rows per
    step kept (accumulation scaled), both give the uninterrupted one-process losses."""
    import shutil

    rows = {"training": {"gradient_accumulation_steps": 6}}  # micro 2 x 6 = 12 rows per step
    one_cfg, one = llama_config(tmp_path, "one", rows)
    result = run_trainer("train", "--config", str(one_cfg))
    assert result.returncode == 0, result.stderr[-3000:]

    two_cfg, two = llama_config(tmp_path, "two", deep_merge(rows, {"training": {"distributed": "fsdp"}}))
    proc = subprocess.Popen(
        n_process_command(two_cfg, 2, 3), cwd=REPO, env=two_process_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert wait_for(lambda: (two / "checkpoint-2" / "trainer_state.json").exists() or proc.poll() is not None)
    kill_tree(proc)
    assert not (two / "final-checkpoint-6").exists()
    copy = tmp_path / "copy"
    shutil.copytree(two, copy)

    three = subprocess.run(
        n_process_command(two_cfg, 3, 2), cwd=REPO, env=two_process_env(), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert three.returncode == 0, three.stderr[-3000:]
    assert "was saved by 2 processes and resumes on 3 (FSDP: the optimizer state is resharded" in three.stderr
    assert_same_losses(losses(two), losses(one))
    shards = two / "final-checkpoint-6" / "training_state" / "optimizer_0"
    assert len(list(shards.glob("*.distcp"))) == 3

    single = run_trainer("train", "--config", str(two_cfg), "--set", f"paths.output_dir={copy}",
                         "--set", "training.distributed=ddp")  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    assert "was saved by 2 processes and resumes on 1" in single.stderr
    assert_same_losses(losses(copy), losses(one))


def test_a_checkpoint_saved_without_fsdp_is_refused_under_fsdp(tmp_path, monkeypatch):
    """The other direction has no sharded optimizer state to reshard: one line naming what to do, exit 2."""
    from types import SimpleNamespace

    from trainer.training import checkpointing
    from trainer.training.checkpoint_files import CheckpointError

    checkpoint = tmp_path / "checkpoint-4"
    (checkpoint / "training_state").mkdir(parents=True)
    (checkpoint / "training_state" / "optimizer.bin").write_bytes(b"")
    monkeypatch.setattr(fsdp, "active", lambda accelerator: True)
    accelerator = SimpleNamespace(num_processes=2, is_main_process=True)
    resume_from = SimpleNamespace(path=checkpoint, state={"processes": 1, "step": 4})
    with pytest.raises(
        CheckpointError,
        match="checkpoint-4 was saved without FSDP .* resume it with training.distributed: ddp",
    ):
        checkpointing.restore(resume_from, accelerator, model=None, state=None)


@pytest.mark.slow
@pytest.mark.parametrize("method, weights", [("lora", "adapter_model"), ("full", "model")])
def test_a_16bit_model_loaded_in_shards_holds_half_per_rank_and_trains_as_one_process(
    tmp_path, method, weights
):
    """LoRA's 16-bit base, or full fine-tuning's weights, with fsdp.cpu_ram_efficient_loading: each of two
    ranks keeps only its shard of every weight while loading, and the losses and the consolidated adapter or
    model are one process's. Full fine-tuning trains every stand-in: the optimizer finds the sharded
    parameters by name (without that the run fails)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp_path / "base"  # a checkpoint to load (random_init builds from the config, loading nothing)
    shutil.copytree(REPO / "configs" / "tiny-llama", base)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)).save_pretrained(base)
    extra = {
        "model": {"dtype": "fp32", "name_or_path": str(base), "random_init": False},
        "training": {"method": method, "distributed": "fsdp", "max_steps": 3, "save_steps": 3},
        "eval": {"interval": 100},
    }
    one_cfg, one = llama_config(tmp_path, "one", extra)
    result = run_trainer("train", "--config", str(one_cfg))
    assert result.returncode == 0, result.stderr[-3000:]
    whole = held_bytes(result)[0]
    loaded_cfg, loaded = llama_config(
        tmp_path, "loaded", deep_merge(extra, {"fsdp": {"cpu_ram_efficient_loading": True}})
    )
    assert_loaded_in_shards(loaded_cfg, loaded, one, whole, slack=64 * 1024, weights=weights)
