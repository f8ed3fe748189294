#!/usr/bin/python3
"""Draws the Grafana dashboard's panels from a live Prometheus into one PNG.

e2e_observe.mjs evaluates every panel query over the end-to-end run and
writes the answers (Prometheus query_range results) to results.json, with
each panel's row, unit, axis label, stacking and line-style overrides; this
draws one plot per panel as Grafana would (the panel's legend format, its
unit on the y axis, stacked where the panel stacks, dashed where it says
so), plus the workers by state around the killed worker and the alerts at
the end, so a reviewer sees the dashboard without a Grafana.

    report_png.py RESULTS.json OUT.png

Needs Debian's python3-matplotlib (run with /usr/bin/python3).
"""

import json
import math
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter  # noqa: E402


def short_formatter():
    """Grafana's "short": plain numbers, SI prefixes from ten thousand up."""
    eng = EngFormatter(places=3)
    return FuncFormatter(lambda v, pos: eng(v, pos) if abs(v) >= 1e4 else f"{v:g}")


# Grafana unit -> (y-axis label when the panel sets none, tick formatter).
UNITS = {
    "s": ("seconds", lambda: EngFormatter(unit="s")),
    "flops": ("FLOP/s", lambda: EngFormatter(unit="FLOP/s")),
    "Bps": ("bytes per second", lambda: EngFormatter(unit="B/s")),
    "bytes": ("bytes", lambda: EngFormatter(unit="B")),
    "percentunit": ("share", lambda: PercentFormatter(1.0)),
    "reqps": ("calls per second", lambda: EngFormatter(unit="/s")),
    "ops": ("steps per second", lambda: EngFormatter(unit="/s")),
    "short": ("", short_formatter),
    "none": ("", None),
}
MAX_LEGEND = 10  # series named in a legend; the rest are drawn and counted


def legend(fmt, labels):
    """Grafana's legendFormat: {{label}} replaced by the series' label."""
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def dashed(panel, label):
    """Whether a byRegexp override of the panel draws this series dashed."""
    for o in panel.get("overrides", []):
        matcher = o.get("matcher", {})
        if matcher.get("id") != "byRegexp":
            continue
        for prop in o.get("properties", []):
            if prop.get("id") == "custom.lineStyle" and prop.get("value", {}).get("fill") == "dash":
                if re.fullmatch(matcher.get("options", ""), label):
                    return True
    return False


def points_of(series, t0):
    points = [(float(t) - t0, float(v)) for t, v in series["values"]]
    return [(t, v) for t, v in points if math.isfinite(v)]


def plot_panel(ax, panel, series_list, t0):
    """Draws the series; returns how many had data."""
    drawn = [(label, points_of(s, t0)) for label, s in series_list]
    drawn = [(label, pts) for label, pts in drawn if pts]
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="red")
        return 0
    # Largest first, so that the legend names the series that matter.
    drawn.sort(key=lambda lp: -max(v for _, v in lp[1]))
    if panel.get("stacked") and len(drawn) > 1:
        times = sorted({t for _, pts in drawn for t, _ in pts})
        rows = []
        for _, pts in drawn:
            by_time = dict(pts)
            rows.append([by_time.get(t, 0.0) for t in times])
        ax.stackplot(times, rows, labels=[label for label, _ in drawn], alpha=0.8)
    else:
        for label, pts in drawn:
            ax.plot([t for t, _ in pts], [v for _, v in pts], label=label,
                    linestyle="--" if dashed(panel, label) else "-", linewidth=1.4)
    handles, labels = ax.get_legend_handles_labels()
    shown = min(len(handles), MAX_LEGEND)
    extra = len(handles) - shown
    labels = [(lbl[:56] + "…") if len(lbl) > 57 else lbl for lbl in labels[:shown]]
    if extra > 0:
        labels[-1] += f"  (+{extra} more drawn)"
    if shown > 4:  # beside the plot, where it hides nothing
        ax.legend(handles[:shown], labels, fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(handles[:shown], labels, fontsize=7, loc="best", framealpha=0.85)
    return len(drawn)


def main(results_path, out_path):
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    t0 = results["from"]
    panels = results.get("panels", [])
    extra = 2  # workers by state, alerts
    count = len(panels) + extra
    cols = 3
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8.5 * cols, 4.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]

    for ax, panel in zip(flat, panels):
        series = [(legend(t.get("legend"), s["metric"]), s)
                  for t in panel["targets"] for s in t["result"]]
        plot_panel(ax, panel, series, t0)
        ax.set_title(panel["title"], fontsize=10, loc="left", pad=13)
        if panel.get("row"):  # the dashboard row, small, between the title and the plot
            ax.text(0, 1.01, panel["row"], transform=ax.transAxes, fontsize=7, color="grey",
                    va="bottom", ha="left")
        unit = panel.get("unit") or ""
        name, formatter = UNITS.get(unit, (unit, None))
        ax.set_ylabel(panel.get("axisLabel") or name, fontsize=9)
        if formatter is not None:
            ax.yaxis.set_major_formatter(formatter())
        ax.tick_params(labelsize=8)
        ax.set_xlabel("seconds into the run", fontsize=9)
        ax.grid(True, alpha=0.3)

    ax = flat[len(panels)]
    lost = results.get("lost", {}).get("result", [])
    plot_panel(ax, {}, [(s["metric"].get("state", "?"), s) for s in lost], t0)
    ax.set_title("Workers by state (a worker killed at the end)", fontsize=10)
    ax.set_ylabel("workers", fontsize=9)
    ax.set_xlabel("seconds into the run", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)

    ax = flat[len(panels) + 1]
    ax.axis("off")
    lines = [f"{a['labels'].get('alertname')}: {a['state']}" for a in results.get("alerts", [])]
    lines += [f"rule {r['name']}: evaluates ({r['series']} series)" for r in results.get("rules", [])]
    ax.text(0, 1, "\n".join(lines) or "no alerts", va="top", family="monospace", fontsize=8)
    ax.set_title("Alerts at the end, and rules evaluated", fontsize=10)

    for ax in flat[count:]:
        ax.axis("off")
    job = results.get("jobId") or "(no job)"
    fig.suptitle(f"muonmesh dashboard from a live Prometheus: job {job}", fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out_path, dpi=90)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: report_png.py RESULTS.json OUT.png")
    main(sys.argv[1], sys.argv[2])
