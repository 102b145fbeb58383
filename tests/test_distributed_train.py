"""tools/distributed_train.py: DDP, Megatron-style main_grad and FSDP2 training of the small Engram + mHC model
against one process on the same global batch. On 2 CUDA devices it runs on NCCL; here (CPU) it runs on gloo
with the test references as kernels, which checks the script's data-parallel logic (not the kernels' speed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _plugins.device import detect_platform, unbound_environ, visible_devices

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "distributed_train.py"


def _run(args: list[str], out: Path, timeout: int, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def _check(report: dict) -> None:
    assert set(report["modes"]) == {"ddp", "megatron", "fsdp2"}
    for mode, r in report["modes"].items():
        assert r["ok"] and not r["grads_missing"] and r["grads_equal_on_all_ranks"], (mode, r)
        # bf16 gradients reduced in bf16 (DDP, FSDP2) or fp32 (megatron): within bf16's rounding of the max
        assert r["grad_rel_max_bf16"] <= 1e-2 and r["grad_rel_max_fp32"] <= 1e-4, (mode, r)
        assert r["step_ms"] > 0 and r["scaling_efficiency"] > 0


def test_data_parallel_gradients_match_one_process_on_cpu_gloo(tmp_path):
    report = _run(["--device", "cpu", "--cpu-references", "--nproc", "2", "--tokens", "16", "--layers", "1",
                   "--steps", "1", "--warmup", "0"], tmp_path / "cpu.json", timeout=300)
    _check(report)
    # the model is token-wise and the references too: each rank's logits are its slice of the whole batch's
    assert all(r["logits_bitwise"] for r in report["modes"].values())


def _run_gpus() -> int:
    """CUDA devices of the whole run: an xdist worker sees only the one it is bound to, the script's two ranks
    get the devices from before that binding."""
    env = unbound_environ()
    return len(visible_devices("cuda", env)) if detect_platform(env) == "cuda" else 0


@pytest.mark.skipif(_run_gpus() < 2, reason="requires 2 CUDA devices")
def test_data_parallel_on_two_gpus(tmp_path):
    report = _run(["--nproc", "2", "--tokens", "4096", "--steps", "10"], tmp_path / "gpu.json", timeout=600,
                  env=unbound_environ())
    _check(report)


def test_refuses_more_ranks_than_gpus(capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("has 2 CUDA devices")
    sys.path.insert(0, str(SCRIPT.parent))
    import distributed_train

    with pytest.raises(SystemExit):
        distributed_train.parse(["--nproc", "2"])
    assert "needs 2 CUDA devices" in capsys.readouterr().err


def test_fsdp2_mesh_on_the_runs_device_type(monkeypatch):
    """FSDP2's default mesh is CUDA wherever CUDA exists: a CPU (gloo) run on a GPU host would have its parameters
    moved to the GPU (seen on the GPU host, 2026-12-05). Every ``fully_shard`` gets a mesh of the run's device."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    sys.path.insert(0, str(SCRIPT.parent))
    import distributed_train

    meshes, calls = [], []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or kind)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh=None: calls.append((module, mesh)))
    model = torch.nn.Module()
    model.blocks = [torch.nn.Module() for _ in range(2)]
    for block in model.blocks:
        block.sublayer = torch.nn.Linear(2, 2)
    model.head = torch.nn.Linear(2, 2)
    assert distributed_train._wrap("fsdp2", model, torch.device("cpu")) is model
    assert meshes == [("cpu", (2,))]
    assert [mesh for _, mesh in calls] == ["cpu"] * 6
    assert calls[-1][0] is model
