"""The run's JSONL metrics log and the PNG plot of its training curves."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from lmserve.core.atomic import atomic_write_bytes


class MetricsLog:
    """Append-only JSONL, one record per event (``train``, ``valid``, ``test``, ``data``, ``resume``, ...)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = path
        self.enabled = enabled  # under torchrun only rank 0 writes

    def write(self, event: str, **fields) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_curves(records: list[dict], png: Path, title: str) -> None:
    """Training and validation perplexity against training tokens, and the learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    train = [r for r in records if r["event"] == "train"]
    valid = [r for r in records if r["event"] == "valid"]
    fig, (ax_ppl, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    ax_ppl.plot([r["tokens_seen"] for r in train], [r["ppl"] for r in train], label="train (running)", lw=1)
    ax_ppl.plot([r["tokens_seen"] for r in valid], [r["ppl"] for r in valid], "o-", label="validation")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_title(title)
    ax_ppl.legend()
    ax_ppl.grid(True, which="both", alpha=0.3)
    ax_lr.plot([r["tokens_seen"] for r in train], [r["lr"] for r in train], lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("training tokens")
    ax_lr.grid(True, alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(png, buffer.getvalue())
