"""The loss curve of a run as a PNG."""

from __future__ import annotations

from pathlib import Path


def plot_history(history: list[dict[str, float]], path: Path) -> None:
    """Training loss (and eval loss where measured) against the optimizer step."""
    # here, not at the top: matplotlib costs 0.35 s, paid through fit by every command's import of its errors; and
    # importing the module must not choose the process's backend, which pyplot needs chosen first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg"), see above

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss")
    evals = [h for h in history if "eval_loss" in h]
    if evals:
        ax.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
