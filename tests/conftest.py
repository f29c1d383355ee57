"""Shared fixtures: WebGPU adapters (every one present), and the rule that a missing adapter
skips with a reason, or fails under WGPU_TRAIN_REQUIRE_DEVICE=1."""
from __future__ import annotations

import os
import signal

import pytest

from wgpu_train.engines.webgpu.device import runtime


def _adapters():
    try:
        return runtime.devices()
    except Exception:  # noqa: BLE001 - no wgpu at all is the same as no adapter here
        return []


ADAPTERS = _adapters()

try:
    # Ray's logger binds its handler to sys.stderr when Ray is first imported: imported here, that is pytest's
    # session-wide stream, not the capsys stream of whichever test imports it first (closed after that test)
    import ray  # noqa: F401
except ImportError:      # the ray extra: its tests skip
    pass
REQUIRE_DEVICE = os.environ.get("WGPU_TRAIN_REQUIRE_DEVICE") == "1"


def require_adapter():
    """Skip (or fail under WGPU_TRAIN_REQUIRE_DEVICE=1) when no WebGPU adapter exists."""
    if not ADAPTERS:
        reason = "no WebGPU adapter found (install mesa-vulkan-drivers for lavapipe)"
        if REQUIRE_DEVICE:
            pytest.fail(reason + " and WGPU_TRAIN_REQUIRE_DEVICE=1")
        pytest.skip(reason)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """test_portable_wgsl.py last: it checks every kernel the session compiled."""
    items.sort(key=lambda item: item.path.name == "test_portable_wgsl.py")


@pytest.fixture(scope="session", params=[a.index for a in ADAPTERS] or [None],
                ids=[f"{a.backend}" for a in ADAPTERS] or ["no-adapter"])
def rt(request):
    """A Runtime per adapter present, shared by the whole session (one device per adapter)."""
    require_adapter()
    return runtime.get_runtime(str(request.param))


@pytest.fixture(scope="session")
def default_rt():
    """The Runtime of the adapter chosen by default (for tests that need only one)."""
    require_adapter()
    return runtime.get_runtime()


@pytest.fixture(autouse=True)
def auto_backend_is_the_adapter(monkeypatch, request):
    """backend auto on CPU adapters takes the NumPy engine for a model of small layers (engines/backend_choice.py),
    as the tests' tiny models are: in tests it takes the adapter for every model, so that the WebGPU engine is
    what their runs exercise. Tests of the rule itself are marked `real_backend_rule`."""
    if request.node.get_closest_marker("real_backend_rule"):
        return
    from wgpu_train.engines import backend_choice

    monkeypatch.setattr(backend_choice, "SMALL_LAYER_WEIGHTS", 0)


def pytest_configure(config):
    """Under nohup or as a shell's background job the suite starts with SIGINT ignored, which its children inherit:
    the Ctrl-C tests (test_cli, test_train, test_serve) need it delivered, as it is in a terminal and in CI."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

