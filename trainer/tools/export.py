"""Export a checkpoint: the adapter alone, or merged into its base, as safetensors with the tokenizer,
a generation config and a short model card.

The base is rebuilt the way training built it, from the run's ``config.yaml`` next to the
checkpoint (same loader, same seed for a random-init base), or taken from ``--base``. A QLoRA
run's base is loaded again unquantized, in the export dtype, and the adapter merged into those
weights: merging into NF4 weights would bake the quantization error into every layer, and the
result could only be saved 4-bit.

Over 400 lines on purpose: about a hundred are the model card, which sits beside the code that
knows what was exported (base, dtype, merge, adapter settings) so the two cannot drift apart.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer import runfolder
from trainer.reports import runinfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
EXPORT_DTYPES = ("auto", "bf16", "fp16", "fp32")


class ExportError(RuntimeError):
    """A checkpoint or base that cannot be exported, phrased for the user in one line."""


@dataclass
class Source:
    """The checkpoint to export and what its run folder says about it."""

    checkpoint: Path
    kind: str  # "adapter" or "full"
    run_dir: Path | None
    config: object | None  # trainer.config.Config of the run, when config.yaml is there
    run_info: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    adapter_config: dict = field(default_factory=dict)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder as given, or for a run folder its best adapter, else its latest checkpoint."""
    if not path.exists():
        raise ExportError(f"CHECKPOINT: path not found: {path}")
    if not path.is_dir():
        raise ExportError(f"CHECKPOINT: expected a checkpoint or run folder, got a file: {path}")
    if (path / ADAPTER_CONFIG).is_file() or (path / "config.json").is_file():
        return path
    if (path / runfolder.BEST_ADAPTER_DIR / ADAPTER_CONFIG).is_file():
        return path / runfolder.BEST_ADAPTER_DIR
    steps = sorted(
        (runfolder.checkpoint_step(child.name), child.name.startswith(runfolder.FINAL_PREFIX), child)
        for child in path.iterdir()
        if child.is_dir() and runfolder.checkpoint_step(child.name) is not None
    )
    if steps:
        return steps[-1][2]
    raise ExportError(
        f"CHECKPOINT: {path} holds no adapter ({ADAPTER_CONFIG}) or model (config.json), "
        f"and no {runfolder.BEST_ADAPTER_DIR}/ or checkpoint-<step>/ folder"
    )


def read_source(path: Path) -> Source:
    checkpoint = resolve_checkpoint(path)
    if (checkpoint / ADAPTER_CONFIG).is_file():
        kind = "adapter"
        if not (checkpoint / ADAPTER_WEIGHTS).is_file():
            raise ExportError(f"CHECKPOINT: {checkpoint / ADAPTER_WEIGHTS} is missing")
    elif any((checkpoint / name).is_file() for name in FULL_WEIGHTS):
        kind = "full"
    else:
        raise ExportError(
            f"CHECKPOINT: no weights in {checkpoint} (expected {ADAPTER_WEIGHTS} or model.safetensors)"
        )
    run_dir = checkpoint.parent if (checkpoint.parent / runfolder.CONFIG_YAML).is_file() else None
    source = Source(checkpoint, kind, run_dir, None)
    if run_dir is not None:
        source.config = read_run_config(run_dir / runfolder.CONFIG_YAML)
        source.run_info = runfolder.read_run_json(run_dir)
    if (checkpoint / runfolder.TRAINER_STATE).is_file():
        source.state = json.loads((checkpoint / runfolder.TRAINER_STATE).read_text())
    if kind == "adapter":
        source.adapter_config = json.loads((checkpoint / ADAPTER_CONFIG).read_text())
    return source


def read_run_config(path: Path):
    """The run's resolved config, without re-checking files (the data may have moved since)."""
    import yaml

    from trainer.config import ConfigError, build_config

    try:
        return build_config(yaml.safe_load(path.read_text()), str(path))
    except (ConfigError, yaml.YAMLError) as exc:
        raise ExportError(
            f"{path}: cannot read the run's config ({exc}); pass --base to name the base model"
        ) from exc


def torch_dtype(name: str, fallback_config=None):
    """``auto``: the dtype the base was published in (its config.json), else float32."""
    import torch

    from trainer.model.loading import DTYPES

    if name != "auto":
        return DTYPES[name]
    published = getattr(fallback_config, "dtype", None)
    if isinstance(published, str):
        published = getattr(torch, published, None)
    return published if isinstance(published, torch.dtype) else torch.float32


def base_config_for(source: Source, base: str | None):
    """The config that rebuilds the base: the run's own, or a default one pointing at --base."""
    from trainer.config import Config

    cfg = copy.deepcopy(source.config) if source.config is not None else Config()
    if base is not None:
        cfg.model.name_or_path = base
        cfg.model.random_init = False
        cfg.model.revision = None
    elif source.config is None:
        name = source.adapter_config.get("base_model_name_or_path")
        if not name:
            raise ExportError(
                f"{source.checkpoint}: no run config.yaml beside it and no base named: pass --base"
            )
        cfg.model.name_or_path = name
        cfg.model.random_init = False
        cfg.model.revision = source.adapter_config.get("revision")
    if cfg.training.method == "qlora":
        cfg.training.method = "lora"  # load the base unquantized: see the module docstring
    return cfg


def load_base(cfg, dtype_name: str):
    """Rebuild the base as training did (trainer.model.loading, family hooks, same seed), unquantized, in
    the export dtype. Returns the model, its family, the dtype, and the base's config as published
    (the family may adjust runtime flags for training, such as fused kernels, that the export drops)."""
    import torch

    from trainer.families import ModelLoadError, family_for
    from trainer.model.loading import DTYPES, load_base_model, load_hf_config, resolve_dtype

    try:
        hf_config = load_hf_config(cfg)
        published = copy.deepcopy(hf_config)
        family = family_for(getattr(hf_config, "model_type", "") or "", cfg.model.family)
        configure = getattr(family, "configure", None)
        if configure is not None:
            hf_config = configure(hf_config, cfg)
        dtype = torch_dtype(dtype_name, hf_config)
        if cfg.model.random_init:
            # Random weights are drawn in the training dtype, then cast: drawing in another dtype differs.
            model = load_base_model(cfg, family, hf_config, torch.device("cpu"))
            if dtype_name == "auto":
                dtype = resolve_dtype(cfg)
        else:
            cfg.model.dtype = {v: k for k, v in DTYPES.items()}[dtype]
            model = load_base_model(cfg, family, hf_config, torch.device("cpu"))
    except ModelLoadError as exc:
        raise ExportError(f"base model: {exc} (pass --base to name another)") from exc
    return model.to(dtype), family, dtype, published


def load_tokenizer_for(source: Source, cfg):
    """The checkpoint's own tokenizer (saved with it), else the one training used."""
    from transformers import AutoTokenizer

    from trainer.families import ModelLoadError
    from trainer.model.loading import load_tokenizer

    if any((source.checkpoint / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(source.checkpoint))
    try:
        return load_tokenizer(cfg)
    except ModelLoadError as exc:
        raise ExportError(str(exc)) from exc


def generation_config_for(model_config, tokenizer):
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(model_config)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(generation, attr, None) is None and getattr(tokenizer, attr, None) is not None:
            setattr(generation, attr, getattr(tokenizer, attr))
    return generation


def save_merged(source: Source, out: Path, cfg, dtype_name: str, max_shard_size: int | str) -> dict:
    from peft import PeftModel

    load_cfg = cfg
    if source.kind == "full":  # the fine-tuned weights are the checkpoint itself
        load_cfg = copy.deepcopy(cfg)
        load_cfg.model.name_or_path = str(source.checkpoint)
        load_cfg.model.random_init = False
        load_cfg.model.revision = None
        load_cfg.training.method = "full"
    base, family, dtype, published = load_base(load_cfg, dtype_name)
    if source.kind == "adapter":
        from trainer import peft_methods

        model = PeftModel.from_pretrained(base, str(source.checkpoint), autocast_adapter_dtype=False)
        peft_methods.load_into(model, source.checkpoint)  # LoRA-GA's base offset, SDLoRA's SSM tensors
        model = model.merge_and_unload(safe_merge=True)
    else:
        model = base
    model = model.to(dtype)
    model.eval()
    # Save the base's own config (no training-time flags, no quantization_config), in the new dtype.
    published.dtype = dtype
    published.architectures = model.config.architectures
    if hasattr(published, "use_cache"):
        published.use_cache = True
    if getattr(published, "quantization_config", None) is not None:
        del published.quantization_config
    model.config = published
    tokenizer = load_tokenizer_for(source, cfg)
    model.generation_config = generation_config_for(model.config, tokenizer)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(out))
    return {"family": family.name, "dtype": str(dtype).replace("torch.", "")}


def save_adapter(source: Source, out: Path, cfg, dtype_name: str, base: str | None) -> dict:
    """The adapter files, cast if asked, with the tokenizer and the base's generation config.

    A LoRA-GA adapter trained against an offset base becomes a plain rank-2r LoRA of the published base
    (``lora_ga.as_plain_lora``); an SDLoRA one also changed SSM tensors that no PEFT adapter holds, so it
    is refused here: ``--merge`` folds them in."""
    from safetensors.torch import load_file, save_file

    from trainer.peft_methods import lora_ga, method_tensors, read_method

    tensors = load_file(str(source.checkpoint / ADAPTER_WEIGHTS))
    adapter_config = dict(source.adapter_config)
    method = read_method(source.checkpoint)
    if method is not None and method["method"] == "sdlora":
        raise ExportError(
            f"CHECKPOINT: {source.checkpoint.name} is SDLoRA: it also trained SSM parameters that a PEFT adapter "
            "cannot hold; export it with --merge"
        )
    if method is not None and method["init"] == "lora_ga":
        init = {k[len("lora_ga.") :]: v for k, v in method_tensors(source.checkpoint).items()}
        tensors = lora_ga.as_plain_lora(tensors, init)
        r = adapter_config["r"]
        # the same scaling at rank 2r: alpha/r (lora) or alpha/sqrt(r) (rslora)
        factor = 2**0.5 if adapter_config.get("use_rslora") else 2
        adapter_config.update(
            r=2 * r, lora_alpha=adapter_config["lora_alpha"] * factor, init_lora_weights=True
        )
    if dtype_name != "auto":
        target = torch_dtype(dtype_name)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if base is not None:
        adapter_config["base_model_name_or_path"] = base
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source.checkpoint / name).is_file():
            shutil.copy2(source.checkpoint / name, out / name)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})
    try:
        from transformers import AutoConfig, AutoTokenizer

        from trainer.model.loading import _import_family_registrations

        _import_family_registrations()
        # The base training used (its config names the special tokens); only what is already on disk.
        trained_on = source.config.model if source.config is not None else cfg.model
        model_config = AutoConfig.from_pretrained(
            trained_on.name_or_path, revision=trained_on.revision, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        generation_config_for(model_config, tokenizer).save_pretrained(str(out))
    except (OSError, ValueError) as exc:
        print(
            f"note: no generation_config.json: the base config is not reachable ({str(exc).splitlines()[0]})"
        )
    return {"dtype": ",".join(dtypes)}


def model_card(source: Source, cfg, merged: bool, details: dict) -> str:
    run_cfg = source.config
    base_name = cfg.model.name_or_path
    method = (
        run_cfg.training.method if run_cfg is not None else ("lora" if source.kind == "adapter" else "full")
    )
    lines = ["---"]
    if not Path(base_name).expanduser().exists():
        lines.append(f"base_model: {base_name}")
    lines.append(f"library_name: {'transformers' if merged or source.kind == 'full' else 'peft'}")
    lines += ["tags:", "  - finetune-kit", f"  - {method}"]
    if merged:
        lines.append("  - merged")
    lines += ["---", "", f"# {details['name']}", ""]
    if source.kind == "full":
        what = "full fine-tuned model"
    elif merged:
        what = "LoRA adapter merged into its base"
    else:
        what = "LoRA adapter (load it on top of its base)"
    step = source.state.get("step")
    lines.append(
        f"A {what}, exported by finetune-kit from `{source.checkpoint.name}`"
        + (f" (step {step})" if step is not None else "")
        + (f" of run `{source.run_info['run_id']}`" if source.run_info.get("run_id") else "")
        + "."
    )
    lines += ["", "| | |", "|---|---|"]
    base_text = f"`{base_name}`" + (f" at revision `{cfg.model.revision}`" if cfg.model.revision else "")
    if cfg.model.random_init:
        base_text += (
            f" (random weights from its config.json, seed {cfg.training.seed}: there is no published base)"
        )
    lines.append(f"| base model | {base_text} |")
    if run_cfg is not None:
        lora = run_cfg.lora
        targets = lora.target_modules if lora.target_modules is not None else "family default"
        training = run_cfg.training
        method_text = f"{method}"
        if method in ("lora", "qlora"):
            method_text += f", r={lora.r}, alpha={lora.alpha}, dropout={lora.dropout}, variant {lora.variant}, targets {targets}"
            if lora.target_parameters:
                method_text += f", parameters {lora.target_parameters}"
        lines.append(f"| method | {method_text} |")
        data = runinfo.data_report(source.run_dir) if source.run_dir else {}
        data_text = f"`{run_cfg.paths.train_file}`"
        if run_cfg.paths.val_file:
            data_text += f", validation `{run_cfg.paths.val_file}`"
        if data.get("train_records") is not None:
            data_text += (
                f" ({data['train_records']} training records, {data.get('val_records', 0)} validation)"
            )
        data_text += (
            f", max length {run_cfg.data.max_length}, packing {'on' if run_cfg.data.packing else 'off'}"
        )
        lines.append(f"| data | {data_text} |")
        optimizer = run_cfg.optimization
        batch = training.micro_batch_size * training.gradient_accumulation_steps
        lines.append(
            f"| training | run reached step {source.run_info.get('step', step)} of "
            f"{source.run_info.get('total_steps', '?')}, "
            f"batch {batch} per process x {source.run_info.get('world_size', 1)}, lr {optimizer.learning_rate} "
            f"{optimizer.lr_scheduler}, seed {training.seed} |"
        )
    best = runinfo.best_metric(source.run_dir) if source.run_dir else None
    if best is not None:
        lines.append(f"| best eval | {best['name']} {best['value']:.4f} at step {best['step']} |")
    if source.state.get("metric_value") is not None:
        lines.append(f"| this checkpoint | {source.state.get('metric')} {source.state['metric_value']:.4f} |")
    lines.append(f"| export | {'merged' if merged else 'adapter only'}, {details.get('dtype')} |")
    if merged and run_cfg is not None and run_cfg.training.method == "qlora":
        lines += [
            "",
            "Trained as QLoRA on a 4-bit (NF4) base. For this export the base was loaded again unquantized "
            f"in {details.get('dtype')} and the adapter merged into those weights, not into the 4-bit ones: "
            "the merged model is the full-precision base plus the adapter. It can differ slightly from what "
            "training saw (the adapter learned to correct a 4-bit base); quantize it again to serve it in 4-bit.",
        ]
    lines += ["", "## Use", "", "```python"]
    if merged or source.kind == "full":
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{details["name"]}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{details["name"]}")',
        ]
    else:
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            f'base = AutoModelForCausalLM.from_pretrained("{base_name}")',
            f'model = PeftModel.from_pretrained(base, "{details["name"]}")',
        ]
    lines += ["```", ""]
    if source.run_dir is not None:
        lines.append("`training_config.yaml` beside this card is the run's resolved config.")
    lines.append(f"Exported {time.strftime('%Y-%m-%d %H:%M')}.")
    return "\n".join(lines) + "\n"


def export(
    checkpoint: Path,
    out: Path,
    merge: bool = False,
    dtype: str = "auto",
    base: str | None = None,
    max_shard_size: int | str = "5GB",
) -> dict:
    """Write the export into ``out`` (created; must be empty) and return a summary."""
    source = read_source(checkpoint)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out: {out} exists and is not empty")
    cfg = base_config_for(source, base)
    out.mkdir(parents=True, exist_ok=True)
    merged = merge or source.kind == "full"
    try:
        if merged:
            details = save_merged(source, out, cfg, dtype, max_shard_size)
        else:
            details = save_adapter(source, out, cfg, dtype, base)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    details["name"] = out.name
    if source.run_dir is not None:
        shutil.copy2(source.run_dir / runfolder.CONFIG_YAML, out / "training_config.yaml")
    (out / "README.md").write_text(model_card(source, cfg, merged, details))
    respect_umask(out)
    return {
        "checkpoint": str(source.checkpoint),
        "out": str(out),
        "merged": merged,
        "files": sorted(p.name for p in out.iterdir()),
        **details,
    }


def respect_umask(out: Path) -> None:
    """Give every exported file the mode a plain ``open()`` would (0644 under umask 022).

    transformers writes ``model.safetensors`` through a private temporary file (mode 0600) and renames
    it, so a merged export was unreadable to the group that can read the rest of the folder.
    """
    umask = os.umask(0)
    os.umask(umask)
    for path in out.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def push_to_hub(out: Path, repo_id: str, private: bool) -> str:
    """Upload the export folder to a model repository (created if needed); returns its URL."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        raise ExportError(
            "--push-to-hub: HF_HUB_OFFLINE is set; the export is on disk, push it later when online"
        )
    api = HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(out), commit_message="Upload export from finetune-kit")
    return str(url)
