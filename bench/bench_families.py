"""GPU benchmark of the GLA and Mamba families: tokens/s and peak memory of LoRA training, per kernel path.

Rows: GLA (~340M, fla's Triton kernels) with LoRA and DoRA; Mamba-2 (~130M) with LoRA and DoRA on its
fast path (mamba_ssm if installed, else fla's Triton SSD) and with LoRA on transformers' PyTorch
reference path, same card and shapes (target: fast >= 20x reference tokens/s); Mamba-1 (~130M) with
LoRA and DoRA on its best path (mamba_ssm) and LoRA on the reference path. Random-init weights, random
tokens, bf16, through the kit's own ``load_for_training`` and the loop's micro-batch loss (family hooks,
PEFT, kernel choice, ``choose_kernels``). Each row runs in its own subprocess (kernel swaps are process-wide; an OOM stays in its row).
A row whose kernels are missing is skipped with the reason. Fast rows also check logits and LoRA
gradients against the reference implementation on one batch, in fp32 (``check``).

    python bench/bench_families.py --steps 50 --out $OUT/families.json
    python bench/bench_families.py --only mamba --steps 20 --out /tmp/families.json   # Mamba-2 and Mamba-1
    python bench/bench_families.py --smoke --inline --steps 2 --out /tmp/smoke.json   # tiny shapes, CPU ok
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess  # noqa: F401 - the tests patch subprocess.run through this module
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

VOCAB = 32000
GLA_340M = {
    "model_type": "gla",
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_heads": 4,
    "expand_k": 0.5,
    "expand_v": 1.0,
    "hidden_ratio": 4,
    "attn_mode": "chunk",
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    **harness.TOKEN_IDS,
}
MAMBA2_130M = {
    "model_type": "mamba2",
    "hidden_size": 768,
    "num_hidden_layers": 24,
    "state_size": 128,
    "expand": 2,
    "head_dim": 64,
    "num_heads": 24,
    "n_groups": 1,
    "chunk_size": 256,
    "vocab_size": VOCAB,
    "tie_word_embeddings": True,
    **harness.TOKEN_IDS,
}
MAMBA_130M = {
    "model_type": "mamba",
    "hidden_size": 768,
    "num_hidden_layers": 24,
    "state_size": 16,
    "expand": 2,
    "vocab_size": VOCAB,
    "tie_word_embeddings": True,
    **harness.TOKEN_IDS,
}
SMOKE = {  # --smoke: the same rows at toy size, to check the script itself (CPU is fine)
    "gla": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 1024},
    "mamba2": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 16, "head_dim": 16, "num_heads": 8},
    "mamba": {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8},
}


@dataclasses.dataclass
class Row:
    name: str
    model: dict
    variant: str
    targets: object
    batch: int
    # "best": whatever the family picks; "reference": transformers' PyTorch code; "trainer": transformers'
    # Trainer + PEFT on the same model folder and the same kernels (the peer a user would pick instead)
    path: str = "best"
    checkpointing: bool = False
    method: str = (
        "lora"  # training.method: lora, or qlora (NF4 base, the family's kernel-read modules kept 16-bit)
    )
    # The loop's autocast (mixed precision). Off: bf16 weights without autocast, as configs/tiny-*.yaml run on a
    # GPU (training.mixed_precision no, model.dtype auto = bf16), where Mamba-1 on mambapy once crashed (issue 30).
    autocast: bool = True


def rows(args) -> list[Row]:
    b_gla, b_m2, b_m1 = args.batch_gla, args.batch_mamba2, args.batch_mamba
    return [
        Row("gla-340m lora", GLA_340M, "lora", "all-linear", b_gla),
        Row("gla-340m dora", GLA_340M, "dora", "all-linear", b_gla),
        Row("gla-340m lora trainer+peft", GLA_340M, "lora", "all-linear", b_gla, path="trainer"),
        # Mamba rows take the family's default targets, which follow the kernel path
        Row("mamba2-130m lora fast", MAMBA2_130M, "lora", None, b_m2),
        Row("mamba2-130m dora fast", MAMBA2_130M, "dora", None, b_m2),
        Row("mamba2-130m lora reference", MAMBA2_130M, "lora", None, b_m2, path="reference"),
        Row("mamba2-130m lora trainer+peft", MAMBA2_130M, "lora", None, b_m2, path="trainer"),
        Row("mamba2-130m qlora fast", MAMBA2_130M, "lora", None, b_m2, method="qlora"),
        Row("mamba2-130m qlora reference", MAMBA2_130M, "lora", None, b_m2, path="reference", method="qlora"),
        # the reference scan keeps [batch, seq, d_inner, state] per layer: recompute layers to fit
        Row("mamba-130m lora fast", MAMBA_130M, "lora", None, b_m1, checkpointing=True),
        Row("mamba-130m dora fast", MAMBA_130M, "dora", None, b_m1, checkpointing=True),
        Row(
            "mamba-130m lora reference", MAMBA_130M, "lora", None, b_m1, path="reference", checkpointing=True
        ),
        Row("mamba-130m qlora fast", MAMBA_130M, "lora", None, b_m1, checkpointing=True, method="qlora"),
        Row(
            "mamba-130m lora fast no-autocast",
            MAMBA_130M,
            "lora",
            None,
            b_m1,
            checkpointing=True,
            autocast=False,
        ),
        Row(
            "mamba-130m qlora fast no-autocast",
            MAMBA_130M,
            "lora",
            None,
            b_m1,
            checkpointing=True,
            method="qlora",
            autocast=False,
        ),  # fmt: skip
    ]


# ---------------------------------------------------------------- one row (runs in its own process)


def model_dir(root: Path, config: dict) -> Path:
    return harness.model_folder(root / config["model_type"], config)


def missing_kernels(row: Row, cuda: bool) -> str | None:
    """Why this row cannot run here, or None."""
    from trainer.families import mamba

    kind = row.model["model_type"]
    if kind == "gla":
        try:
            import fla.models  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"flash-linear-attention not importable ({type(exc).__name__}: {exc})"[:200]
        return None
    if row.path == "reference" or (row.path == "trainer" and not cuda):  # (a CPU smoke run: whatever path)
        return None
    from transformers import Mamba2Config, MambaConfig

    config = (Mamba2Config if kind == "mamba2" else MambaConfig)(
        **{k: v for k, v in row.model.items() if k != "model_type"}
    )
    path = mamba.kernel_path(config)
    if path == mamba.KERNEL_REFERENCE:
        if kind == "mamba2":
            return "no fast Mamba-2 kernels: neither mamba_ssm nor flash-linear-attention with triton on CUDA"
        return "no fast Mamba-1 path: mamba_ssm not importable on CUDA, and mambapy does not train here"
    return None


# model.kernel_path of a "reference" row: transformers' PyTorch code (Mamba), fla's naive recurrence (GLA)
REFERENCE_PATHS = {"mamba": "torch-reference", "mamba2": "torch-reference", "gla": "fla-naive-torch"}


def kit_config(folder: Path, row: Row, seq: int, smoke: bool):
    from trainer.config import build_config

    return build_config(
        {
            "paths": {"output_dir": str(folder / "out")},
            "model": {
                "name_or_path": str(folder),
                "random_init": True,
                "dtype": "fp32" if smoke else "bf16",
                "kernel_path": REFERENCE_PATHS[row.model["model_type"]]
                if row.path == "reference"
                else "auto",
            },
            "training": {"method": row.method, "seed": 0},
            "lora": {
                "r": 16,
                "alpha": 32,
                "dropout": 0.0,
                "variant": row.variant,
                "target_modules": row.targets,
            },
            "data": {"max_length": seq},
            "memory": {"gradient_checkpointing": row.checkpointing},
        }
    )


class Accel:
    """What the micro-batch loss needs: a device and an autocast context."""

    def __init__(self, device, dtype, enabled: bool = True):
        self.device, self._dtype, self._enabled = device, dtype, enabled

    def autocast(self):
        import torch

        if self.device.type != "cuda" or not self._enabled:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self._dtype)


def reference_check(model, row: Row, device, vocab: int) -> dict | None:
    """The fast path against the reference implementation on one batch, same weights, in fp32 (bf16
    rounding would hide or fake differences), in training mode (the kernels that were timed): the largest
    logit difference and the relative difference of the trainable parameters' gradients."""
    import torch

    kind = row.model["model_type"]
    if device.type != "cuda" or row.path == "reference" or row.method == "qlora":
        return None  # (QLoRA: fp32 cannot hold the 4-bit weights; the LoRA row checks the same kernels)
    model.float()  # the row's last use of the model
    ids = torch.randint(3, vocab, (1, 512), device=device, generator=torch.Generator(device).manual_seed(1))
    trainable = [p for p in model.parameters() if p.requires_grad]

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        grads = torch.cat([p.grad.flatten() for p in trainable if p.grad is not None])
        return logits.detach(), grads

    model.train()
    fast_logits, fast_grads = forward_backward()
    with reference_ops(kind):
        slow_logits, slow_grads = forward_backward()
    result = {
        "max_abs_logit_diff": float((fast_logits - slow_logits).abs().max()),
        "max_abs_logit": float(slow_logits.abs().max()),
        "grad_rel_diff": float((fast_grads - slow_grads).norm() / slow_grads.norm().clamp_min(1e-30)),
    }
    if kind == "gla":  # what an fp32 run trains through (trainer.families.gla: TF32 inside chunk_gla)
        with gla_attention_mode(model, "fused_recurrent") as mode:
            fp32_logits, fp32_grads = forward_backward()
        result["fp32_run_mode"] = mode
        result["fp32_run_max_abs_logit_diff"] = float((fp32_logits - slow_logits).abs().max())
        result["fp32_run_grad_rel_diff"] = rel(fp32_grads, slow_grads)
        # the floor: how far the fp32 reference itself is from the same op in fp64 (24 layers amplify
        # an op's last-bit differences); the fp32 run's kernel is read against both
        with gla_op_replaced(naive_gla_in_fp64):
            _, exact_grads = forward_backward()
        result["fp32_reference_vs_fp64_op_grad_rel_diff"] = rel(slow_grads, exact_grads)
        result["fp32_run_vs_fp64_op_grad_rel_diff"] = rel(fp32_grads, exact_grads)
    return result


def rel(a, b) -> float:
    """Relative difference of two flat tensors (norm of the difference over the norm of ``b``)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def naive_gla_in_fp64(
    q, k, v, gk=None, g=None, scale=None, initial_state=None, output_final_state=False, **options
):
    """fla's reference recurrence (fla.ops.gla.naive, which computes in fp32) computed in fp64 and handed
    back in its inputs' dtype: equal-length rows only (the check feeds one 512-token row)."""
    if options.get("cu_seqlens") is not None:
        raise ValueError("naive_gla_in_fp64 takes equal-length rows, not cu_seqlens")
    import torch

    dtype = q.dtype
    q, k, v, gate = (t.transpose(1, 2).double() for t in (q, k, v, gk if gk is not None else g))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    if initial_state is not None:
        h = h + initial_state.double()
    out = []
    for i in range(q.shape[2]):
        h = h * gate[:, :, i].exp()[..., None] + k[:, :, i, :, None] * v[:, :, i, None, :]
        out.append((q[:, :, i, :, None] * scale * h).sum(-2))
    o = torch.stack(out, 2).transpose(1, 2).to(dtype)
    return o, (h.to(dtype) if output_final_state else None)


@contextlib.contextmanager
def gla_attention_mode(model, mode: str):
    """Every GLA attention layer of ``model`` runs ``mode`` for the block (fla reads ``layer.mode`` per call)."""
    from fla.layers.gla import GatedLinearAttention

    layers = [m for m in model.modules() if isinstance(m, GatedLinearAttention)]
    saved = [layer.mode for layer in layers]
    for layer in layers:
        layer.mode = mode
    try:
        yield mode
    finally:
        for layer, old in zip(layers, saved):
            layer.mode = old


@contextlib.contextmanager
def gla_op_replaced(op):
    """fla's GLA layer calls its ops through module globals: every one of them is ``op`` for the block."""
    import fla.layers.gla as layer

    from trainer.families.gla import GLA_OPS

    saved = {name: getattr(layer, name) for name in GLA_OPS}
    for name in GLA_OPS:
        setattr(layer, name, op)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(layer, name, original)


@contextlib.contextmanager
def reference_ops(kind: str):
    """Temporarily put the reference implementations back (GLA: fla's naive op; Mamba: transformers')."""
    if kind == "gla":
        from trainer.families.gla_reference import naive_gla

        with gla_op_replaced(naive_gla):
            yield
    else:
        from trainer.families.mamba import reference_kernels

        with reference_kernels(kind):
            yield


def timed_training(
    loaded, cfg, row: Row, seq: int, steps: int, device, vocab: int, profile: bool = False, check: bool = True
) -> dict:
    """Warm-up, then ``steps`` timed optimizer steps on one random batch; with ``profile``, two more under
    torch.profiler (kernel time by category: bench/kernel_profile.py); the reference check last."""
    import torch

    from trainer.data.dataset import Sequence, collate
    from trainer.fastpath.layer_graphs import CudaGraphs
    from trainer.training.step import choose_kernels, count_targets

    cuda = device.type == "cuda"
    kernels = choose_kernels(loaded, cfg, device)  # the loop's micro-batch loss, picked as the loop picks it
    model = kernels.prepare(loaded.model).to(device)
    result = dict(
        kernel_path=loaded.report["kernel_path"],
        total_params_m=round(loaded.report["total_params"] / 1e6, 1),
        trainable_params_m=round(loaded.report["trainable_params"] / 1e6, 2),
        packing=loaded.family.packing,
        fast_path={
            k: v
            for k, v in loaded.report.get("fast_path", {}).items()
            if k
            in (
                "enabled",
                "reason",
                "fused_loss",
                "lora_modules_fused",
                "rms_norm",
                "family_modules",
                "cuda_graphs",
            )
        },
    )
    gen = torch.Generator().manual_seed(0)
    rows_ = [torch.randint(3, vocab, (seq,), generator=gen).tolist() for _ in range(row.batch)]
    batch = collate([Sequence(r, r, list(range(seq))) for r in rows_], 0)
    targets = count_targets(batch)
    accel = Accel(device, torch.bfloat16, row.autocast)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    warmup = min(3, steps)
    losses = []

    def train_step(_=None):
        optimizer.zero_grad(set_to_none=True)
        ce_sum, _ = kernels.loss(model, batch, accel)
        (ce_sum / targets).backward()
        optimizer.step()
        return ce_sum

    for i in range(warmup + steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
        losses.append(float(train_step().detach()) / targets)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    from trainer import fastpath

    graphs = fastpath.layer_graphs_of(model)
    result["graphs"] = graphs.describe() if graphs is not None else None  # how many captured, or why off
    if profile and cuda:
        from bench import kernel_profile

        result.update(kernel_profile.profile_steps(train_step, 2))
    result.update(
        status="ok",
        tokens_per_s=round(row.batch * seq * steps / elapsed, 1),
        step_s=round(elapsed / steps, 4),
        # CUDA graphs' pools (the kit's replayed layers) hold memory the allocator's peak stops counting
        peak_gib=round((torch.cuda.max_memory_allocated() + CudaGraphs.unseen_bytes_now()) / 2**30, 2)
        if cuda
        else None,
        first_loss=round(losses[0], 4),
        last_loss=round(losses[-1], 4),
        check=reference_check(model, row, device, vocab) if check else None,
    )
    return result


def run_row(row: Row, steps: int, seq: int, smoke: bool, profile: bool = False, check: bool = True) -> dict:
    import torch

    from trainer.model.loading import load_for_training

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    result = {"row": row.name, "variant": row.variant, "method": row.method, "batch": row.batch, "seq": seq}
    result["steps"] = steps
    result["gradient_checkpointing"] = row.checkpointing
    result["autocast"] = row.autocast
    why = missing_kernels(row, cuda)
    if why:
        return {**result, "status": "skipped", "reason": why}
    model_config = {**row.model, **(SMOKE[row.model["model_type"]] if smoke else {})}
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        folder = model_dir(Path(tmp), model_config)
        if row.path == "trainer":
            if not cuda and model_config["model_type"] == "gla":
                return {**result, "status": "skipped", "reason": "fla's GLA model needs CUDA for its kernels"}
            from bench.family_peers import trainer_row

            harness.save_random_weights(folder, device=device.type)
            result.update(
                trainer_row(folder, dataclasses.replace(row, model=model_config), seq, steps, device)
            )
            return result
        cfg = kit_config(folder, dataclasses.replace(row, model=model_config), seq, smoke)
        with contextlib.ExitStack() as stack:
            if row.path == "reference":  # model.kernel_path picks it; the ops stay unbound for the whole row
                stack.enter_context(reference_ops(model_config["model_type"]))
            loaded = load_for_training(cfg, device)
            vocab = model_config["vocab_size"]
            result.update(timed_training(loaded, cfg, row, seq, steps, device, vocab, profile, check))
        return result


def run_row_safely(
    row: Row, steps: int, seq: int, smoke: bool, profile: bool = False, check: bool = True
) -> dict:
    import torch

    try:
        return run_row(row, steps, seq, smoke, profile, check)
    except torch.cuda.OutOfMemoryError as exc:
        return {"row": row.name, "status": "oom", "reason": str(exc).splitlines()[0][:200]}
    except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
        return {"row": row.name, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}


# ---------------------------------------------------------------- the table


def ratio_notes(results: list[dict]) -> list[str]:
    """Fast over reference tokens/s for each Mamba generation measured both ways (target: 20x for Mamba-2)."""
    by_name = {r["row"]: r for r in results}
    notes = []
    for label, prefix, target in (("Mamba-2", "mamba2-130m", 20), ("Mamba-1", "mamba-130m", None)):
        fast, ref = by_name.get(f"{prefix} lora fast"), by_name.get(f"{prefix} lora reference")
        if not (fast and ref and fast.get("status") == ref.get("status") == "ok"):
            continue
        ratio = fast["tokens_per_s"] / ref["tokens_per_s"]
        verdict = (
            "" if target is None else f" ({'meets' if ratio >= target else 'MISSES'} the {target}x target)"
        )
        notes.append(f"{label} fast ({fast['kernel_path']}) / reference: {ratio:.1f}x tokens/s{verdict}")
    for label, kit_row, peer_row in (
        ("GLA-340M", "gla-340m lora", "gla-340m lora trainer+peft"),
        ("Mamba-2 130M", "mamba2-130m lora fast", "mamba2-130m lora trainer+peft"),
    ):
        kit, peer = by_name.get(kit_row), by_name.get(peer_row)
        if not (kit and peer and kit.get("status") == peer.get("status") == "ok"):
            continue
        ratio = kit["tokens_per_s"] / peer["tokens_per_s"]
        peaks = (kit.get("peak_gib"), peer.get("peak_gib"))
        if None in peaks:  # a CPU run: no memory to compare
            notes.append(f"{label} kit / Trainer + PEFT: {ratio:.2f}x tokens/s")
            continue
        verdict = "meets" if ratio >= 1.5 and peaks[0] <= peaks[1] else "MISSES"
        notes.append(
            f"{label} kit / Trainer + PEFT: {ratio:.2f}x tokens/s, peak {peaks[0]:.2f} / {peaks[1]:.2f} GiB "
            f"({verdict} the 1.5x-at-no-more-memory target)"
        )
    return notes


def table(results: list[dict]) -> str:
    head = f"{'row':28} {'kernel path':17} {'params':>7} {'batch x seq':>11} {'tokens/s':>10} {'peak GiB':>8}  check"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"{r['row']:28} {r.get('status', '?').upper()}: {r.get('reason', '')}")
            continue
        check = r.get("check")
        check_text = (
            f"|dlogit| {check['max_abs_logit_diff']:.3g}, grad rel {check['grad_rel_diff']:.2g}"
            if check
            else ""
        )
        if check and check["max_abs_logit_diff"] == 0.0:
            check_text += " (identical: did the fast path engage?)"
        if check and "fp32_run_grad_rel_diff" in check:
            check_text += (
                f"; fp32 runs ({check['fp32_run_mode']}): grad rel {check['fp32_run_grad_rel_diff']:.2g}"
            )
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"{r['row']:28} {r['kernel_path']:17} {r['total_params_m']:>6}M "
            f"{str(r['batch']) + ' x ' + str(r['seq']):>11} {r['tokens_per_s']:>10,.0f} {peak:>8}  {check_text}"
        )
    lines.extend(ratio_notes(results))
    return "\n".join(lines)


def environment() -> dict:
    import torch

    from trainer.tools.hardware import package_versions

    info = {"python": sys.version.split()[0], "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    names = ("torch", "transformers", "peft", "triton", "flash-linear-attention", "mamba-ssm", "mambapy")
    return {**info, **package_versions(names)}


def run_row_child(row, args, argv) -> dict:
    """One row in its own process (a fresh CUDA context and allocator); ``--row-timeout`` bounds it."""
    child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--row", row.name]
    done = harness.run_child(child, args.row_timeout)
    if done.returncode == harness.TIMED_OUT:
        sys.stderr.write("\n".join(done.stderr.strip().splitlines()[-3:]) + "\n")
        return {
            "row": row.name,
            "status": "timeout",
            "reason": f"still running after {args.row_timeout:.0f} s",
        }
    sys.stderr.write("\n".join(done.stderr.splitlines()[-3:]) + "\n")
    found = harness.result_lines(done.stdout, "ROW-RESULT ")
    if found:
        return found[-1]
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"row": row.name, "status": "error", "reason": f"exit {done.returncode}: {tail[0]}"[:300]}


def limit_autotuning(most: int, autotuner=None) -> None:
    """Every Triton autotuner of this process tries at most ``most`` of its configs (the first ones, as
    the kernel lists them after its own pruning): compiling every config of every fla kernel for each new
    shape and dtype is what makes a cold machine's first fp32 check take more than ten minutes."""
    if autotuner is None:
        from triton.runtime.autotuner import Autotuner as autotuner
    prune = autotuner.prune_configs
    if getattr(prune, "limited_to", None) is not None:
        prune = prune.__wrapped__

    def limited(self, *args, **kwargs):
        return list(prune(self, *args, **kwargs))[:most]

    limited.__wrapped__, limited.limited_to = prune, most
    autotuner.prune_configs = limited


def write_report(out: str, results: list[dict]) -> None:
    harness.write_json(out, {"environment": environment(), "rows": results, "summary": ratio_notes(results)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=50, help="timed optimizer steps per row (after 3 warm-up)"
    )
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch-gla", type=int, default=8)
    parser.add_argument(
        "--batch-mamba2", type=int, default=2, help="the reference path needs ~40 GiB at 2 x 2048"
    )
    parser.add_argument("--batch-mamba", type=int, default=4)
    parser.add_argument(
        "--only", default="", help="run rows whose name contains this (e.g. mamba2, gla, dora)"
    )
    parser.add_argument("--out", default="families.json", help="JSON file for the results")
    parser.add_argument(
        "--smoke", action="store_true", help="toy model sizes (check the script, not the GPU)"
    )
    parser.add_argument(
        "--row-timeout",
        type=float,
        default=None,
        help="seconds a row may run before it is recorded as a timeout",
    )
    parser.add_argument("--inline", action="store_true", help="run rows in this process instead of one each")
    parser.add_argument(
        "--autotune-configs",
        type=int,
        default=None,
        help="Triton autotunes over at most this many configs per kernel (fla's first-use autotuning of "
        "fp32 kernels outlasts a 10-minute call; the figures are checks, not timings)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="kit rows: kernel time by category over two extra steps (GPU)"
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip each row's fp32 check against the reference (timings only)",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row, print its JSON
    args = parser.parse_args(argv)
    if args.autotune_configs:
        limit_autotuning(args.autotune_configs)
    if args.smoke:
        args.seq = min(args.seq, 64)
        args.batch_gla = args.batch_mamba2 = args.batch_mamba = 2

    if args.row is not None:
        row = next(r for r in rows(args) if r.name == args.row)
        print(
            "ROW-RESULT "
            + json.dumps(
                run_row_safely(row, args.steps, args.seq, args.smoke, args.profile, not args.no_check)
            ),
            flush=True,
        )
        return 0

    results = []
    for row in rows(args):
        if args.only and args.only not in row.name:
            continue
        print(f"== {row.name}", file=sys.stderr, flush=True)
        if args.inline:
            results.append(
                run_row_safely(row, args.steps, args.seq, args.smoke, args.profile, not args.no_check)
            )
        else:
            results.append(run_row_child(row, args, argv))
        write_report(args.out, results)  # after every row: a call cut short keeps the rows it finished
    write_report(args.out, results)
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
