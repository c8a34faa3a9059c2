"""The kit's gated ``chunk_bwd_dqkwg`` (trainer/families/fla_gated_dqk.py): right against eager autograd, and
offered to fla only for the calls fla's own guard refuses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fla")

import torch  # noqa: E402

from trainer.families import fla_gated_dqk  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_matches_eager_autograd_in_fp32_batched_and_packed():
    """Triton's interpreter runs the kernel on the CPU; both state layouts, a batch and packed sequences."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/families/gated_dqk_check.py")],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(report) == ["kit-float32-batch", "kit-float32-varlen"]
    for case in report.values():
        assert case.pop("dw_is_none") is True
        assert max(case.values()) < 1e-5, report


def _dispatch_args(gated: bool) -> dict:
    q = torch.zeros(1, 64, 2, 16)
    return dict(
        q=q, k=q, v=q, do=q, h=torch.zeros(1, 2, 16, 16), dh=torch.zeros(1, 2, 16, 16),
        g=torch.zeros(1, 64, 2) if gated else None, scale=1.0, state_v_first=True,
    )  # fmt: skip


def test_fla_dispatches_the_refused_gated_case_to_the_kit_and_keeps_the_rest(monkeypatch):
    from fla.ops.common import chunk_o

    calls = []
    monkeypatch.setattr(fla_gated_dqk, "gated_chunk_bwd_dqkwg", lambda **kw: calls.append(kw) or "kit")
    monkeypatch.setattr(fla_gated_dqk, "affected", lambda: True)
    assert fla_gated_dqk.register()
    assert chunk_o.chunk_bwd_dqkwg(**_dispatch_args(gated=True)) == "kit"
    assert calls and calls[0]["state_v_first"] is True

    from fla.backends import _get_operation_registry

    backend = _get_operation_registry("common")._backends[fla_gated_dqk.BACKEND_NAME]
    accepted, why = backend.verify("chunk_bwd_dqkwg", **_dispatch_args(gated=False))
    assert not accepted and "gated" in why
    monkeypatch.setattr(
        fla_gated_dqk, "affected", lambda: False
    )  # fla's kernel is right here: it keeps the call
    accepted, why = backend.verify("chunk_bwd_dqkwg", **_dispatch_args(gated=True))
    assert not accepted and "right" in why


def test_the_gated_kernel_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="per-position gate"):
        fla_gated_dqk.gated_chunk_bwd_dqkwg(**_dispatch_args(gated=False))
