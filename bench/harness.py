"""What the benchmark scripts share, so each of them keeps only what it measures.

Random-init model folders (config.json, the shipped tokenizer, weights saved once), child processes (the
repository first on their PYTHONPATH, a timeout that ends them as a row rather than a crash, the JSON line
they hand back), the JSON file rewritten after every row, and markdown tables.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- model folders

TINY_TOKENIZER = REPO / "configs" / "tiny-moe"
# The special tokens of the shipped offline tokenizers: ids below 3, valid in any vocabulary.
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_folder(folder: Path, config: dict, tokenizer: Path = TINY_TOKENIZER) -> Path:
    """A local model folder: ``config`` as config.json beside the tokenizer files of ``tokenizer`` (a
    shipped tiny model's folder). No weights: a run initialises them, or ``save_random_weights`` does once."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def save_random_weights(folder: Path | str, dtype: str = "bfloat16", device: str = "cuda") -> None:
    """Random-init weights (seed 0) for the config in ``folder``, built on ``device`` and saved there, so
    every later run loads them in seconds instead of initialising its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype)
        )
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # a caller that stays alive would hold the cache while its runs measure


# ---------------------------------------------------------------- child processes

TIMED_OUT = "timeout"  # the return code of a child stopped at its timeout


def child_env(**extra: str) -> dict:
    """This environment with the repository first on PYTHONPATH (the caller's entries after it), so a
    child imports this checkout's trainer and bench; ``extra`` variables on top."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_child(command: list[str], timeout: float | None = None, cwd=None, env=None):
    """``command`` to its end, its output captured as text (a ``subprocess.CompletedProcess``). One still
    running after ``timeout`` seconds is killed and comes back with return code ``TIMED_OUT`` and what it
    had printed by then."""
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        printed = as_text(expired.stdout), as_text(expired.stderr)
        return subprocess.CompletedProcess(command, TIMED_OUT, *printed)


def as_text(output: bytes | str | None) -> str:
    """A timed-out child's output as text: subprocess hands it over as bytes (or None), text=True or not."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def result_lines(stdout: str, prefix: str) -> list[dict]:
    """The JSON after ``prefix`` on each line of ``stdout`` that starts with it: a child's rows."""
    return [json.loads(line[len(prefix) :]) for line in stdout.splitlines() if line.startswith(prefix)]


def output_tail(result: subprocess.CompletedProcess, chars: int) -> str:
    """The last ``chars`` of what a failed child said: its stderr, or its stdout where stderr is empty."""
    return (result.stderr or result.stdout)[-chars:]


# ---------------------------------------------------------------- results


def write_json(path: Path | str, data, indent: int = 2) -> None:
    """``data`` as the JSON file ``path``, rewritten whole after every row so that a call cut short keeps
    what it measured; written beside it and renamed over it, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    os.replace(tmp, path)


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table: ``header``, its rule, then one line per row of cells (as ``str`` gives them)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
