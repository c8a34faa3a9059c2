"""Third-party noise is filtered where it arises (one logger, one warning), and --verbose shows it."""

from __future__ import annotations

import logging
import warnings

import pytest

from tests.helpers import REPO
from trainer import quiet
from trainer.cli import build_parser

BNB_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_NOISE = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ..."


@pytest.fixture
def clean_filters(monkeypatch):
    """Each test starts without the kit's filters and leaves none behind."""
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    logger = logging.getLogger(BNB_LOGGER)
    saved = list(logger.filters)
    logger.filters = [f for f in saved if not isinstance(f, quiet.DropMessage)]
    with warnings.catch_warnings():
        yield logger
    logger.filters = saved


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def emit_all(logger) -> tuple[list[str], list[str]]:
    """The bitsandbytes message and a real warning on the same logger, the two noisy warnings and a real one;
    returns what got through."""
    handler = Collect()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # what a user's `-W always` would do; ours are inserted before
            quiet.install()  # does nothing under KIT_VERBOSE=1
            logger.warning(BNB_NOISE, "No module named 'kernels'")
            logger.warning("a different warning")
            warnings.warn_explicit(
                "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                FutureWarning,
                "modeling_utils.py",
                3312,
                module="transformers.modeling_utils",
            )
            warnings.warn_explicit(
                "Attempting to run cuBLAS, but there was no current CUDA context! Attempting to set the primary "
                "context... (Triggered internally at /pytorch/aten/src/ATen/cuda/CublasHandlePool.cpp:335.)",
                UserWarning,
                "graph.py",
                869,
                module="torch.autograd.graph",
            )
            warnings.warn_explicit(
                "something else is deprecated",
                FutureWarning,
                "modeling_utils.py",
                1,
                "transformers.modeling_utils",
            )
    finally:
        logger.removeHandler(handler)
    return handler.messages, [str(w.message) for w in caught]


def test_known_noise_is_dropped_and_nothing_else(clean_filters):
    logs, caught = emit_all(clean_filters)
    assert logs == ["a different warning"]
    assert caught == ["something else is deprecated"]


def test_verbose_keeps_everything(clean_filters, monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    logs, caught = emit_all(clean_filters)
    assert len(logs) == 2 and len(caught) == 3


def test_the_real_transformers_warning_is_the_one_filtered(clean_filters):
    """peft reads model.is_gradient_checkpointing: the FutureWarning transformers raises there is silenced."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny-moe"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ = model.is_gradient_checkpointing
        assert any("is_gradient_checkpointing" in str(w.message) for w in caught)  # it is still raised
        caught.clear()
        quiet.install()
        _ = model.is_gradient_checkpointing
    assert caught == []


def test_verbose_flag_before_or_after_the_verb():
    parser = build_parser()
    assert parser.parse_args(["--verbose", "list"]).verbose
    assert parser.parse_args(["list", "--verbose"]).verbose
    assert not parser.parse_args(["list"]).verbose


def test_liger_backend_probes_are_dropped_and_its_other_warnings_kept(monkeypatch):
    """liger-kernel logs each optional backend it cannot import at the first kernel call (seen on an H100)."""
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    logger = logging.getLogger("liger_kernel.backends.registry")
    saved = list(logger.filters)
    handler = Collect()
    logger.addHandler(handler)
    try:
        quiet.install()
        logger.warning(
            "Backend impl '%s' for op '%s' could not be imported: %s: %s",
            "liger_kernel.ops.backends._cutedsl.rope", "rope", "ImportError", "cutedsl backend requires ...",
        )  # fmt: skip
        logger.warning("no Triton kernel for op %s", "rope")
    finally:
        logger.removeHandler(handler)
        logger.filters = saved
    assert handler.messages == ["no Triton kernel for op rope"]
