"""The small model's loss curve (docs/perf/h200/small_model_loss.png): train it eager and compiled on a device
and write the losses as JSON, or draw that JSON as a PNG (matplotlib, on any machine).

    python tools/loss_curve.py train OUT.json [--steps 200 --tokens 4096 --hidden 512]
    python tools/loss_curve.py plot IN.json OUT.png
"""

import argparse
import json
import sys


def _train(args) -> None:
    import torch

    from cann_ops_tilelang import _demo, config

    kind = "cuda" if config.cuda_available() else "npu" if config.npu_available() else None
    if kind is None:
        sys.exit("loss_curve: no GPU or NPU found (the ops have no CPU kernels)")
    device = torch.device(kind)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _demo.SmallModel(hidden=args.hidden, device=device)
        sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
        losses, times = _demo.train(model, args.steps, args.tokens, device, compiled=compiled, synchronize=sync)
        runs["compiled" if compiled else "eager"] = {"loss": losses, "step_ms": times}
    meta = {"device": torch.cuda.get_device_name() if kind == "cuda" else kind, "tokens": args.tokens,
            "hidden": args.hidden, "steps": args.steps, "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, **runs}, f)


def _plot(args) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("tools/loss_curve.py plot draws with matplotlib, which is not installed: pip install matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.data) as f:
        data = json.load(f)
    meta = data["meta"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for name, style in (("eager", "-"), ("compiled", "--")):
        ax.plot(range(1, len(data[name]["loss"]) + 1), data[name]["loss"], style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_yscale("log")
    ax.set_title(f"SmallModel (mHC + Engram gate), H={meta['hidden']}, T={meta['tokens']}, {meta['device']}",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train")
    train.add_argument("out")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--tokens", type=int, default=4096)
    train.add_argument("--hidden", type=int, default=512)
    plot = sub.add_parser("plot")
    plot.add_argument("data")
    plot.add_argument("png")
    args = parser.parse_args()
    (_train if args.command == "train" else _plot)(args)


if __name__ == "__main__":
    main()
