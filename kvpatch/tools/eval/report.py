"""Tables, CSV and plots of a summary: renderings of a run's manifest
(:mod:`~kvpatch.tools.eval.manifest`), which holds the figures."""

from __future__ import annotations

import csv
from pathlib import Path

from kvpatch.tools.eval.options import FULL

COLUMNS = (
    ("task", "task", "{}"),
    ("mode", "question", "{}"),
    ("policy", "policy", "{}"),
    ("ratio", "ratio", "{:g}"),
    ("accuracy", "accuracy (95% interval)", "{:.2f}"),
    ("kv_mb", "KV MB", "{:.2f}"),
    ("kv_saved", "saved", "{:.0%}"),
    ("prefill_s", "prefill s", "{:.2f}"),
    ("decode_tok_s", "decode tok/s", "{:.1f}"),
    ("needle_kept", "needle kept", "{:.0%}"),
)


def format_table(summary: list[dict]) -> str:
    """A Markdown table of the summary rows."""
    header = [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row[key]
            cells.append("—" if value is None else fmt.format(value))
            if key == "accuracy" and "accuracy_low" in row:
                cells[-1] += f" {_interval(row)}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_accuracy_grid(summary: list[dict]) -> str:
    """Accuracy as a policy x ratio grid per (task, mode), full cache first."""
    blocks = []
    keys = list(dict.fromkeys((r["task"], r["mode"]) for r in summary))
    ratios = sorted({r["ratio"] for r in summary if r["policy"] != FULL})
    for task, mode in keys:
        rows = [r for r in summary if (r["task"], r["mode"]) == (task, mode)]
        title = "question in prefill" if mode == "prefill" else "question-agnostic"
        lines = [f"**{task}, {title}** (accuracy, its 95% interval in brackets)", ""]
        lines.append("| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |")
        lines.append("|---|" + "---|" * len(ratios))
        for policy in dict.fromkeys(r["policy"] for r in rows):
            by_ratio = {r["ratio"]: _accuracy(r) for r in rows if r["policy"] == policy}
            if policy == FULL:
                cells = [by_ratio[0.0]] * len(ratios)
            else:
                cells = [by_ratio.get(x, "") for x in ratios]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _interval(row: dict) -> str:
    return f"[{row['accuracy_low']:.2f}, {row['accuracy_high']:.2f}]"


def _accuracy(row: dict) -> str:
    """``0.75 [0.53, 0.89]``: the accuracy and, where the row has it, its 95% interval."""
    text = f"{row['accuracy']:.2f}"
    return f"{text} {_interval(row)}" if "accuracy_low" in row else text


def format_needle_tokens(summary: list[dict]) -> str:
    """Per compressed run, the share of (layer, KV head) pairs that hold each token of the
    (first) expected value: which parts of a multi-token answer survive."""
    rows = [r for r in summary if r["needle_kept_by_token"]]
    if not rows:
        return ""
    width = max(len(r["needle_kept_by_token"]) for r in rows)
    header = ["task", "question", "policy", "ratio"] + [f"token {i + 1}" for i in range(width)]
    lines = [
        "**needle kept, token by token** (share of layer x KV-head pairs holding it)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        kept = [f"{value:.0%}" for value in r["needle_kept_by_token"]]
        kept += [""] * (width - len(kept))
        cells = [r["task"], r["mode"], r["policy"], f"{r['ratio']:g}", *kept]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_run(summary: list[dict]) -> str:
    """Every table of a run: the summary, the accuracy grids, the needle kept token by token."""
    blocks = [format_table(summary), format_accuracy_grid(summary), format_needle_tokens(summary)]
    return "\n\n".join(block for block in blocks if block) + "\n"


def write_outputs(result: dict, output: Path, plot: bool = True) -> dict[str, Path]:
    """The renderings of a run's summary: ``results.md``, ``results.csv`` and (``plot``, with
    matplotlib) ``results.png``."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {}
    summary = result["summary"]
    paths["table"] = output / "results.md"
    paths["table"].write_text(format_run(summary))
    paths["csv"] = output / "results.csv"
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows({key: _csv_cell(value) for key, value in row.items()} for row in summary)
    if plot:
        png = plot_accuracy(summary, output / "results.png")
        if png is not None:
            paths["png"] = png
    return paths


def _csv_cell(value):
    """Lists (per-token shares) as one ``;``-separated cell."""
    if isinstance(value, list):
        return ";".join(f"{v:.4f}" for v in value)
    return value


def plot_accuracy(summary: list[dict], path: Path) -> Path | None:
    """Accuracy against ratio, one line per policy, one panel per (task, mode); None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = list(dict.fromkeys((r["task"], r["mode"]) for r in summary))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4), squeeze=False, sharey=True)
    for ax, (task, mode) in zip(axes[0], keys, strict=True):
        rows = [r for r in summary if (r["task"], r["mode"]) == (task, mode)]
        policies = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != FULL]
        for policy in [FULL, *policies]:
            points = sorted((r["ratio"], r["accuracy"]) for r in rows if r["policy"] == policy)
            if policy == FULL:
                ax.axhline(points[0][1], color="black", linestyle="--", label="full cache")
                continue
            index = policies.index(policy)  # 20 colours and 4 markers: no two policies alike
            style = dict(color=plt.get_cmap("tab20")(index % 20), marker="os^D"[index // 5 % 4])
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=policy, **style)
        title = "question in prefill" if mode == "prefill" else "question-agnostic"
        ax.set_title(f"{task}, {title}")
        ax.set_xlabel("compression ratio (fraction of KV removed)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy")
    # beside the panels: inside, it would hide the low-accuracy points
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
