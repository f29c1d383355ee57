"""The registry of tuned kernel families: the tuner's checksum covers every file a family is built from and fails
loudly on a missing one; each family's kernels come from the shaders it declares; the bench runs exactly the
benchmarks the families name."""
from __future__ import annotations

import dataclasses

import pytest

from wgpu_train.bench import suite
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.catalogue import FAMILIES, tuned_kernels


def test_a_missing_shader_fails_loudly_naming_it():
    broken = dataclasses.replace(FAMILIES[0], shaders=FAMILIES[0].shaders + ("no_such_shader",))
    with pytest.raises(FileNotFoundError, match=rf"kernel family {broken.name}: .*no_such_shader\.wgsl"):
        tune.sources_checksum((broken,))


def test_a_missing_module_fails_loudly_naming_it(tmp_path):
    gone = tmp_path / "gone_kernels.py"
    broken = dataclasses.replace(FAMILIES[-1], modules=(str(gone),))
    with pytest.raises(FileNotFoundError, match="gone_kernels.py"):
        tune.sources_checksum((broken,))


def test_the_checksum_covers_each_family():
    """Changing one family's file list changes the checksum (every family is hashed, none silently empty)."""
    base = tune.sources_checksum()
    for i, family in enumerate(FAMILIES):
        assert family.sources() and all(text for _, text in family.sources()), family.name
        fewer = FAMILIES[:i] + (dataclasses.replace(family, modules=()),) + FAMILIES[i + 1:]
        assert tune.sources_checksum(fewer) != base, family.name


def test_each_family_declares_the_shaders_of_its_kernels():
    for family in FAMILIES:
        used = {k.shader for k in family.all_kernels()} - {"gemm_probe"}    # the probe's WGSL is inline
        assert used <= set(family.shaders), (family.name, used - set(family.shaders))
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)
    assert tuned_kernels()


def test_the_bench_runs_the_families_benchmarks():
    named = [name for family in FAMILIES for name in family.benches]
    assert len(named) == len(set(named))
    assert set(named) == set(suite.BENCHES)
    assert [name for name, _ in suite.kernel_benches()] == named
