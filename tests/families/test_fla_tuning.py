"""fla's tuned Triton configurations: what bench/gla_startup.py exports is what fla's own lookup finds, and the
family turns the lookup on only for a card the kit has configurations for, never over the user's settings."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench import gla_startup
from trainer.families import fla_tuning

cache = pytest.importorskip("fla.ops.utils.cache", reason="the gla family needs flash-linear-attention")

KEY = [64, "IS_VARLEN", True, "torch.bfloat16", "torch.float32"]  # key values, then the tensors' dtypes


def _triton_cache(folder, kernel: str, key, timings: dict) -> None:
    """One autotuning result as Triton 3.x writes it with cache_results (a hashed sub-folder per key)."""
    sub = folder / f"hash{len(list(folder.glob('*')))}"
    sub.mkdir(parents=True)
    configs = [
        ({"kwargs": {"BK": bk}, "num_warps": warps, "num_ctas": 1, "num_stages": 2, "maxnreg": None,
          "pre_hook": None, "ir_override": None}, [ms, ms * 0.9, ms * 1.1])
        for (bk, warps), ms in timings.items()
    ]  # fmt: skip
    (sub / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": configs}))


def test_exported_configs_are_what_fla_looks_up(tmp_path, monkeypatch):
    triton_cache = tmp_path / "triton"
    _triton_cache(
        triton_cache, "chunk_gla_fwd_kernel_o", KEY, {(32, 4): 0.02, (64, 8): 0.01, (64, 2): float("inf")}
    )
    _triton_cache(triton_cache, "chunk_gla_fwd_kernel_o", [*KEY[:2], False, *KEY[3:]], {(32, 2): 0.01})
    folder = tmp_path / "configs"
    assert gla_startup.main(["export", "--triton-cache", str(triton_cache), "--to", str(folder)]) == 0
    monkeypatch.setenv("FLA_CONFIG_DIR", str(folder))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    found = cache.load_cached_config("chunk_gla_fwd_kernel_o", cache.AutotuneKey(tuple(KEY)))
    assert found["kwargs"] == {"BK": 64} and found["num_warps"] == 8  # the fastest finite one
    other = cache.load_cached_config(
        "chunk_gla_fwd_kernel_o", cache.AutotuneKey(tuple([*KEY[:2], False, *KEY[3:]]))
    )
    assert other["kwargs"] == {"BK": 32} and other["num_warps"] == 2
    assert (
        cache.load_cached_config("chunk_gla_fwd_kernel_o", cache.AutotuneKey((128, *KEY[1:]))) is None
    )  # strict


def test_two_kernels_of_one_name_disagreeing_are_left_to_autotune(tmp_path):
    triton_cache = tmp_path / "triton"
    _triton_cache(triton_cache, "fwd_kernel", KEY, {(32, 4): 0.01})
    _triton_cache(triton_cache, "fwd_kernel", KEY, {(64, 4): 0.01})
    _triton_cache(triton_cache, "bwd_kernel", KEY, {(64, 4): 0.01})
    gla_startup.main(["export", "--triton-cache", str(triton_cache), "--to", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bwd_kernel.json"]


def test_an_export_adds_only_the_keys_a_shipped_folder_lacks_marked_with_their_card(tmp_path, monkeypatch):
    """``export --configs DIR --add-to-existing --measured-on CARD``: the shipped folder's own entries stay as they
    were; a key it lacks is added, marked with the card that measured it, and fla's lookup finds both."""
    shipped_cache, other_cache = tmp_path / "shipped-triton", tmp_path / "other-triton"
    _triton_cache(shipped_cache, "chunk_gla_fwd_kernel_o", KEY, {(32, 4): 0.01})
    plain_key = [*KEY[:2], False, *KEY[3:]]
    _triton_cache(other_cache, "chunk_gla_fwd_kernel_o", KEY, {(64, 8): 0.01})  # the shipped pick stays
    _triton_cache(other_cache, "chunk_gla_fwd_kernel_o", plain_key, {(64, 2): 0.01})
    shipped, other = tmp_path / "shipped", tmp_path / "other"
    assert gla_startup.main(["export", "--triton-cache", str(shipped_cache), "--to", str(shipped)]) == 0
    assert gla_startup.main(["export", "--triton-cache", str(other_cache), "--to", str(other)]) == 0
    assert (
        gla_startup.main(
            [
                "export",
                "--configs",
                str(other),
                "--to",
                str(shipped),
                "--add-to-existing",
                "--measured-on",
                "H200",
            ]
        )
        == 0
    )
    entries = json.loads((shipped / "chunk_gla_fwd_kernel_o.json").read_text())["autotune_entries"]
    assert sorted(str(e.get("measured_on")) for e in entries.values()) == ["H200", "None"]
    monkeypatch.setenv("FLA_CONFIG_DIR", str(shipped))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    own = cache.load_cached_config("chunk_gla_fwd_kernel_o", cache.AutotuneKey(tuple(KEY)))
    added = cache.load_cached_config("chunk_gla_fwd_kernel_o", cache.AutotuneKey(tuple(plain_key)))
    assert (own["kwargs"], own["num_warps"]) == ({"BK": 32}, 4)
    assert (added["kwargs"], added["num_warps"]) == ({"BK": 64}, 2)


@pytest.fixture
def on_a_gpu(monkeypatch, tmp_path):
    """CUDA looks available, the GPU is called ``Test_GPU``, fla's lookup is off, the user set nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cache, "get_gpu_info", lambda: "Test_GPU")
    monkeypatch.setattr(fla_tuning, "this_card", lambda: {"capability": [8, 0], "multiprocessors": 108})
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.DISABLED)
    monkeypatch.setattr(fla_tuning, "CONFIG_ROOT", tmp_path / "fla_configs")
    for name in fla_tuning.USER_SETTINGS:  # set, then removed: monkeypatch puts them back as they were after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path / "fla_configs" / "Test_GPU"


def test_the_lookup_is_turned_on_for_a_card_with_shipped_configs(on_a_gpu, capsys):
    assert fla_tuning.use_tuned_configs() is None  # no folder for this card: fla autotunes as before
    assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED
    on_a_gpu.mkdir(parents=True)
    (on_a_gpu / "k.json").write_text("{}")
    assert fla_tuning.use_tuned_configs() == on_a_gpu
    assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.STRICT
    assert cache.get_fla_config_dir() == on_a_gpu
    assert (
        "fla: tuned Triton configurations for Test_GPU (1 kernels, lookup on for" in capsys.readouterr().out
    )


def test_the_users_fla_settings_are_left_alone(on_a_gpu, monkeypatch):
    on_a_gpu.mkdir(parents=True)
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert fla_tuning.use_tuned_configs() is None
    assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.DISABLED and "FLA_CONFIG_DIR" not in os.environ


def test_fla_kernels_on_triton_autotune_get_the_lookup_too(tmp_path, monkeypatch):
    """chunk_fwd_kernel_h (GLA's chunk state) is built with plain triton.autotune, which never looks anything
    up: a fresh H100 autotuned it for 35 s per key with its configuration shipped. Routed, it finds it."""
    import fla.ops.common.chunk_h as chunk_h
    from triton.runtime.autotuner import Autotuner

    routed = fla_tuning.route_autotuners_through_lookup(cache.CachedAutotuner)
    tuner = chunk_h.chunk_fwd_kernel_h
    while not isinstance(tuner, Autotuner):
        tuner = tuner.fn
    assert isinstance(tuner, cache.CachedAutotuner) and tuner.kernel_name == "chunk_fwd_kernel_h"
    assert fla_tuning.route_autotuners_through_lookup(cache.CachedAutotuner) == routed > 100  # all, once

    _triton_cache(tmp_path / "triton", "chunk_fwd_kernel_h", KEY, {(64, 4): 0.01})
    gla_startup.main(
        ["export", "--triton-cache", str(tmp_path / "triton"), "--to", str(tmp_path / "configs")]
    )
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "configs"))
    monkeypatch.setattr(cache, "FLA_CACHE_MODE", cache.FlaCacheMode.STRICT)
    monkeypatch.setattr(tuner, "cache", {})
    tuner.maybe_load_cached_config(cache.AutotuneKey(tuple(KEY)), nargs={}, runtime_kwargs={})
    chosen = tuner.cache[tuple(KEY)]
    assert chosen.kwargs == {"BK": 64} and chosen.num_warps == 4


H100 = {"capability": [9, 0], "multiprocessors": 132}


def test_a_card_of_the_same_architecture_and_size_borrows_a_measured_cards_configs(
    on_a_gpu, monkeypatch, capsys
):
    """A card with no folder of its own (an H200) takes the configurations measured on one with the same compute
    capability and multiprocessor count (the H100 SXM), saying so; a card of another size autotunes."""
    root = on_a_gpu.parent
    measured = root / "Measured_GPU"
    measured.mkdir(parents=True)
    (measured / "k.json").write_text("{}")
    (root / fla_tuning.CARDS_FILE).write_text(json.dumps({"Measured_GPU": H100}))
    monkeypatch.setattr(fla_tuning, "this_card", lambda: {"capability": [9, 0], "multiprocessors": 114})
    assert fla_tuning.use_tuned_configs() is None  # an H100 PCIe's size: autotunes
    monkeypatch.setattr(fla_tuning, "this_card", lambda: dict(H100))
    assert fla_tuning.use_tuned_configs() == measured
    assert cache.FLA_CACHE_MODE is cache.FlaCacheMode.STRICT and cache.get_fla_config_dir() == measured
    assert "for Measured_GPU, measured there for this Test_GPU of the same" in capsys.readouterr().out
    on_a_gpu.mkdir()
    assert fla_tuning.folder_for("Test_GPU", H100) == (on_a_gpu, False)  # its own folder comes first


def test_the_shipped_cards_file_names_shipped_folders():
    cards = json.loads((fla_tuning.CONFIG_ROOT / fla_tuning.CARDS_FILE).read_text())
    assert cards and all((fla_tuning.CONFIG_ROOT / name).is_dir() for name in cards)
    assert {
        "capability": [9, 0],
        "multiprocessors": 132,
    } in cards.values()  # the H100 SXM, which an H200 matches
