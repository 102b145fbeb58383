"""The small model of the main command (embedding, mHC-wrapped FFNs, an Engram gate, the mHC head) learns its
synthetic next-token task: the loss falls, eager and under torch.compile(fullgraph=True). On the CPU the ops
run the test references; on a GPU or NPU the kernels."""

import pytest
import torch

from cann_ops_tilelang._demo import SmallModel, train

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_small_model_loss_falls(device, compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallModel(device=device)
    steps, tokens = (12, 64) if device == "cpu" else (40, 1024)
    losses, _ = train(model, steps, tokens, device, compiled=compiled,
                      synchronize=torch.cuda.synchronize if device == "cuda" else lambda: None)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
