"""Plots of a run: matplotlib set up once (`pyplot`), figures written by `save_figure`.

    plt = pyplot()
    fig, ax = plt.subplots()
    ...
    save_figure(fig, "out/plots/x.png")
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed); imported on
    first use, so commands that plot nothing never import matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int = 100) -> Path:
    """Lay out `fig`, write it to `path` (parent folders made) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_curves(rows: list[dict], stage: str, keys: list[str], path: Path) -> Path | None:
    """One panel per metric key over the steps of `rows` (one stage's metrics rows)."""
    keys = [k for k in keys if any(k in r for r in rows)]
    if not rows or not keys:
        return None
    fig, axes = pyplot().subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(f"{stage}: {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_phases(seconds: dict[str, float], peak_bytes: dict[str, int], path: Path, memory_kind: str) -> Path:
    """Bar charts of the total time and the peak memory of each PPO phase; the memory panel is
    left out when no per-phase figure could be measured (`peak_bytes` empty)."""
    names = list(seconds)
    panels = 2 if peak_bytes else 1
    fig, axes = pyplot().subplots(1, panels, figsize=(5 * panels, 3.5), squeeze=False)
    ax_t = axes[0][0]
    ax_t.bar(names, [seconds[n] for n in names], color="tab:blue")
    ax_t.set_title("PPO time per phase (s, whole run)")
    if peak_bytes:
        ax_m = axes[0][1]
        ax_m.bar(names, [peak_bytes.get(n, 0) / 2**20 for n in names], color="tab:orange")
        ax_m.set_title(f"PPO peak memory per phase (MiB, {memory_kind})")
    for ax in axes[0]:
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)
