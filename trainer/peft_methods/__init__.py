"""PEFT methods beyond PEFT's own: LoRA-GA initialisation (every family) and SDLoRA (Mamba-1, Mamba-2).

Where they meet the rest of the kit, each at one point:

- ``check(cfg, family, hf_config)``: from ``loading.check_lora_config``, before any weights load;
- ``prepare(...)``: from the loop's set-up, once data is ready and before the optimizer exists. It runs
  what must run once per run folder (LoRA-GA's gradient estimate, SDLoRA's stage one) only when the run
  folder does not hold its result yet (``lora_ga_init.safetensors``, ``sdlora_selection.json``), so a
  resume or a restart never redoes it; then it applies that result to the model;
- ``save_into(model, folder)`` / ``load_into(model, folder)``: beside every checkpoint's adapter,
  ``peft_method.json`` (the method, read from the config and recorded here) and
  ``peft_method.safetensors`` (LoRA-GA's initial factors, SDLoRA's trained SSM tensors): what resume,
  ``evaluate`` and ``export --merge`` need on top of the PEFT adapter.

Only the main process computes; the others wait for the file and read it, so every rank applies the
same bytes.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer import runfolder
from trainer.families.base import ModelLoadError
from trainer.peft_methods import lora_ga, sdlora


@dataclass
class MethodState:
    """What a checkpoint must record about the method; kept on the PEFT model as ``finetune_method``."""

    method: str  # lora, sdlora
    init: str
    lora_ga: dict = field(default_factory=dict)  # the initial factors, <layer>.A0 / <layer>.B0
    sdlora: dict | None = None  # the selection record
    sdlora_names: list[str] = field(default_factory=list)  # the SSM tensors stage two trains

    @property
    def needs_files(self) -> bool:
        return self.method != "lora" or self.init == "lora_ga"


GLA_REFUSAL = (
    "lora.method: sdlora selects channels and states of a state-space model's own parameters (Mamba's "
    "A, D, dt, conv); GLA has no such parameters: its decay gate is gk_proj, an input-dependent projection "
    "that LoRA already reaches (add gk_proj to lora.target_modules with lora.method lora)"
)


def check(cfg, family, hf_config) -> None:
    """Refuse, in one line, a family or combination that cannot take the configured method."""
    if cfg.lora.method != "sdlora":
        return
    if family.name == "gla":
        raise ModelLoadError(GLA_REFUSAL)
    model_type = getattr(hf_config, "model_type", "")
    if family.name != "mamba" or model_type not in sdlora.DEFAULT_PARAMS:
        raise ModelLoadError(
            f"lora.method: sdlora needs a Mamba or Mamba-2 model (state-space parameters A, D, dt); "
            f"this is {family.name}/{model_type or 'unknown'}"
        )
    try:
        sdlora.params_for(cfg, model_type)
    except sdlora.SdloraError as exc:
        raise ModelLoadError(str(exc)) from exc


def method_state(model) -> MethodState | None:
    return getattr(model, "finetune_method", None)


# ---------------------------------------------------------------- once per run folder


def prepare(loaded, cfg, data, pad_id: int, loss_fn, accelerator, output_dir: Path, log) -> None:
    """LoRA-GA's init and SDLoRA's selection: computed once per run folder, applied on every start."""
    model = loaded.model
    if not hasattr(model, "peft_config"):
        return
    state = MethodState(cfg.lora.method, cfg.lora.init)
    model.finetune_method = state
    if not state.needs_files:
        return
    device = accelerator.device
    if cfg.lora.init == "lora_ga":
        path = output_dir / runfolder.LORA_GA_INIT
        if not path.exists() and accelerator.is_main_process:
            model.to(device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                tensors, event = lora_ga.initialise(
                    model, cfg, first_batches(cfg, data.train, pad_id), loss_fn, accelerator
                )
            _write_tensors(tensors, path)
            log.event("lora_ga_init", step=0, file=path.name, **event)
            print(
                f"lora-ga: {event['modules']} modules initialised from {event['batches']} batches in "
                f"{event['seconds']:.1f}s; step-0 loss {event['step0_loss_base']:.6f} -> {event['step0_loss_lora_ga']:.6f}",
                flush=True,
            )
            if not event["step0_ok"]:
                print(
                    f"WARNING: lora-ga's step-0 check FAILED: the loss moved by {event['step0_abs_diff']:.3g}, more "
                    f"than the tolerance {event['step0_tolerance']:.3g}; the adapters do not start from the base "
                    "model's output (see docs/families.md, LoRA-GA)",
                    file=sys.stderr,
                    flush=True,
                )
            state.lora_ga = tensors
        accelerator.wait_for_everyone()
        if not state.lora_ga:
            from safetensors.torch import load_file

            state.lora_ga = load_file(str(path))
            try:
                lora_ga.apply_init(lora_ga.lora_layers(model), state.lora_ga)
            except lora_ga.LoraGaError as exc:
                raise ModelLoadError(f"{path}: {exc}") from exc
    if cfg.lora.method == "sdlora":
        _prepare_sdlora(loaded, cfg, data, pad_id, loss_fn, accelerator, output_dir, log, state)


def first_batches(cfg, rows, pad_id: int) -> list[dict]:
    """``lora.lora_ga_batches`` micro-batches of the run's first epoch order (rows reused if too few)."""
    from trainer.data.batches import StepShape, epoch_order, micro_batches

    micro = cfg.training.micro_batch_size
    wanted = micro * cfg.lora.lora_ga_batches
    order = epoch_order(len(rows), cfg.training.seed, 0)
    picked = [order[i % len(order)] for i in range(wanted)]
    return micro_batches(picked, rows, StepShape(micro, 1), 1, 0, pad_id)


def _prepare_sdlora(loaded, cfg, data, pad_id, loss_fn, accelerator, output_dir, log, state) -> None:
    model, model_type = loaded.model, loaded.model_type
    base = model.get_base_model()
    params = sdlora.params_for(cfg, model_type)
    path = output_dir / runfolder.SDLORA_SELECTION
    device = accelerator.device
    if not path.exists() and accelerator.is_main_process:
        rows, source = stage_one_rows(loaded, cfg, data)
        model.to(device)
        batches_for_step = stage_one_batches(cfg, rows, pad_id)
        print(f"sdlora: stage one, {cfg.lora.sdlora_stage_one_steps} steps on {source}", flush=True)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            result = sdlora.run_stage_one(
                model, base, model_type, params, batches_for_step, loss_fn, accelerator, cfg
            )
        values = sdlora.selected_values(sdlora.masks(base, model_type, params, result["layers"]))
        record = sdlora.selection_record(model_type, params, cfg, result, source, len(rows), values)
        _write_json(record, path)
        log.event(
            "sdlora_selection",
            step=0,
            file=path.name,
            params=list(params),
            layers=len(record["layers"]),
            channels=[len(layer["channels"]) for layer in record["layers"]],
            total_channels=record["layers"][0]["total_channels"] if record["layers"] else 0,
            selected_values=values,
            **{f"stage_one_{k}": v for k, v in record["stage_one"].items()},
        )
        print(
            f"sdlora: selected {values} SSM values in {len(record['layers'])} layers "
            f"(stage one {record['stage_one']['seconds']:.1f}s); {path}",
            flush=True,
        )
    accelerator.wait_for_everyone()
    try:
        record = sdlora.read_selection(path, model_type, params)
        mask_by_name = sdlora.masks(base, model_type, params, record["layers"])
    except sdlora.SdloraError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    sdlora.train_selected(base, mask_by_name)
    state.sdlora, state.sdlora_names = record, sorted(mask_by_name)


def stage_one_rows(loaded, cfg, data):
    """Stage one's rows: the training rows, or ``lora.sdlora_stage_one_file`` read the same way."""
    import dataclasses

    from trainer.data.dataset import prepare_data
    from trainer.data.prepare import workers_of

    path = cfg.lora.sdlora_stage_one_file
    if path is None:
        return data.train, "the training rows"
    other = prepare_data(
        dataclasses.replace(cfg.paths, train_file=path, val_file=None),
        dataclasses.replace(cfg.data, val_fraction=0.0),
        loaded.tokenizer,
        loaded.family.packing,
        workers_of(cfg.performance),
    )
    return other.train, path


def stage_one_batches(cfg, rows, pad_id: int):
    """Step i of stage one takes the training shape's rows in the epoch order of ``rows`` (one process)."""
    from trainer.data.batches import Position, StepShape, micro_batches, next_step_rows

    shape = StepShape(cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps)
    per_step = min(shape.micro * shape.accum, len(rows))
    positions = [Position()]

    def batches(step: int) -> list[dict]:
        picked, positions[0] = next_step_rows(len(rows), per_step, cfg.training.seed, positions[0])
        return micro_batches(picked, rows, StepShape(min(shape.micro, per_step), shape.accum), 1, 0, pad_id)

    return batches


def _write_tensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{runfolder.TMP_PREFIX}{path.name}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _write_json(record: dict, path: Path) -> None:
    tmp = path.with_name(f"{runfolder.TMP_PREFIX}{path.name}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- beside each adapter


def save_into(model, folder: Path) -> None:
    """``peft_method.json`` and ``peft_method.safetensors`` beside the adapter; nothing for plain LoRA."""
    state = method_state(model)
    if state is None or not state.needs_files:
        return
    tensors = {f"lora_ga.{k}": v for k, v in state.lora_ga.items()}
    base = model.get_base_model()
    for name in state.sdlora_names:
        tensors[f"sdlora.{name}"] = sdlora.resolve(base, name).detach().cpu()
    record = {
        "method": state.method,
        "init": state.init,
        "lora_ga_modules": sorted({k.rsplit(".", 1)[0] for k in state.lora_ga}),
        "sdlora_tensors": state.sdlora_names,
        "sdlora_selection": state.sdlora,
    }
    _write_tensors(tensors, Path(folder) / runfolder.PEFT_METHOD_TENSORS)
    (Path(folder) / runfolder.PEFT_METHOD_JSON).write_text(json.dumps(record, indent=1) + "\n")


def read_method(folder: Path) -> dict | None:
    path = Path(folder) / runfolder.PEFT_METHOD_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def method_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / runfolder.PEFT_METHOD_TENSORS))


def load_into(model, folder: Path) -> dict | None:
    """Put what a checkpoint's ``peft_method`` files hold into a PEFT model that has its adapter loaded:
    LoRA-GA's base offset (unless already there) and SDLoRA's SSM tensors. Returns the method record."""
    record = read_method(folder)
    if record is None:
        return None
    tensors = method_tensors(folder)
    try:
        if record["init"] == "lora_ga":
            init = {k[len("lora_ga.") :]: v for k, v in tensors.items() if k.startswith("lora_ga.")}
            lora_ga.apply_init(lora_ga.lora_layers(model), init, set_weights=False)
        base = model.get_base_model()
        with torch.no_grad():
            for name in record["sdlora_tensors"]:
                param = sdlora.resolve(base, name)
                param.copy_(tensors[f"sdlora.{name}"].to(device=param.device, dtype=param.dtype))
    except (lora_ga.LoraGaError, sdlora.SdloraError, AttributeError, KeyError) as exc:
        raise ModelLoadError(
            f"{folder / runfolder.PEFT_METHOD_JSON}: does not fit this model ({exc})"
        ) from exc
    return record


__all__ = ["MethodState", "check", "load_into", "prepare", "read_method", "save_into"]
