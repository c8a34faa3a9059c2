"""SDLoRA for Mamba-1 and Mamba-2: LoRA on the projections plus a few of the SSM's own channels and states.

Galim et al., "Parameter-Efficient Fine-Tuning of State Space Models" (ICML 2025; the paper's later
version calls the SSM part Sparse Dimension Tuning). Two stages:

1. **Stage one** trains the SSM parameters in full, with the LoRA adapters, for
   ``lora.sdlora_stage_one_steps`` optimizer steps, and scores each layer's channels by how far their
   ``A_log`` entries moved (sum over states of the squared change), then the states of each selected
   channel by their own squared change: the paper's Algorithm 1 and the authors' code, which score on
   A alone. The top ``lora.sdlora_channels`` fraction of channels and ``lora.sdlora_states`` fraction of
   states are kept. Stage one only chooses: every weight it trained is put back afterwards (the
   authors' code also throws A's warm-up change away; here LoRA's goes too), so stage two is an
   ordinary run from step 0 whose one input from stage one is the selection file.
2. **Stage two** trains LoRA as usual and, of each listed SSM tensor, only the selected entries: the
   whole tensor has ``requires_grad`` and a gradient hook zeroes every other entry, and it is kept out
   of weight decay, so AdamW leaves the unselected entries bit-identical.

Which tensors (``lora.sdlora_params``; the default per model type in ``DEFAULT_PARAMS``):

| name | Mamba-1 (channels = d_inner, states = d_state) | Mamba-2 (channels = heads) |
|---|---|---|
| ``A_log`` | entries (channel, state) selected | selected heads |
| ``BC`` | ``x_proj`` rows of B and C, columns of selected channels (all states) | - (B, C come from in_proj: LoRA) |
| ``D`` | selected channels | selected heads |
| ``dt`` | ``dt_proj`` rows and bias of selected channels | ``dt_bias`` of selected heads |
| ``conv`` | ``conv1d`` channels selected | x channels of selected heads; B/C channels of selected states |

Mamba-1's default (A_log, BC) is the paper's released SDLoRA setting. Mamba-2's A is one scalar per
head, so "states" there are the d_state dimensions of B and C, which only the convolution holds as
parameters; they are scored by stage one's change of those conv channels. Mamba-2 is this kit's
reading of the method; the paper's experiments are on Mamba-1.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

DEFAULT_PARAMS = {"mamba": ("A_log", "BC"), "mamba2": ("A_log", "D", "dt", "conv")}
SELECTION_VERSION = 1


class SdloraError(ValueError):
    """An SDLoRA setting this model cannot take, or a selection file that does not fit it."""


@dataclass(frozen=True)
class Target:
    """One SSM tensor of one mixer that stage two trains in part."""

    layer: int  # index into the selection's layers
    name: str  # dotted path in the transformers model, without PEFT's ``base_layer``
    group: str  # A_log, BC, D, dt, conv


def params_for(cfg, model_type: str) -> tuple[str, ...]:
    """The configured SSM tensors, checked against the model type."""
    chosen = tuple(cfg.lora.sdlora_params or DEFAULT_PARAMS[model_type])
    if "A_log" not in chosen:
        raise SdloraError(
            "lora.sdlora_params: stage one scores channels by A_log's change; keep A_log in the list"
        )
    if model_type == "mamba2" and "BC" in chosen:
        raise SdloraError(
            "lora.sdlora_params: BC is Mamba-1's x_proj; Mamba-2's B and C come from in_proj, which LoRA "
            "covers (use conv for their convolution channels)"
        )
    return chosen


def mixers(base_model) -> list[tuple[str, torch.nn.Module]]:
    """Every Mamba mixer, by name in the transformers model (the modules holding ``A_log``)."""
    return [
        (n, m)
        for n, m in base_model.named_modules()
        if isinstance(getattr(m, "A_log", None), torch.nn.Parameter)
    ]


def resolve(base_model, name: str) -> torch.nn.Parameter:
    """The parameter ``name`` names, through a PEFT wrapper (``x_proj`` with LoRA keeps its weight in
    ``x_proj.base_layer``)."""
    path, attr = name.rsplit(".", 1)
    module = base_model.get_submodule(path)
    if hasattr(module, "get_base_layer"):
        module = module.get_base_layer()
    return getattr(module, attr)


def targets(base_model, model_type: str, params: tuple[str, ...]) -> list[Target]:
    found = []
    for layer, (prefix, mixer) in enumerate(mixers(base_model)):
        names = {"A_log": ["A_log"], "D": ["D"]}
        if model_type == "mamba":
            names["BC"] = ["x_proj.weight"]
            names["dt"] = ["dt_proj.weight"] + (["dt_proj.bias"] if _has(mixer, "dt_proj.bias") else [])
        else:
            names["dt"] = ["dt_bias"]
        names["conv"] = ["conv1d.weight"] + (["conv1d.bias"] if _has(mixer, "conv1d.bias") else [])
        for group in params:
            found += [Target(layer, f"{prefix}.{n}", group) for n in names[group]]
    return found


def _has(mixer, dotted: str) -> bool:
    path, attr = dotted.rsplit(".", 1)
    module = mixer.get_submodule(path)
    if hasattr(module, "get_base_layer"):
        module = module.get_base_layer()
    return getattr(module, attr, None) is not None


# ---------------------------------------------------------------- scoring and selection


def count(fraction: float, total: int) -> int:
    return max(1, min(total, round(fraction * total)))


def _top(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k largest scores, ties to the lower index (stable), in ascending order."""
    order = torch.argsort(-scores.double(), stable=True)
    return sorted(order[:k].tolist())


def select(base_model, model_type: str, params, before: dict, cfg) -> list[dict]:
    """Per mixer: the channels to train and, per channel (Mamba-1) or per layer (Mamba-2), the states.

    ``before``: each target tensor's value before stage one; the model holds the value after."""
    selection = []
    for prefix, mixer in mixers(base_model):
        delta = (mixer.A_log.detach().float() - before[f"{prefix}.A_log"].float()).cpu()
        if model_type == "mamba":
            channel_score = delta.square().sum(dim=1)
            channels = _top(channel_score, count(cfg.lora.sdlora_channels, delta.shape[0]))
            n_states = count(cfg.lora.sdlora_states, delta.shape[1])
            states = [_top(delta[c].square(), n_states) for c in channels]
            layer = {
                "mixer": prefix,
                "channels": channels,
                "states": states,
                "total_channels": delta.shape[0],
            }
            layer["total_states"] = delta.shape[1]
        else:
            channels = _top(delta.square(), count(cfg.lora.sdlora_channels, delta.shape[0]))
            layer = {"mixer": prefix, "channels": channels, "states": None, "total_channels": delta.shape[0]}
            layer["total_states"] = mixer.ssm_state_size
            if "conv" in params:
                layer["states"] = _top(
                    _mamba2_state_scores(mixer, prefix, before),
                    count(cfg.lora.sdlora_states, mixer.ssm_state_size),
                )
        selection.append(layer)
    return selection


def _mamba2_state_scores(mixer, prefix: str, before: dict) -> torch.Tensor:
    """Stage one's squared change of each state's B and C convolution channels, summed over groups."""
    d_inner, groups, n = mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size
    score = torch.zeros(n, dtype=torch.float64)
    for attr in ("weight", "bias"):
        param = getattr(mixer.conv1d, attr, None)
        if param is None:
            continue
        change = (param.detach().double() - before[f"{prefix}.conv1d.{attr}"].double()).cpu()
        per_channel = change.reshape(change.shape[0], -1).square().sum(dim=1)
        bc = per_channel[d_inner:].reshape(2, groups, n)
        score += bc.sum(dim=(0, 1))
    return score


# ---------------------------------------------------------------- masks


def mask_for(target: Target, param: torch.Tensor, layer: dict, mixer, model_type: str) -> torch.Tensor:
    """True where stage two may change ``param``."""
    mask = torch.zeros(param.shape, dtype=torch.bool)
    channels = torch.tensor(layer["channels"], dtype=torch.long)
    if model_type == "mamba":
        if target.group == "A_log":
            for c, states in zip(layer["channels"], layer["states"]):
                mask[c, states] = True
        elif target.group == "BC":
            rank = mixer.time_step_rank
            mask[rank:, channels] = True  # rows after dt's are B's then C's; columns are channels
        else:  # D, dt_proj rows and bias, conv1d channels: the first axis is the channel
            mask[channels] = True
        return mask
    if target.group in ("A_log", "D", "dt"):
        mask[channels] = True
        return mask
    # conv1d over [x (heads x head_dim), B (groups x states), C (groups x states)] channels
    d_inner, groups, n, head_dim = (
        mixer.intermediate_size,
        mixer.n_groups,
        mixer.ssm_state_size,
        mixer.head_dim,
    )
    for h in layer["channels"]:
        mask[h * head_dim : (h + 1) * head_dim] = True
    for s in layer["states"] or []:
        for part in range(2):
            for g in range(groups):
                mask[d_inner + part * groups * n + g * n + s] = True
    return mask


def masks(base_model, model_type: str, params, selection: list[dict]) -> dict[str, torch.Tensor]:
    found = targets(base_model, model_type, params)
    mixer_list = mixers(base_model)
    if len(mixer_list) != len(selection):
        raise SdloraError(f"the SDLoRA selection has {len(selection)} layers, the model {len(mixer_list)}")
    result = {}
    for target in found:
        name, mixer = mixer_list[target.layer]
        if selection[target.layer]["mixer"] != name:
            raise SdloraError(
                f"the SDLoRA selection names mixer {selection[target.layer]['mixer']}, the model {name}"
            )
        param = resolve(base_model, target.name)
        result[target.name] = mask_for(target, param, selection[target.layer], mixer, model_type)
    return result


def train_selected(base_model, mask_by_name: dict[str, torch.Tensor]) -> list:
    """Stage two: each listed tensor trains, its gradient zeroed outside the mask, out of weight decay.

    Returns the hook handles (tests remove them)."""
    handles = []
    for name, mask in mask_by_name.items():
        param = resolve(base_model, name)
        param.requires_grad_(True)
        param._no_weight_decay = True  # AdamW's decay would move the frozen entries
        kept = mask.to(param.device)

        def keep_selected(grad, kept=kept):
            # where(), not a product: a NaN outside the selection must not reach the frozen entries
            return torch.where(
                kept.to(grad.device), grad, torch.zeros((), dtype=grad.dtype, device=grad.device)
            )

        handles.append(param.register_hook(keep_selected))
    return handles


def selected_values(mask_by_name: dict[str, torch.Tensor]) -> int:
    return int(sum(int(m.sum()) for m in mask_by_name.values()))


# ---------------------------------------------------------------- stage one


def run_stage_one(model, base_model, model_type, params, batches_for_step, loss_fn, accelerator, cfg) -> dict:
    """Train the SSM tensors in full and LoRA for the configured steps, choose, then put every weight back.

    ``batches_for_step(i)`` gives step i's collated micro-batches. Returns the selection and a summary."""
    from trainer.data.batches import count_targets

    found = targets(base_model, model_type, params)
    ssm = {t.name: resolve(base_model, t.name) for t in found}
    was_training = {n: p.requires_grad for n, p in ssm.items()}
    for p in ssm.values():
        p.requires_grad_(True)
    trained = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trained]
    before = {n: p.detach().clone() for n, p in ssm.items()}
    o = cfg.optimization
    optimizer = torch.optim.AdamW(
        trained, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon, weight_decay=0.0
    )
    started, losses = time.time(), []
    model.train()
    for step in range(cfg.lora.sdlora_stage_one_steps):
        batches = batches_for_step(step)
        targets_total = max(1, sum(count_targets(b) for b in batches))
        total = 0.0
        for batch in batches:
            ce_sum, _ = loss_fn(model, batch, accelerator)
            (ce_sum / targets_total).backward()
            total += float(ce_sum.detach())
        if o.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trained, o.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / targets_total)
    selection = select(base_model, model_type, params, before, cfg)
    with torch.no_grad():
        for p, value in zip(trained, saved):
            p.copy_(value)
    for name, p in ssm.items():
        p.requires_grad_(was_training[name])
    return {
        "layers": selection,
        "stage_one": {
            "steps": cfg.lora.sdlora_stage_one_steps,
            "seconds": round(time.time() - started, 3),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
        },
    }


def selection_record(model_type: str, params, cfg, result: dict, data: str, rows: int, values: int) -> dict:
    """What ``sdlora_selection.json`` holds (docs/run-folder.md)."""
    return {
        "version": SELECTION_VERSION,
        "method": "sdlora",
        "model_type": model_type,
        "params": list(params),
        "channels_fraction": cfg.lora.sdlora_channels,
        "states_fraction": cfg.lora.sdlora_states,
        "stage_one": {**result["stage_one"], "data": data, "rows": rows},
        "selected_values": values,
        "layers": result["layers"],
    }


def read_selection(path, model_type: str, params) -> dict:
    record = json.loads(path.read_text())
    if record.get("model_type") != model_type or tuple(record.get("params", ())) != tuple(params):
        raise SdloraError(
            f"{path}: made for {record.get('model_type')} with params {record.get('params')}, this run has "
            f"{model_type} with {list(params)}; use a new paths.output_dir"
        )
    return record
