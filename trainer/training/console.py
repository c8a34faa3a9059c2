"""What the terminal shows: the run's start (model, data, length report), and its end (report, summary)."""

from __future__ import annotations

from pathlib import Path

from trainer.config import Config


def announce(accelerator, cfg: Config, loaded, data, total_steps: int, resume_from) -> None:
    if not accelerator.is_main_process:
        return
    r = loaded.report
    print(
        f"model: {cfg.model.name_or_path} ({loaded.family.name}/{loaded.model_type}, {cfg.training.method}) "
        f"params {r['total_params']:,}, trainable {r['trainable_params']:,}",
        flush=True,
    )
    if r["unquantized_expert_bytes"] and cfg.training.method == "qlora":
        print(
            f"WARNING: {r['unquantized_expert_bytes'] / 2**30:.2f} GiB of fused MoE expert weights are NOT "
            "4-bit quantized (bitsandbytes replaces nn.Linear only; see bitsandbytes issue 1849). "
            f"Unquantized total: {r['unquantized_bytes'] / 2**30:.2f} GiB.",
            flush=True,
        )
    d = data.report
    print(
        f"data: {d.train_records} train / {d.val_records} val records -> {d.train_sequences} / {d.val_sequences} "
        f"rows of {cfg.data.max_length} tokens (packing {'on' if d.packing else 'off'}; skipped lines {d.skipped_lines}; "
        f"truncation would lose {d.truncation_would_lose_tokens:,} tokens, lost {d.truncated_tokens:,})",
        flush=True,
    )
    how = "reused" if d.cache_hit else "built"
    print(
        f"data: {d.format} format, cache {d.fingerprint} {how} ({d.cache}), ready in {d.prepare_seconds:.1f} s",
        flush=True,
    )
    where = (
        f"resuming from {resume_from.path} at step {resume_from.step}" if resume_from else "starting fresh"
    )
    print(f"training: {total_steps} steps on {accelerator.num_processes} process(es), {where}", flush=True)


def length_report(report: dict, output_dir: Path, log, step: int) -> None:
    """Token-length distribution of the training data (measured when its cache was built), at the start of
    every run: printed, written as the run folder's data report, and logged as an event."""
    from trainer.data.length_report import summary_line, write_data_report

    write_data_report(report, output_dir)
    print(summary_line(report), flush=True)
    log.event(
        "length_report",
        step=step,
        lengths=report["lengths"],
        max_length=report["max_length"],
        truncation_lost_fraction=report["truncation_lost_fraction"],
        sampled=report["sampled"],
    )


def end_of_run_report(output_dir: Path) -> None:
    """HTML + PNG report in the run folder and an ASCII loss curve on the terminal; never fails the run."""
    from trainer.reports.report import ReportError, ascii_loss_curve, write_report

    try:
        print(ascii_loss_curve(output_dir), flush=True)
        print(f"report: {write_report(output_dir)}", flush=True)
    except (ReportError, OSError, ValueError) as exc:
        print(f"report: not written ({exc})", flush=True)


def print_summary(
    output_dir: Path, status: str, step: int, total: int, final_loss, best, cfg: Config
) -> None:
    loss = f"{final_loss:.4f}" if isinstance(final_loss, float) else "n/a"
    best_text = f"{best:.4f}" if isinstance(best, float) else "n/a"
    print(
        f"\nrun {status} at step {step}/{total}; last loss {loss}; best {cfg.eval.metric_for_best} {best_text}"
    )
    print(f"run folder: {output_dir}")
    print(
        f"dashboard:  ./launch_dashboard.sh --logdir {output_dir.parent}   (then open http://localhost:5000)"
    )
