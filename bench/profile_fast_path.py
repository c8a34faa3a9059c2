"""Where a training step's milliseconds go, fast path against reference, on one GPU.

Loads the model through the trainer's own ``load_for_training`` (so the fast path is exactly what a run
gets), runs warm-up steps, times steps with CUDA events, then profiles steps with torch.profiler and
prints kernel time by category. ``--check`` also compares the fast path with the reference on the same
weights and batch: the fused autograd functions in fp32, and the bf16 loss and LoRA gradients of the model.

    python bench/profile_fast_path.py --model DIR --method lora --gc --fast auto --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness, kernel_profile  # noqa: E402


def make_cfg(args, out: Path):
    import yaml

    from trainer.config import load_config

    cfg = {
        "paths": {"output_dir": str(out), "train_file": str(harness.REPO / "data" / "tiny_corpus.jsonl")},
        "model": {"name_or_path": args.model, "random_init": not (Path(args.model) / "model.safetensors").exists(),
                  "attn_implementation": args.attn},
        "training": {"method": args.method, "mixed_precision": "bf16", "micro_batch_size": args.batch},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": harness.ALL_LINEAR},
        "quantization": {"compute_dtype": "bf16"},
        "memory": {"gradient_checkpointing": args.gc},
        "performance": {"fast_path": args.fast},
    }  # fmt: skip
    path = out / f"{args.method}-{args.fast}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def host_probe() -> dict:
    """How fast this process issues tiny ops right now, and what shares its CPU: a slow host shows here."""
    import os
    import threading

    x = torch.empty(8)
    started = time.perf_counter()
    for _ in range(20000):
        x.view(-1)
    view_us = (time.perf_counter() - started) / 20000 * 1e6
    started = time.perf_counter()
    total = 0
    for i in range(200000):
        total += i
    py_ns = (time.perf_counter() - started) / 200000 * 1e9
    return {
        "view_us": round(view_us, 3),
        "py_add_ns": round(py_ns, 1),
        "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "load": os.getloadavg(),
    }


def pick_sdpa_backend(name: str) -> None:
    """Lever test: which of torch's sdpa backends serve the model (torch's default order puts cuDNN first on Hopper)."""
    if name == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
    elif name == "efficient":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)


class Accel:
    def __init__(self, device):
        self.device = device

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16)


def build(args, out, fast):
    from trainer.model.loading import load_for_training

    args.fast = fast
    cfg = make_cfg(args, out)
    torch.manual_seed(0)
    loaded = load_for_training(cfg, torch.device("cuda"))
    model = loaded.model.cuda() if next(loaded.model.parameters()).device.type != "cuda" else loaded.model
    model.train()
    return model, loaded.report


def batch_of(args, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 32000, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def step(model, opt, batch, accel):
    from trainer.training.step import forward_loss

    ce, aux = forward_loss(model, batch, accel)
    tokens = (batch["labels"][:, 1:] != -100).sum()
    (ce / tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(ce) / float(tokens)


def time_and_profile(args, out):
    model, report = build(args, out, args.fast)
    accel = Accel(torch.device("cuda"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for i in range(3):
        step(model, opt, batch_of(args, i), accel)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    probe = host_probe()
    times, losses = [], []
    for i in range(args.steps):
        b = batch_of(args, 100 + i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step(model, opt, b, accel))
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    med = sorted(times)[len(times) // 2]
    row = {
        "name": f"{args.method}{'+gc' if args.gc else ''} fast={args.fast} norm={args.norm} attn={args.attn}"
        f"{' no-qkv-group' if args.no_group else ''} sdpa={args.sdpa}",
        "step_s": round(med, 4),
        "tokens_per_sec": round(args.batch * args.seq / med),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "fast_path": report.get("fast_path"),
        "losses": [round(x, 4) for x in losses],
        "host": probe,
    }
    if args.profile:
        trace = str(out / f"trace-{args.method}-{args.fast}.json") if args.trace else None
        row.update(
            kernel_profile.profile_steps(
                lambda i, m=model, o=opt: step(m, o, batch_of(args, 200 + i), accel), 2, trace=trace
            )
        )
    del model, opt
    torch.cuda.empty_cache()
    return row


def check_functions():
    """The fused autograd functions against eager PyTorch on the GPU, fp32 (TF32 off) and with a 4-bit base."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    from trainer.fastpath.lora_ops import BaseWeight, lora_group, lora_linear, lora_mlp

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    dev = "cuda"
    res = {}

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # 4-bit base, fp32 compute
    w = torch.randn(512, 256, device=dev) * 0.05
    q, st = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8)
    st.dtype = torch.float32
    p4 = bnb.nn.Params4bit(q, requires_grad=False, quant_state=st, bnb_quantized=True, quant_type="nf4")
    dense = bnbf.dequantize_4bit(q, st).float()
    a = (torch.randn(16, 256, device=dev) * 0.1).requires_grad_()
    b = (torch.randn(512, 16, device=dev) * 0.1).requires_grad_()
    x = torch.randn(4, 64, 256, device=dev, requires_grad=True)
    y = lora_linear(x, a, b, BaseWeight(p4, None), 2.0)
    gy = torch.randn_like(y)
    y.backward(gy)
    mine = [y.detach(), x.grad, a.grad, b.grad]
    x.grad = a.grad = b.grad = None
    ref = x @ dense.t() + 2.0 * (x @ a.t()) @ b.t()
    ref.backward(gy)
    res["lora_linear_nf4_fp32"] = max(rel(m, r) for m, r in zip(mine, [ref.detach(), x.grad, a.grad, b.grad]))
    # Q/K/V as one group on NF4 bases of two shapes (the dequant buffer is shared by K and V)
    nf4 = []
    for out_dim in (512, 128, 128):
        w_ = torch.randn(out_dim, 256, device=dev) * 0.05
        q_, st_ = bnbf.quantize_4bit(
            w_, quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8
        )
        st_.dtype = torch.float32
        param = bnb.nn.Params4bit(
            q_, requires_grad=False, quant_state=st_, bnb_quantized=True, quant_type="nf4"
        )
        nf4.append((param, bnbf.dequantize_4bit(q_, st_).float()))
    lo = [((torch.randn(16, 256, device=dev) * 0.1).requires_grad_(),
           (torch.randn(d.shape[0], 16, device=dev) * 0.1).requires_grad_()) for _, d in nf4]  # fmt: skip
    x = torch.randn(4, 64, 256, device=dev, requires_grad=True)
    outs = lora_group(x, *[(a_, b_, BaseWeight(p_, None), 2.0) for (a_, b_), (p_, _) in zip(lo, nf4)])
    gys = [torch.randn_like(o) for o in outs]
    sum((o * g).sum() for o, g in zip(outs, gys)).backward()
    leaves = [x] + [t for pr in lo for t in pr]
    mine = [o.detach() for o in outs] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    refs = [x @ d.t() + 2.0 * (x @ a_.t()) @ b_.t() for (a_, b_), (_, d) in zip(lo, nf4)]
    sum((o * g).sum() for o, g in zip(refs, gys)).backward()
    res["lora_qkv_group_nf4_fp32"] = max(
        rel(m, r) for m, r in zip(mine, [o.detach() for o in refs] + [t.grad for t in leaves])
    )
    # SwiGLU block with Liger's kernels
    ws = [torch.randn(1024, 256, device=dev) * 0.05, torch.randn(1024, 256, device=dev) * 0.05,
          torch.randn(256, 1024, device=dev) * 0.05]  # fmt: skip
    lo = [((torch.randn(16, w.shape[1], device=dev) * 0.1).requires_grad_(),
           (torch.randn(w.shape[0], 16, device=dev) * 0.1).requires_grad_()) for w in ws]  # fmt: skip
    x = torch.randn(4, 64, 256, device=dev, requires_grad=True)
    parts = [(a_, b_, BaseWeight(w_, None), 2.0) for (a_, b_), w_ in zip(lo, ws)]
    y = lora_mlp(x, *parts)
    gy = torch.randn_like(y)
    y.backward(gy)
    leaves = [x] + [t for pr in lo for t in pr]
    mine = [y.detach()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None

    def proj(inp, i):
        (a_, b_), w_ = lo[i], ws[i]
        return inp @ w_.t() + 2.0 * (inp @ a_.t()) @ b_.t()

    ref = proj(torch.nn.functional.silu(proj(x, 0)) * proj(x, 1), 2)
    ref.backward(gy)
    res["lora_mlp_liger_fp32"] = max(
        rel(m, r) for m, r in zip(mine, [ref.detach()] + [t.grad for t in leaves])
    )
    torch.backends.cuda.matmul.allow_tf32 = True
    return {k: float(f"{v:.3g}") for k, v in res.items()}


def check_model(args, out):
    """bf16 loss and LoRA gradients, reference then fast path, same weights and batch (reference first: Liger
    patches RoPE module-wide)."""
    grads, losses = {}, {}
    for fast in ("off", "auto"):
        model, _ = build(args, out, fast)
        accel = Accel(torch.device("cuda"))
        from trainer.training.step import forward_loss

        batch = batch_of(args, 7)
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(
                    0, 0.02, generator=torch.Generator(device=p.device).manual_seed(hash(n) % 2**31)
                )
        ce, _ = forward_loss(model, batch, accel)
        tokens = (batch["labels"][:, 1:] != -100).sum()
        (ce / tokens).backward()
        losses[fast] = float(ce / tokens)
        grads[fast] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        del model
        torch.cuda.empty_cache()
    rels = [float((grads["auto"][n] - grads["off"][n]).norm() / grads["off"][n].norm()) for n in grads["off"]]
    return {
        "loss_ref": round(losses["off"], 5),
        "loss_fast": round(losses["auto"], 5),
        "grad_rel_err_median": round(sorted(rels)[len(rels) // 2], 5),
        "grad_rel_err_max": round(max(rels), 5),
    }


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model folder and the setting profiled (``python bench/profile_loop.py`` takes the same)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--method", default="lora")
    parser.add_argument("--gc", action="store_true")


def main():
    p = argparse.ArgumentParser()
    model_arguments(p)
    p.add_argument("--fast", default="auto")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", default="/tmp/profile")
    p.add_argument("--attn", default=None, help="model.attn_implementation (default: the kit's choice)")
    p.add_argument("--no-group", action="store_true", help="Q/K/V as three nodes (the lever's before)")
    p.add_argument("--save-model", action="store_true")
    p.add_argument("--sdpa", choices=["default", "flash", "efficient"], default="default")
    p.add_argument(
        "--norm", choices=["liger", "torch"], default="torch", help="RMSNorm kernel on the fast path"
    )
    args = p.parse_args()
    out = Path(args.out)
    started = time.time()
    pick_sdpa_backend(args.sdpa)
    if args.norm != "torch":
        import functools

        from trainer import fastpath

        fastpath.apply = functools.partial(fastpath.apply, rms_norm=args.norm)
    if args.no_group:
        import trainer.fastpath

        trainer.fastpath.patch_qkv_groups = lambda model: 0
    if args.save_model:  # random-init once, in bf16: every later process loads it in seconds
        harness.save_random_weights(args.model)
        print(f"saved {args.model} in {time.time() - started:.0f}s", flush=True)
        return
    if args.check:
        print("CHECK", json.dumps({"functions": check_functions(), **check_model(args, out)}), flush=True)
    else:
        print("ROW", json.dumps(time_and_profile(args, out)), flush=True)
    print(f"[{time.time() - started:.0f}s]", file=sys.stderr)


if __name__ == "__main__":
    main()
