"""examples/small_deepseek.py: the small DeepSeek-style model (mHC around attention and FFNs, an Engram layer,
a checkpointed chunk through ``mhc_recompute_chunk``, EngramSinkhorn + AdamW).

CPU tier: on the meta device (shapes only) and on the test references registered as the ops' CPU kernels: the
loss falls, and the checkpointed chunk gives bit for bit the loss and the gradients of the model that keeps every
activation. Device tier: the example's command as written, on the GPU."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _plugins.device import requires_cuda

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "small_deepseek.py"
LOSS_LINE = re.compile(r"^step (\d+): loss (\S+) \(\d+ ms\)$", re.M)
SUMMARY = re.compile(r"^loss (\S+) -> (\S+)$", re.M)


def _example():
    spec = importlib.util.spec_from_file_location("small_deepseek", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def losses_of(stdout: str) -> list[float]:
    """The per-step losses the example printed, checked against its summary line."""
    steps = LOSS_LINE.findall(stdout)
    assert [int(s) for s, _ in steps] == list(range(1, len(steps) + 1)), stdout
    losses = [float(v) for _, v in steps]
    summary = SUMMARY.search(stdout)
    assert summary and float(summary[1]) == float(f"{losses[0]:.4f}") and float(summary[2]) == float(
        f"{losses[-1]:.4f}"), stdout
    return losses


# --- CPU tier --------------------------------------------------------------------------------------------------


def test_meta_dry_run_runs_forward_backward_and_both_optimizers(capsys):
    losses = example.main(["--device", "meta", "--steps", "2", "--layers", "3"])
    assert losses == [None, None]
    out = capsys.readouterr().out
    assert "checkpointed: blocks 2..2" in out
    assert out.count("logits (4, 128, 512) torch.float32, loss () on meta (shapes only)") == 2


def test_loss_falls_on_the_cpu_references(capsys):
    """The README's CPU command (section "Without a GPU"), in process: the references plugin has registered the
    references already (``register`` is idempotent)."""
    losses = example.main(["--device", "cpu", "--cpu-references", "--steps", "8", "--seq", "32"])
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    assert losses_of(capsys.readouterr().out) == pytest.approx(losses, abs=5e-5)


def _loss_and_grads(checkpoint: bool, device) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = example.SmallDeepSeek(layers=3, engram_layer=0, checkpoint=checkpoint, device=device)
    ids, targets = example.synthetic_batch(2, 16, 512, 0, device)
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _check_chunk_equals_plain(device) -> None:
    plain_loss, plain = _loss_and_grads(False, device)
    loss, grads = _loss_and_grads(True, device)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys() and all(g is not None for g in grads.values())
    differ = [name for name in grads if not torch.equal(grads[name], plain[name])]
    assert not differ, differ


def test_readme_commands_run_on_meta(capsys):
    """The README's commands of the example (section "Example"), each with ``--device meta --steps 1`` added (shapes
    only: their values are the device tier's), and ``--help`` as written, which lists the options the README names."""
    readme = (ROOT / "README.md").read_text()
    body = re.search(r"^## Example: .*?^```bash\n(.*?)^```$", readme, re.M | re.S)[1]
    commands = [line.split("#", 1)[0].split() for line in body.splitlines()]
    assert len(commands) == 3 and all(c[:2] == ["python", "examples/small_deepseek.py"] for c in commands)
    for command in commands:
        args = command[2:]
        if args == ["--help"]:
            with pytest.raises(SystemExit) as exit_:
                example.parse(args)
            assert exit_.value.code == 0
            help_text = capsys.readouterr().out
            named = re.search(r"--help\s+# (.*)\.\.\.$", body, re.M)[1].split(", ")
            assert named and all(re.search(rf"^  {option}\b", help_text, re.M) for option in named), named
        else:
            assert example.main([*args, "--device", "meta", "--steps", "1"]) == [None]


def test_checkpointed_chunk_gives_the_plain_models_loss_and_gradients():
    """Blocks 1 and 2 (four sublayers) as one recomputed chunk against the same model keeping every activation:
    ``mhc_recompute_chunk`` regenerates the residuals bit for bit, so the replayed sublayers give the same
    gradients bit for bit (every parameter, the Engram layer's before the chunk included)."""
    _check_chunk_equals_plain("cpu")


def test_cpu_needs_the_references_and_no_device_is_a_usage_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        example.parse(["--device", "cpu"])
    assert exit_.value.code == 2 and "--device cpu needs --cpu-references" in capsys.readouterr().err
    monkeypatch.setattr(example, "_default_device", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        example.parse([])
    assert exit_.value.code == 2 and "pass --device meta" in capsys.readouterr().err
    assert example.parse(["--cpu-references"]).device == "cpu"


# --- device tier -----------------------------------------------------------------------------------------------


@requires_cuda
def test_example_as_written_on_cuda():
    """``python examples/small_deepseek.py`` (README, section "Example"): the defaults on the GPU, 20 steps of
    4 x 128 tokens; the loss is finite and falls below a tenth of the first step's."""
    done = run_script()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "SmallDeepSeek on cuda: 4 blocks, H=512, Engram in block 1, checkpointed: blocks 2..3" in done.stdout
    losses = losses_of(done.stdout)
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses), done.stdout
    assert losses[-1] < 0.1 * losses[0], done.stdout


@requires_cuda
def test_checkpointed_chunk_gives_the_plain_models_loss_and_gradients_on_cuda(device):
    _check_chunk_equals_plain(device)
