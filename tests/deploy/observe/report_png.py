#!/usr/bin/python3
"""Draws the Grafana dashboard's panels from a live Prometheus into one PNG.

e2e_observe.mjs evaluates every panel query over the end-to-end run and
writes the answers (Prometheus query_range results) to results.json; this
draws one plot per panel, with the panel's legend format, plus the workers by
state around the killed worker and the alerts at the end, so a reviewer sees
the dashboard without a Grafana.

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

UNITS = {"s": "seconds", "flops": "FLOP/s", "Bps": "bytes/s", "bytes": "bytes",
         "percentunit": "fraction", "reqps": "calls/s", "ops": "steps/s"}


def legend(fmt, labels):
    """Grafana's legendFormat: {{label}} replaced by the series' label."""
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def plot_series(ax, series_list, t0):
    drawn = 0
    for label, series in series_list:
        points = [(float(t) - t0, float(v)) for t, v in series["values"]]
        points = [(t, v) for t, v in points if math.isfinite(v)]
        if not points:
            continue
        ax.plot([t for t, _ in points], [v for _, v in points], label=label[:48], linewidth=1.2)
        drawn += 1
    if drawn == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="red")
    elif drawn <= 8:
        ax.legend(fontsize=6, loc="best")
    return drawn


def main(results_path, out_path):
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)
    t0 = results["from"]
    panels = results.get("panels", [])
    extra = 2  # workers by state, alerts
    count = len(panels) + extra
    cols = 3
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]

    for ax, panel in zip(flat, panels):
        series = [(legend(t.get("legend"), s["metric"]), s)
                  for t in panel["targets"] for s in t["result"]]
        plot_series(ax, series, t0)
        ax.set_title(panel["title"], fontsize=9)
        ax.set_ylabel(UNITS.get(panel.get("unit"), panel.get("unit") or ""), fontsize=7)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("seconds into the run", fontsize=7)

    ax = flat[len(panels)]
    lost = results.get("lost", {}).get("result", [])
    plot_series(ax, [(s["metric"].get("state", "?"), s) for s in lost], t0)
    ax.set_title("Workers by state (a worker killed at the end)", fontsize=9)
    ax.tick_params(labelsize=6)

    ax = flat[len(panels) + 1]
    ax.axis("off")
    lines = [f"{a['labels'].get('alertname')}: {a['state']}  {a['annotations'].get('summary', '')}"
             for a in results.get("alerts", [])]
    lines += [f"rule {r['name']}: evaluates ({r['series']} series)" for r in results.get("rules", [])]
    ax.text(0, 1, "\n".join(lines) or "no alerts", va="top", family="monospace", fontsize=6, wrap=True)
    ax.set_title("Alerts at the end, and rules evaluated", fontsize=9)

    for ax in flat[count:]:
        ax.axis("off")
    job = results.get("jobId") or "(no job)"
    fig.suptitle(f"muonmesh dashboard from a live Prometheus: job {job}", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out_path, dpi=80)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: report_png.py RESULTS.json OUT.png")
    main(sys.argv[1], sys.argv[2])
