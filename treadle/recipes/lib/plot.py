"""The end-of-run curve: chosen metrics from metrics.jsonl against the step, written as a PNG."""

from __future__ import annotations

import json
from typing import Sequence


def plot_metrics(metrics_path: str, png_path: str, keys: Sequence[str], title: str = "") -> str:
    """One line per key (steps where the key is missing are skipped); returns `png_path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key in keys:
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            xs, ys = zip(*points)
            # A metric measured now and then (an eval) is its points, dotted between: a solid line
            # would suggest values at steps where nothing was measured.
            sparse = len(points) < len(rows) / 2
            ax.plot(
                xs, ys, marker="o" if sparse or len(points) < 30 else None, linestyle=":" if sparse else "-", label=key
            )
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
