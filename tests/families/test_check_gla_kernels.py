"""bench/check_gla_kernels.py (a GPU diagnostic) keeps working where it can be checked: its error
measure on fla's own recurrence, and a clear refusal without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO


def load_script():
    spec = importlib.util.spec_from_file_location(
        "check_gla_kernels", REPO / "bench" / "check_gla_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_errors_are_zero_for_the_reference_itself_and_bf16_sized_for_bf16():
    from fla.ops.gla.naive import naive_recurrent_gla

    script = load_script()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 48, 2, 16, generator=gen) for _ in range(2))
    v, do = (torch.randn(1, 48, 2, 32, generator=gen) for _ in range(2))
    g = F.logsigmoid(torch.randn(1, 48, 2, 16, generator=gen)) / 16

    def naive(*inputs):
        return naive_recurrent_gla(*inputs)[0]

    reference = script.run(naive, q, k, v, g, do)
    assert set(reference) == {"o", "dq", "dk", "dv", "dg"}
    assert all(
        e == 0.0 for e in script.relative_errors(script.run(naive, q, k, v, g, do), reference).values()
    )
    bf16 = script.relative_errors(script.run(naive, *(t.bfloat16() for t in (q, k, v, g)), do), reference)
    assert all(1e-4 < e < 3e-2 for e in bf16.values()), bf16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gets")
def test_refuses_without_cuda(capsys, tmp_path):
    assert load_script().main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
