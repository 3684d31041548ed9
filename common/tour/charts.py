"""The tour's two charts: measured memory per step, and the GPU prediction beside the study's.

Drawn on `matplotlib.figure.Figure` objects, which render with the Agg backend and need neither
pyplot nor a display. A value that is missing is left out of the bars and labelled "n/a".
"""
from matplotlib.figure import Figure

from common.atomic_write import atomic_path
from common.memory import BREAKDOWN_KEYS
from common.tour.records import GB, MIB, in_units, shown

COLORS = dict(zip(BREAKDOWN_KEYS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")))
UNATTRIBUTED_COLOR = "#bbbbbb"  # a peak whose record has no breakdown
FAILED_COLOR = "#c0392b"


def script_label(script):
    number, _, name = script.partition("_")
    return f"{number}\n{name.replace('_', ' ')}"


def step_label(row):
    processes = f"\n{row.world_size} processes" if row.world_size and row.world_size > 1 else ""
    return script_label(row.script) + processes


def draw_memory(ax, rows):
    """Stacked bars of what the memory held at each step's peak, with the peak written on top."""
    for x, row in enumerate(rows):
        bottom = 0.0
        for key in BREAKDOWN_KEYS:
            height = in_units(row.breakdown_bytes[key], MIB) or 0
            ax.bar(x, height, bottom=bottom, color=COLORS[key],
                   label=key.replace("_", " ") if x == 0 else None)
            bottom += height
        peak = in_units(row.peak_bytes, MIB)
        if peak is not None and bottom == 0:
            ax.bar(x, peak, color=UNATTRIBUTED_COLOR, hatch="//",
                   label="no breakdown in record")
        top = max(bottom, peak or 0)
        text = shown(peak, ",.1f", " MiB") if row.ok else "failed"
        ax.annotate(text, (x, top), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8, color="black" if row.ok else FAILED_COLOR)
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("Peak memory of training per step, by what it holds")
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(y=0.15)


def draw_time_and_accuracy(ax, rows):
    """Training time as bars, test accuracy as points on a second axis, both labelled."""
    accuracy_ax = ax.twinx()
    for x, row in enumerate(rows):
        seconds = row.train_seconds or 0
        ax.bar(x, seconds, color="#999999", width=0.5, label="training time" if x == 0 else None)
        ax.annotate(shown(row.train_seconds, ".1f", " s"), (x, seconds), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
        percent = in_units(row.test_accuracy, 0.01)
        if percent is not None:
            accuracy_ax.plot(x, percent, "o", color="#2ca02c")
        accuracy_ax.annotate(shown(percent, ".1f", "%"), (x, percent or 0), xytext=(8, -3),
                             textcoords="offset points", fontsize=8, color="#2ca02c")
    ax.set_ylabel("training time (s)")
    ax.margins(y=0.2)
    accuracy_ax.set_ylabel("test accuracy (%)", color="#2ca02c")
    accuracy_ax.set_ylim(0, 105)


def tour_figure(rows):
    """Per step: peak memory as stacked bars above, training time and test accuracy below."""
    figure = Figure(figsize=(max(6.0, 1.3 * len(rows) + 2), 7), layout="constrained")
    memory_ax, time_ax = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    draw_memory(memory_ax, rows)
    draw_time_and_accuracy(time_ax, rows)
    time_ax.set_xticks(range(len(rows)), [step_label(row) for row in rows], fontsize=8)
    return figure


def estimate_figure(estimates):
    """Per setting: predicted allocated and reserved GPU memory, and the study's figure if any."""
    figure = Figure(figsize=(max(6.0, 1.3 * len(estimates) + 2), 5), layout="constrained")
    ax = figure.subplots()
    width = 0.27
    for x, estimate in enumerate(estimates):
        bars = [(estimate.allocated_bytes, dict(color="#4c72b0", label="predicted allocated")),
                (estimate.reserved_bytes, dict(color="#dd8452", label="predicted reserved"))]
        if estimate.published_gb is not None:  # the study only published some settings
            bars.append((estimate.published_gb * GB,
                         dict(color="white", edgecolor="black", hatch="///",
                              label="study, published (reserved)")))
        for offset, (value, style) in zip((-width, 0, width), bars):
            gb = in_units(value, GB)
            ax.bar(x + offset, gb or 0, width, **style)
            ax.annotate(shown(gb, ".1f"), (x + offset, gb or 0), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per kind of bar
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    presets = sorted({estimate.preset for estimate in estimates if estimate.preset})
    ax.set_title(f"Predicted peak GPU memory of training ({', '.join(presets) or 'n/a'} preset)")
    ax.set_ylabel("GB (10^9 bytes)")
    ax.set_xticks(range(len(estimates)),
                  [script_label(estimate.script) + "\n" + estimate.setting(separator="\n")
                   for estimate in estimates], fontsize=7)
    ax.margins(y=0.12)
    return figure


def save_png(figure, path):
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
