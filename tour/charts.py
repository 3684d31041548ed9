"""The tour's two charts: measured memory per step, and the GPU prediction beside the study's.

Drawn on `matplotlib.figure.Figure` objects, which render with the Agg backend and need neither
pyplot nor a display. A value that is missing is left out of the bars and labelled "n/a".

Both charts stack each memory bar by what the memory holds, in the same colours, and both draw the
bars that are too short to read beside the tallest a second time in a magnified panel below. Every
panel carries a name (`Axes.get_label()`: "memory", "zoom", "time", "accuracy") so that code and
tests can find it without counting panels, and every bar a `gid` saying what it shows.
"""
import textwrap

from matplotlib.figure import Figure

from common.atomic_write import atomic_path
from common.breakdown import BREAKDOWN_KEYS
from estimate.records import GB, MIB
from tour.records import STACK_SUFFIX, in_units

COLORS = dict(zip(BREAKDOWN_KEYS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")))
NOT_BROKEN_DOWN = "not broken down"  # the gid and legend entry of what a breakdown leaves out
NOT_BROKEN_DOWN_COLOR = "#bbbbbb"
FAILED_COLOR = "#c0392b"
TIME_COLOR = "#999999"
ACCURACY_COLOR = "#2ca02c"
ZOOM_FRACTION = 0.1  # bars shorter than this share of the tallest are drawn again, magnified
ESTIMATE_BAR_WIDTH = 0.36  # two bars per setting: the prediction and the study's figure,
ESTIMATE_BAR_OFFSET = 0.21  # either side of the tick, with a gap that keeps labels off the other
STEP_BAR_WIDTH = 0.6
PANEL_INCHES = {"memory": 3.6, "zoom": 1.9, "time": 1.5, "accuracy": 1.7}
DPI = 110


def script_label(script):
    number, _, name = script.partition("_")
    return f"{number}\n{name.replace('_', ' ')}"


def step_label(row):
    """The step's tick: number and name, whole stack, processes; after the number the mark of a
    row made on another machine than the unmarked ones, as its published table marks it."""
    number, _, name = script_label(row.script.removesuffix(STACK_SUFFIX)).partition("\n")
    mark = getattr(row, "mark", "")  # a published table's row (tour/partial.py), else none
    stack = "\nwhole stack" if row.script.endswith(STACK_SUFFIX) else ""
    return (f"{number}{' ' + mark if mark else ''}\n{name}" + stack
            + (f"\n{row.processes()}" if row.processes() else ""))


def category_label(key):
    return key.replace("_", " ")


def value_text(value, suffix=""):
    """A value as written on the chart: one decimal, two below 1 so that 0.18 and 0.22 differ,
    and two significant digits below 0.01 so that a tiny value does not read as zero."""
    if value is None:
        return "n/a"
    spec = ",.1f" if abs(value) >= 1 else ".2f" if abs(value) >= 0.01 or value == 0 else ".2g"
    return f"{value:{spec}}{suffix}"


def label_bar(ax, x, top, text, color="black"):
    """`text` just above the point (x, top): a bar's value on the bar."""
    ax.annotate(text, (x, top), xytext=(0, 2), textcoords="offset points", ha="center",
                va="bottom", fontsize=7, color=color)


def stack_height(breakdown, total):
    """How tall `draw_stack` draws a bar, in bytes: the total, or the breakdown if it is larger."""
    return max(total or 0, sum(value or 0 for value in breakdown.values()))


def draw_stack(ax, x, width, breakdown, total, unit):
    """A bar at `x` stacked by what the memory holds (bytes, drawn in `unit`); returns its top.

    Whatever the breakdown leaves out of `total` (a category missing from an older record, or no
    breakdown at all) is stacked on top in grey, so the bar is always as tall as the measured total
    and a missing category can't pass for memory that was not used.
    """
    bottom = 0.0
    for key in BREAKDOWN_KEYS:
        height = in_units(breakdown[key], unit)
        if height:
            ax.bar(x, height, width, bottom=bottom, color=COLORS[key], label=category_label(key),
                   gid=key)
            bottom += height
    rest = (in_units(total, unit) or 0) - bottom
    if rest > 1e-9 * bottom:  # more than float rounding
        ax.bar(x, rest, width, bottom=bottom, color=NOT_BROKEN_DOWN_COLOR, label=NOT_BROKEN_DOWN,
               gid=NOT_BROKEN_DOWN)
        bottom += rest
    return bottom


def short_columns(tops):
    """The columns whose bar is shorter than ZOOM_FRACTION of the tallest: too short to read."""
    tallest = max(tops, default=0)
    return [x for x, top in enumerate(tops) if 0 < top < ZOOM_FRACTION * tallest]


def chart_figure(tops, lower_panels=()):
    """A figure of panels one above the other sharing the x-axis, by name.

    "memory" on top; "zoom" below it when some of the memory bars (`tops`, one per column) are
    too short to read; then `lower_panels`. Sized so that each column gets the same width.
    """
    names = ["memory", *(["zoom"] if short_columns(tops) else []), *lower_panels]
    heights = [PANEL_INCHES[name] for name in names]
    width = max(7.0, 1.3 * len(tops) + 3.5)  # 3.5 inches for the y-labels and the legend
    figure = Figure(figsize=(width, sum(heights) + 1.3), layout="constrained", dpi=DPI)
    axes = figure.subplots(len(names), 1, sharex=True, squeeze=False, height_ratios=heights)
    panels = dict(zip(names, axes[:, 0]))
    for name, ax in panels.items():
        ax.set_label(name)
    panels["memory"].set_xlim(-0.5, len(tops) - 0.5)  # every column, even one with nothing drawn
    return figure, panels


def draw_memory(panels, tops, draw_column, unit_name):
    """Every column in the memory panel, and the short ones again in the zoom panel.

    The zoom panel shares the x-axis, so a magnified bar stands right below its full-scale self,
    and its own y-axis starts at 0, so the magnified bars still compare with each other.
    """
    for x in range(len(tops)):
        draw_column(panels["memory"], x)
    panels["memory"].set_ylabel(unit_name)
    panels["memory"].margins(y=0.12)
    zoom_ax = panels.get("zoom")
    if zoom_ax is None:
        return
    for x in short_columns(tops):
        draw_column(zoom_ax, x)
    zoom_ax.set_title(f"Magnified: the bars shorter than {ZOOM_FRACTION:.0%} of the tallest",
                      fontsize=9)
    zoom_ax.set_ylabel(unit_name)
    zoom_ax.margins(y=0.3)  # room for the labels above the bars


def add_legend(figure):
    """One legend for all panels, outside them on the right, so it never covers a bar.

    The categories come first in the stacking order, then the grey remainder stacked on them,
    then the rest as they were drawn.
    """
    entries = {}
    for ax in figure.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    order = [*(category_label(key) for key in BREAKDOWN_KEYS), NOT_BROKEN_DOWN]
    labels = sorted(entries, key=lambda label: order.index(label) if label in order else len(order))
    figure.legend([entries[label] for label in labels], labels, loc="outside right center",
                  fontsize=8)


def draw_step_memory(ax, x, row):
    """A step's peak stacked by what it held, with the peak (or "failed") written on top."""
    top = draw_stack(ax, x, STEP_BAR_WIDTH, row.breakdown_bytes, row.peak_bytes, MIB)
    text = value_text(in_units(row.peak_bytes, MIB), " MiB") if row.ok else "failed"
    label_bar(ax, x, top, text, color="black" if row.ok else FAILED_COLOR)


def draw_training_time(ax, rows):
    """Training time as bars with their value on top (alone in their panel: nothing to collide)."""
    for x, row in enumerate(rows):
        if row.train_seconds is not None:
            ax.bar(x, row.train_seconds, STEP_BAR_WIDTH, color=TIME_COLOR, gid="time")
        label_bar(ax, x, row.train_seconds or 0, value_text(row.train_seconds, " s"))
    ax.set_ylabel("training time (s)")
    ax.margins(y=0.25)


def draw_accuracy(ax, rows):
    """Test accuracy as points with their 95% interval as error bars, the value to the right.

    The axis spans the points and their intervals rather than 0-100%, so an interval a few points
    wide stays visible; the value sits beside the point, clear of its error bar.
    """
    drawn = False
    for x, row in enumerate(rows):
        percent = in_units(row.test_accuracy, 0.01)
        if percent is None:
            ax.annotate("n/a", (x, 0.5), xycoords=ax.get_xaxis_transform(), ha="center",
                        va="center", fontsize=7)
            continue
        interval = row.accuracy_interval()
        if interval is None:
            ax.plot(x, percent, "o", color=ACCURACY_COLOR, label="test accuracy (interval n/a)",
                    gid="accuracy")
        else:
            low, high = (100 * bound for bound in interval)
            ax.errorbar(x, percent, yerr=[[percent - low], [high - percent]], fmt="o",
                        color=ACCURACY_COLOR, capsize=3, label="test accuracy, 95% interval",
                        gid="accuracy")
        ax.annotate(value_text(percent, "%"), (x, percent), xytext=(7, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=7,
                    color=ACCURACY_COLOR)
        drawn = True
    ax.set_ylabel("test accuracy (%)")
    if drawn:
        ax.margins(y=0.2)
    else:
        ax.set_ylim(0, 100)


def tour_figure(rows, machines=()):
    """Per step: peak memory as stacked bars (short ones magnified), training time, accuracy.
    `machines`: the lines naming the machines of a table whose rows come from several, written
    at the foot (its marked steps carry their mark), since training times differ by machine."""
    tops = [stack_height(row.breakdown_bytes, row.peak_bytes) / MIB for row in rows]
    figure, panels = chart_figure(tops, lower_panels=("time", "accuracy"))
    draw_memory(panels, tops, lambda ax, x: draw_step_memory(ax, x, rows[x]), "peak memory (MiB)")
    figure.suptitle("Peak memory of training per step, by what it holds")
    draw_training_time(panels["time"], rows)
    draw_accuracy(panels["accuracy"], rows)
    panels["accuracy"].set_xticks(range(len(rows)), [step_label(row) for row in rows], fontsize=8)
    if machines:  # each wrapped to the figure's width (about 12 characters an inch at 8 points)
        figure.supxlabel("\n".join(textwrap.fill(line, int(12 * figure.get_figwidth()))
                                   for line in machines), fontsize=8)
    add_legend(figure)
    return figure


def estimate_top(estimate):
    """The tallest thing drawn for a setting, in GB: its stacked bar, reserved mark or study bar."""
    return max(stack_height(estimate.breakdown_bytes, estimate.allocated_bytes) / GB,
               in_units(estimate.reserved_bytes, GB) or 0, estimate.published_gb or 0)


def draw_estimate(ax, x, estimate):
    """A setting's predicted allocated memory stacked by category, with a black line at the
    predicted reserved total, and beside it the study's published reserved figure if any."""
    predicted_x = x - ESTIMATE_BAR_OFFSET
    top = draw_stack(ax, predicted_x, ESTIMATE_BAR_WIDTH, estimate.breakdown_bytes,
                     estimate.allocated_bytes, GB)
    reserved = in_units(estimate.reserved_bytes, GB)
    if reserved is not None:
        ax.hlines(reserved, predicted_x - ESTIMATE_BAR_WIDTH / 2,
                  predicted_x + ESTIMATE_BAR_WIDTH / 2, colors="black", linewidth=2,
                  label="predicted reserved", gid="reserved")
    allocated = in_units(estimate.allocated_bytes, GB)
    label_bar(ax, predicted_x, max(top, reserved or 0),
              f"{value_text(allocated)} alloc\n{value_text(reserved)} res")
    if estimate.published_gb is not None:  # the study only published some settings
        study_x = x + ESTIMATE_BAR_OFFSET
        ax.bar(study_x, estimate.published_gb, ESTIMATE_BAR_WIDTH, color="white",
               edgecolor="black", hatch="///", label="study, published reserved",
               gid="published")
        label_bar(ax, study_x, estimate.published_gb,
                  f"{value_text(estimate.published_gb)}\nstudy")


def estimate_figure(estimates):
    """Per setting: predicted GPU memory stacked by category, reserved marked, the study's figure
    beside it; the settings too small to read beside the largest drawn again, magnified."""
    tops = [estimate_top(estimate) for estimate in estimates]
    figure, panels = chart_figure(tops)
    draw_memory(panels, tops, lambda ax, x: draw_estimate(ax, x, estimates[x]),
                "GB (10^9 bytes)")
    presets = sorted({estimate.preset for estimate in estimates if estimate.preset})
    figure.suptitle("Predicted peak GPU memory of training, by what it holds "
                    f"({', '.join(presets) or 'n/a'} preset)")
    bottom_ax = list(panels.values())[-1]
    bottom_ax.set_xticks(range(len(estimates)),
                         [script_label(estimate.script) + "\n" + estimate.setting(separator="\n")
                          for estimate in estimates], fontsize=7)
    add_legend(figure)
    return figure


def save_png(figure, path):
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=DPI)
