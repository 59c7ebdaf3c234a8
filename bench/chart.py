"""Bar charts of a benchmark's side-by-side figures, written for docs/benchmarks.md."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def bars(path: Path, title: str, values: dict[str, float], unit: str, note: str = "") -> Path:
    """One horizontal bar per ``label -> value``, top to bottom, the first (ours) highlighted; ``note`` as caption."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 1 + 0.5 * len(values)))
    drawn = ax.barh(list(values), list(values.values()), color=["tab:orange"] + ["tab:gray"] * (len(values) - 1))
    ax.bar_label(drawn, labels=[f"{v:,.1f}" for v in values.values()], padding=3)
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    caption = "\n".join(textwrap.fill(line, 110) for line in note.splitlines())
    fig.text(0.01, 0, caption, fontsize=8, color="dimgray", va="top")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"chart: {path}")
    return path
