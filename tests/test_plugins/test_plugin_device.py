"""Device binding per xdist worker and the requires_* markers/fixtures."""

import pytest

from _plugins import device
from _plugins.testing import INNER_ARGS


def _bind(**env):
    environ = dict(env)
    b = device.bind_worker_device(environ)
    return b, environ


def test_cuda_worker_binds_n_mod_count():
    b, env = _bind(PYTEST_XDIST_WORKER="gw5", OPS_TILELANG_TEST_DEVICE_KIND="cuda", OPS_TILELANG_TEST_DEVICE_COUNT="4")
    assert (b.variable, b.value) == ("CUDA_VISIBLE_DEVICES", "1")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env


def test_npu_worker_binds_ascend_variable():
    b, env = _bind(PYTEST_XDIST_WORKER="gw3", OPS_TILELANG_TEST_DEVICE_KIND="npu", OPS_TILELANG_TEST_DEVICE_COUNT="2")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert b.kind == "npu"


def test_preset_cuda_list_is_respected():
    _, env = _bind(PYTEST_XDIST_WORKER="gw4", OPS_TILELANG_TEST_DEVICE_KIND="cuda", CUDA_VISIBLE_DEVICES="4,5,6")
    assert env["CUDA_VISIBLE_DEVICES"] == "5"  # entry 4 % 3 = 1 of the list


def test_preset_ascend_list_selects_npu_without_override():
    _, env = _bind(PYTEST_XDIST_WORKER="gw1", ASCEND_RT_VISIBLE_DEVICES="2,3")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "3"


def test_binding_is_idempotent():
    env = {"PYTEST_XDIST_WORKER": "gw6", "OPS_TILELANG_TEST_DEVICE_KIND": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    device.bind_worker_device(env)
    device.bind_worker_device(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"


@pytest.mark.parametrize("before", [None, "4,5,6"])
def test_unbound_environ_restores_the_list_before_the_binding(monkeypatch, before):
    """A subprocess that needs every device of the run (tests/test_distributed_train.py) gets the visibility
    list from before this worker's binding, however often the binding ran."""
    monkeypatch.setattr(device, "_BEFORE_BIND", {})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv(device.KIND_ENV, "cuda")
    monkeypatch.setenv(device.COUNT_ENV, "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # recorded first, so that the binding's value is undone
    if before is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", before)
    device.bind_worker_device()
    device.bind_worker_device()
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ("1" if before is None else "5")
    unbound = device.unbound_environ()
    assert unbound.get("CUDA_VISIBLE_DEVICES") == before
    assert len(device.visible_devices("cuda", unbound)) == 2


@pytest.mark.parametrize("env", [
    {"OPS_TILELANG_TEST_DEVICE_KIND": "cuda", "OPS_TILELANG_TEST_DEVICE_COUNT": "4"},  # not a worker
    {"PYTEST_XDIST_WORKER": "gw1", "OPS_TILELANG_TEST_DEVICE_KIND": "none"},  # no accelerator
    {"PYTEST_XDIST_WORKER": "gw1", "OPS_TILELANG_TEST_DEVICE_KIND": "cuda", "CUDA_VISIBLE_DEVICES": ""},  # all hidden
])
def test_no_binding(env):
    b, out = _bind(**env)
    assert b.value is None
    assert out == env


def test_device_count_from_visible_list():
    assert device.device_count({"CUDA_VISIBLE_DEVICES": "3,1", device.KIND_ENV: "cuda"}) == 2
    assert device.device_count({device.KIND_ENV: "npu", device.COUNT_ENV: "8"}) == 8
    assert device.device_count({device.KIND_ENV: "none"}) == 0


def test_requires_markers_and_fixtures_skip_with_reason(inner, monkeypatch):
    monkeypatch.setattr(device, "_DEVICE_TYPE", "cuda")
    inner.makepyfile(test_req="""
        import pytest
        from _plugins.device import requires_cuda, requires_npu, requires_device

        @requires_cuda
        def test_cuda():
            pass

        @requires_npu
        def test_npu():
            pass

        @requires_device
        def test_any():
            pass

        def test_npu_fixture(requires_npu):
            pass

        def test_device_fixture(device):
            assert str(device) == "cuda:0"
    """)
    result = inner.runpytest(*INNER_ARGS, "-rs")
    result.assert_outcomes(passed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "SKIPPED*requires an Ascend NPU with torch_npu (device_type()='cuda')",
        "SKIPPED*requires an Ascend NPU with torch_npu (device_type()='cuda')",
    ])


def test_requires_device_skips_without_accelerator(inner):
    inner.makepyfile(test_req="""
        from _plugins.device import requires_device
        @requires_device
        def test_any():
            pass
    """)
    result = inner.runpytest(*INNER_ARGS, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*requires an accelerator (CUDA or NPU); none usable"])


def test_requires_markers_imply_device_marker(inner):
    inner.makepyfile(test_req="""
        import pytest
        from _plugins.device import requires_cuda

        @requires_cuda
        def test_marked():
            pass

        def test_fixture(device):
            pass

        def test_plain():
            pass
    """)
    result = inner.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "device")
    result.stdout.fnmatch_lines(["test_req.py::test_marked", "test_req.py::test_fixture", "2/3 tests collected (1 deselected)*"])


@pytest.mark.parametrize("env,match", [
    ({device.KIND_ENV: "gpu"}, "OPS_TILELANG_TEST_DEVICE_KIND must be cuda, npu, none or cpu"),
    ({device.KIND_ENV: "cuda", device.COUNT_ENV: "abc"}, "OPS_TILELANG_TEST_DEVICE_COUNT must be a device count"),
])
def test_bad_device_variables_are_named(env, match):
    with pytest.raises(ValueError, match=match):
        device.device_count(env)
