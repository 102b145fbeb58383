"""Draws loss curves from a JSON file as an SVG line chart (no plotting library needed).

    python tools/curve_svg.py curves.json out.svg [--title TEXT]

The JSON maps curve names to lists of losses (other keys, whose values are not lists of numbers, are ignored),
e.g. what ``tests/quant/test_quant_modeling.py::test_device_small_model_trains_like_bf16`` writes. The y axis is
logarithmic; each curve is drawn as its mean over windows of 5 steps.
"""

import argparse
import json
import math

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
WIDTH, HEIGHT, MARGIN = 720, 420, 60


def smooth(values, window=5):
    return [sum(values[i:i + window]) / len(values[i:i + window]) for i in range(0, len(values), window)], window


def svg(curves: dict, title: str) -> str:
    series = {name: smooth(values) for name, values in curves.items()}
    steps = max(len(v) for v in curves.values())
    low = min(min(v) for v, _ in series.values())
    high = max(max(v) for v, _ in series.values())
    lo, hi = math.floor(math.log10(low)), math.ceil(math.log10(high))
    lo, hi = (lo, hi) if hi > lo else (lo, lo + 1)

    def x_of(step):
        return MARGIN + (WIDTH - 2 * MARGIN) * step / max(steps - 1, 1)

    def y_of(value):
        return HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * (math.log10(value) - lo) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="14">{title}</text>']
    out.append(f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" '
               f'stroke="black"/>')
    out.append(f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>')
    for e in range(lo, hi + 1):
        y = y_of(10.0**e)
        out.append(f'<line x1="{MARGIN}" y1="{y:.1f}" x2="{WIDTH - MARGIN}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{MARGIN - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    for i in range(5):
        step = round((steps - 1) * i / 4)
        out.append(f'<text x="{x_of(step):.1f}" y="{HEIGHT - MARGIN + 18}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 16}" text-anchor="middle">step</text>'
               f'<text x="16" y="{HEIGHT / 2}" transform="rotate(-90 16 {HEIGHT / 2})" text-anchor="middle">'
               f'loss</text>')
    for k, (name, (values, window)) in enumerate(series.items()):
        points = " ".join(f"{x_of(i * window + (window - 1) / 2):.1f},{y_of(v):.1f}" for i, v in enumerate(values))
        color = COLORS[k % len(COLORS)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>'
                   f'<text x="{WIDTH - MARGIN - 4}" y="{MARGIN + 16 * (k + 1)}" text-anchor="end" fill="{color}">'
                   f'{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves")
    parser.add_argument("out")
    parser.add_argument("--title", default="loss")
    args = parser.parse_args(argv)
    with open(args.curves) as f:
        data = json.load(f)
    curves = {k: v for k, v in data.items()
              if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)}
    with open(args.out, "w") as f:
        f.write(svg(curves, args.title))


if __name__ == "__main__":
    main()
