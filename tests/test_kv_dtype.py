"""KvDtype, --kv-dtype as a value parsed once where it enters: its parsing, its traits, its one-line refusals,
and the engines carrying it (a str, so it still compares, prints and serialises as its name)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import wgpu_train as wt
from wgpu_train.engines.protocol import NamedValue
from wgpu_train.engines.shared.kv_dtype import KV_DTYPES, KvDtype, check_kv_dtype
from wgpu_train.errors import ConfigError

from finetune_helpers import make_model_dir


def test_parse():
    assert isinstance(KvDtype.FLOAT32, NamedValue)
    assert KvDtype.parse("bfloat16") is KvDtype.BFLOAT16
    assert KvDtype.parse(KvDtype.FLOAT32) is KvDtype.FLOAT32
    assert KV_DTYPES == ("float32", "bfloat16")
    assert KvDtype.BFLOAT16 == "bfloat16" and f"{KvDtype.BFLOAT16}" == "bfloat16"
    assert json.dumps({"kv_dtype": KvDtype.BFLOAT16}) == '{"kv_dtype": "bfloat16"}'
    assert {"bfloat16": 1}[KvDtype.BFLOAT16] == 1


def test_traits():
    assert (KvDtype.FLOAT32.storage, KvDtype.BFLOAT16.storage) == ("f32", "bf16")
    assert (KvDtype.FLOAT32.bytes_per_value, KvDtype.BFLOAT16.bytes_per_value) == (4, 2)
    assert not KvDtype.FLOAT32.packed and KvDtype.BFLOAT16.packed


@pytest.mark.parametrize("value", ["float16", "bf16", None])
def test_refusal_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        KvDtype.parse(value)
    assert str(e.value) == f"kv_dtype must be one of float32, bfloat16, got {value!r}"


def test_head_dim_check():
    """A packed cache needs an even head dim (check_kv_dtype reads only cfg.head_dim)."""
    even, odd = SimpleNamespace(head_dim=8), SimpleNamespace(head_dim=7)
    assert check_kv_dtype("bfloat16", even) is KvDtype.BFLOAT16
    assert check_kv_dtype("float32", odd) is KvDtype.FLOAT32
    with pytest.raises(ConfigError) as e:
        check_kv_dtype("bfloat16", odd)
    assert str(e.value) == "a bfloat16 KV cache needs an even head dim (this model's is 7); use --kv-dtype float32"


def test_the_engine_carries_the_value(tmp_path):
    model = wt.load_model(make_model_dir(tmp_path / "model"), kv_dtype="bfloat16")
    assert model.engine.kv_dtype is KvDtype.BFLOAT16
    assert model.engine.new_kv_cache(1, 8)["dtype"] is KvDtype.BFLOAT16
