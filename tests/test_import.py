"""Importing the package registers every op (those the cases registries hold, tests/<family>/<family>_cases.py)
and touches nothing else: no device, no TileLang, no torch_npu (checked in a fresh interpreter)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _plugins import cases

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = r"""
import json, sys
import torch
import cann_ops_tilelang as ops
from cann_ops_tilelang import config, modeling  # noqa: F401
print(json.dumps({
    "tilelang": any(m == "tilelang" or m.startswith("tilelang.") for m in sys.modules),
    "torch_npu": "torch_npu" in sys.modules,
    "kernels": sorted(m for m in sys.modules if m.startswith("cann_ops_tilelang.kernels.")),
    "cuda_initialized": torch.cuda.is_initialized(),
    "ops": sorted(ops.registered_ops()),
    "schemas": sorted(str(getattr(torch.ops.cann_ops_tilelang, n).default._schema).split("(")[0]
                      for n in ops.registered_ops()),
}))
"""


def run_probe(code, env_extra=None):
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_touches_no_device_and_no_tilelang():
    found = run_probe(PROBE)
    assert found["tilelang"] is False
    assert found["torch_npu"] is False
    assert found["kernels"] == []
    assert found["cuda_initialized"] is False
    # the ops the families' cases registries hold an example call of (tests/<family>/<family>_cases.py; found
    # by file name, not listed here): importing registers exactly those
    want = sorted(name for family in cases.registry_files() for name in cases.builders(family))
    assert found["ops"] == want
    assert found["schemas"] == [f"cann_ops_tilelang::{n}" for n in want]


@pytest.mark.parametrize("value,ok", [("1", True), ("off", True), ("maybe", False)])
def test_debug_switch_is_read_lazily(value, ok):
    code = (
        "import json, cann_ops_tilelang\n"
        "from cann_ops_tilelang import config\n"
        "try:\n    r = config.debug_enabled()\nexcept ValueError as e:\n    r = str(e)\n"
        "print(json.dumps(r))"
    )
    result = run_probe(code, {"OPS_TILELANG_DEBUG": value})
    if ok:
        assert result is (value == "1")
    else:
        assert "OPS_TILELANG_DEBUG" in result and "maybe" in result
