"""The PNG plots of a bench run (matplotlib, Agg: no display, no browser):

- throughput.png: overall output tok/s against per-user tok/s, one line per series (each point
  labelled with its concurrency), a per-user or overall SLO as a line;
- latency.png: mean TTFT, mean ITL (TPOT) and mean request latency against concurrency, each SLO
  on its own metric's panel as a dashed line.

Each file carries what it drew in its PNG text chunk `railyard:series` (JSON: label -> points),
so a reader (or a test) can tell what the image shows without decoding pixels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .slo import parse_slo

PANELS = (  # metric, title, unit, the SLO metrics drawn on that panel
    ("ttft_mean_s", "mean TTFT", "s", ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
    ("itl_mean_ms", "mean ITL (TPOT)", "ms", ("itl_mean_ms", "itl_p90_ms", "itl_p99_ms", "tpot_mean_ms",
                                                "tpot_p90_ms", "tpot_p99_ms")),
    ("latency_mean_s", "mean request latency", "s", ("latency_mean_s", "latency_p90_s")),
)


def _lines(summary: dict) -> list[tuple[str, list[dict], str]]:
    """(label, points, style) for this run's series and the compared run's (dashed)."""
    out = [(s["label"] or "this run", s["points"], "-") for s in summary["series"]]
    cmp_doc = summary.get("_compare_doc")
    if cmp_doc:
        out += [(f"{s['label'] or 'earlier'} ({cmp_doc.get('stamp', 'earlier')})", s["points"], "--")
                for s in cmp_doc["series"]]
    return out


def plot_all(summary: dict, root: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = [parse_slo(x) for x in summary.get("slos", [])]
    lines = _lines(summary)
    written = []

    fig, ax = plt.subplots(figsize=(8, 5.5))
    drawn: dict[str, Any] = {}
    for label, pts, style in lines:
        xy = [(p["metrics"].get("per_user_tok_s"), p["metrics"].get("output_tok_s"), p["concurrency"]) for p in pts]
        xy = [t for t in xy if t[0] is not None and t[1] is not None]
        drawn[label] = [{"concurrency": c, "per_user_tok_s": x, "output_tok_s": y} for x, y, c in xy]
        if not xy:
            continue
        ax.plot([t[0] for t in xy], [t[1] for t in xy], style, marker="o", label=label)
        for x, y, c in xy:
            ax.annotate(f"C{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for s in slos:
        if s.metric == "per_user_tok_s":
            ax.axvline(s.bound, color="red", linestyle=":", label=f"SLO {s}")
        elif s.metric == "output_tok_s":
            ax.axhline(s.bound, color="red", linestyle=":", label=f"SLO {s}")
    ax.set_xlabel("per-user output throughput (tokens/s/user)")
    ax.set_ylabel("overall output throughput (tokens/s)")
    ax.set_title(f"{summary['deployment']}: throughput ({summary['stamp']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = root / "throughput.png"
    fig.savefig(path, dpi=100, metadata={"railyard:series": json.dumps(drawn)})
    plt.close(fig)
    written.append(path.name)

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.8))
    drawn = {}
    for ax, (metric, title, unit, slo_names) in zip(axes, PANELS):
        for label, pts, style in lines:
            cv = [(p["concurrency"], p["metrics"].get(metric)) for p in pts if p["metrics"].get(metric) is not None]
            drawn.setdefault(label, {})[metric] = [{"concurrency": c, "value": v} for c, v in cv]
            if cv:
                ax.plot([t[0] for t in cv], [t[1] for t in cv], style, marker="o", label=label)
        for s in slos:
            if s.metric in slo_names:
                ax.axhline(s.bound, color="red", linestyle=":", label=f"SLO {s}")
                drawn.setdefault("_slos", {}).setdefault(metric, []).append(str(s))
        ax.set_xscale("log", base=2)
        cs = sorted({p["concurrency"] for _, pts, _ in lines for p in pts})
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{title} ({unit})")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{summary['deployment']}: latency against concurrency ({summary['stamp']})")
    fig.tight_layout()
    path = root / "latency.png"
    fig.savefig(path, dpi=100, metadata={"railyard:series": json.dumps(drawn)})
    plt.close(fig)
    written.append(path.name)
    return written
