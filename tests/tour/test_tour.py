"""The tour: the report built from recorded JSON, and the command that runs and collects steps."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path

import matplotlib.image
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from common.breakdown import BREAKDOWN_KEYS
from conftest import QUICK, ROOT
from estimate.records import GB, MIB, load_estimates, published_gb
from estimate.stack import whole_stack
from tour import runner as tour
from tour import warm
from tour.charts import NOT_BROKEN_DOWN, estimate_figure, tour_figure
from tour.records import load_step_rows, read_json, wilson_interval
from tour.report import (
    ESTIMATE_CHART,
    ESTIMATE_TABLE,
    TOUR_CHART,
    TOUR_TABLE,
    estimate_markdown,
    write_report,
)

FIXTURES = Path(__file__).parent / "fixtures"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STACKED = {*BREAKDOWN_KEYS, NOT_BROKEN_DOWN}  # the gids of a memory bar's parts


def table_rows(markdown):
    """The data rows of the first markdown table in `markdown`, as {step: [cells]}."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in line.strip("| ").split(" | ")] for line in lines]
    return {row[0]: row[1:] for row in cells[2:]}  # after the header and the rule


def assert_png(path):
    """A PNG that matplotlib drew a real chart into: a decent size and far from one flat colour."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 400 and width >= 600, image.shape
    assert image[..., :3].std() > 0.1  # blank or near-blank images have almost no spread


def panel(figure, name):
    """The chart's panel called `name` ("memory", "zoom", "time", "accuracy")."""
    matches = [ax for ax in figure.axes if ax.get_label() == name]
    assert len(matches) == 1, [ax.get_label() for ax in figure.axes]
    return matches[0]


def column_of(bar):
    """The column (tick) a bar stands in; a bar beside its tick (the estimate) rounds to it."""
    return round(bar.get_x() + bar.get_width() / 2)


def stacked_heights(ax, in_pixels=False):
    """{column: the summed heights of the stacked memory bar standing in it}, in data units or,
    on a rendered figure, in pixels."""
    heights = {}
    for bar in ax.patches:
        if bar.get_gid() in STACKED:
            height = bar.get_window_extent().height if in_pixels else bar.get_height()
            heights[column_of(bar)] = heights.get(column_of(bar), 0) + height
    return heights


def rendered(figure):
    """The figure drawn by Agg, so that its artists know their size in pixels."""
    FigureCanvasAgg(figure).draw()
    return figure


@pytest.fixture
def recorded(tmp_path):
    """A copy of the recorded results: 01 ok, 02 missing fields, 03 failed, 07 on 2 processes,
    a stale 05 that tour.json does not list, and a GPU estimate. 01 and 05 record their number
    of test images (360); 07 does not, so its accuracy has no interval."""
    results = tmp_path / "results"
    shutil.copytree(FIXTURES / "tour", results)
    return results


def test_report_table_rows_ratios_and_failures(recorded):
    text = write_report(recorded)
    table = (recorded / TOUR_TABLE).read_text()
    assert table in text  # what is printed is what is written
    rows = table_rows(table)
    assert list(rows) == ["01_baseline", "02_mixed_precision", "03_bf16", "07_fsdp (2 processes, cpu)"]
    # columns: peak, vs 01, parameters, gradients, optimizer state, model state B/param,
    # activations, temporaries, training time, test accuracy, 95% interval, status
    assert rows["01_baseline"][:2] == ["28.43", "1.00x"] and rows["01_baseline"][-1] == "ok"
    assert rows["02_mixed_precision"][1] == "0.82x"  # 24,395,864 / 29,811,660 bytes
    assert rows["02_mixed_precision"][7] == "n/a" and rows["02_mixed_precision"][9] == "n/a"
    assert rows["07_fsdp (2 processes, cpu)"][:2] == ["5.00", "0.18x"]
    failed = rows["03_bf16"]
    assert failed[:-1] == ["n/a"] * 11
    assert failed[-1] == "failed: exit status 1: RuntimeError: bfloat16 \\| not supported here"
    assert '  File "03_bf16.py", line 80, in <module>' in table  # the stderr lines, below the table


def test_a_gpu_tours_table_shows_each_runs_check_of_its_estimate(recorded):
    """Records made on a GPU with --check-estimate: three more columns, the allocator's peak of
    the tracked steps, the prediction and their ratio (n/a for a run without them)."""
    path = recorded / "01_baseline.json"
    record = json.loads(path.read_text())
    record.update(cuda_steps_max_allocated_bytes=3 * 2**20, predicted_allocated_bytes=2 * 2**20)
    path.write_text(json.dumps(record))
    rows = table_rows((write_report(recorded), (recorded / TOUR_TABLE).read_text())[1])
    assert rows["01_baseline"][8:11] == ["3.00", "2.00", "1.500"]
    assert rows["02_mixed_precision"][8:11] == ["n/a"] * 3


def test_report_tour_table_shows_the_model_state_per_parameter_beside_the_activations(recorded):
    write_report(recorded)
    text = (recorded / TOUR_TABLE).read_text()
    rows = table_rows(text)
    # 01: (3,286,568 + 6,184 + 6,573,424) bytes / 821,642 parameters
    assert rows["01_baseline"][4:7] == ["6.27", "12.01", "17.44"]
    # 07: (822,000 + 411,000) bytes / (821,642 / 2) parameters held by a process
    assert rows["07_fsdp (2 processes, cpu)"][5] == "3.00"
    assert rows["02_mixed_precision"][5] == "n/a"  # an older record without the field
    assert "divide by N for its bytes per parameter of the whole model" in text


def test_report_estimate_table_marks_the_studys_figures(recorded):
    write_report(recorded)
    rows = table_rows((recorded / ESTIMATE_TABLE).read_text())
    # setting, allocated, reserved, study, ratio, creation, model state B/param, activations
    assert rows["01_baseline"] == ["batch 64", "25.10 GB", "26.50 GB", "26.84 GB", "0.99",
                                   "n/a", "16.00", "19.00 GB"]  # no creation
    # no reserved figure recorded, so no ratio; nor a breakdown
    assert rows["02_mixed_precision"][2:5] == ["n/a", "18.21 GB", ""]
    assert rows["02_mixed_precision"][6:] == ["n/a", "n/a"]
    assert rows["04_grad_accum"][:1] == ["batch 16, 4 micro-batches"]
    assert rows["07_fsdp"][3:5] == ["", ""]  # the study has no 4-GPU figure for this setting
    assert rows["07_fsdp"][5:] == ["0.16 GB", "8.00", "0.70 GB"]  # creation, per GPU
    assert "03_bf16 at batch 64: 13.82 GB" in (recorded / ESTIMATE_TABLE).read_text()


def test_a_t4_record_is_not_compared_with_the_studys_a100_figure(recorded):
    """The study measured on one A100: a prediction for a T4 (python -m estimate --gpu t4) of
    the very setting it published is shown without the study's figure, in the estimate's table,
    the tour's and the chart alike (all read estimate/records.py)."""
    estimate_file = recorded / "estimate.json"
    records = json.loads(estimate_file.read_text())
    [a100] = [record for record in records if record["script"] == "01_baseline"]
    t4 = {**a100, "gpu": "T4"}
    assert published_gb(a100) == 26.84 and published_gb(t4) is None
    assert published_gb({**a100, "device": "cpu"}) is None  # a CPU count is no GPU's either
    estimate_file.write_text(json.dumps([t4]))
    [estimate], _ = load_estimates(recorded)
    assert estimate.published_gb is None and estimate.ratio() is None
    assert table_rows(estimate_markdown([estimate]))["01_baseline"][3:5] == ["", ""]
    study_bars = [bar for bar in panel(estimate_figure([estimate]), "memory").patches
                  if bar.get_gid() == "published"]
    assert study_bars == []


def test_report_writes_valid_charts(recorded):
    write_report(recorded)
    assert_png(recorded / TOUR_CHART)
    assert_png(recorded / ESTIMATE_CHART)
    assert not list(recorded.glob("*.tmp"))


def test_report_tour_table_shows_the_accuracy_interval(recorded):
    write_report(recorded)
    text = (recorded / TOUR_TABLE).read_text()
    rows = table_rows(text)
    # 01: 340 of 360 right (94.4%); Wilson with z = 1.96, z^2/n = 0.010671:
    # centre (0.94444 + 0.005336) / 1.010671 = 0.939752, half width
    # 1.96 / 1.010671 * sqrt(0.94444 * 0.05556 / 360 + 0.010671 / 1440) = 0.024001
    assert rows["01_baseline"][9:11] == ["94.4%", "91.6-96.4%"]
    assert rows["07_fsdp (2 processes, cpu)"][9:11] == ["92.5%", "n/a"]  # no test_samples recorded
    assert rows["02_mixed_precision"][9:11] == ["n/a", "n/a"]  # no accuracy recorded
    assert "one sample is 0.28 percentage points" in text
    assert "not evidence that the step changed accuracy" in text


# Wilson score interval by hand, z = 1.96, n = 360: z^2 = 3.8416, z^2/n = 0.0106711.
#   0 of 360:   low 0, high (z^2/n) / (1 + z^2/n) = 0.0106711 / 1.0106711 = 0.010558
#   360 of 360: low 1 / (1 + z^2/n) = 0.989442, high 1
#   180 of 360: centre 0.5, half width 1.96 / 1.0106711 * sqrt(0.25/360 + 3.8416/(4 * 360^2))
#               = 1.939306 * sqrt(0.00069444 + 0.00000741) = 0.051376 -> 0.448624 to 0.551376
@pytest.mark.parametrize("correct, low, high", [(0, 0.0, 0.010558), (360, 0.989442, 1.0),
                                                (180, 0.448624, 0.551376)])
def test_wilson_interval_of_known_counts(correct, low, high):
    assert wilson_interval(correct / 360, 360) == pytest.approx((low, high), abs=2e-6)


@pytest.mark.parametrize("correct", [0, 1, 17, 180, 340, 359, 360])
def test_wilson_interval_contains_the_observed_proportion(correct):
    low, high = wilson_interval(correct / 360, 360)
    assert 0 <= low <= correct / 360 <= high <= 1 and high - low > 0.01  # never zero width


def test_memory_bars_stack_to_each_peak(recorded):
    rows = load_step_rows(recorded)
    memory_ax = panel(tour_figure(rows), "memory")
    heights = stacked_heights(memory_ax)
    for column, row in enumerate(rows):
        if row.peak_bytes is not None:
            assert heights[column] == pytest.approx(row.peak_bytes / MIB), row.script
    assert 2 not in heights  # 03 failed: no bar
    # 02's record has no temporaries: what its breakdown leaves out of the peak is grey
    grey = [bar for bar in memory_ax.patches if bar.get_gid() == NOT_BROKEN_DOWN]
    known = sum(value for value in rows[1].breakdown_bytes.values() if value is not None)
    assert [column_of(bar) for bar in grey] == [1]
    assert grey[0].get_height() == pytest.approx((rows[1].peak_bytes - known) / MIB)


def test_tour_chart_magnifies_a_step_too_short_to_read(recorded):
    (recorded / "tour.json").unlink()  # brings in the stale 05, whose peak is 1 byte
    rows = load_step_rows(recorded)
    figure = rendered(tour_figure(rows))
    five = [row.script for row in rows].index("05_sgd_cosine")
    assert set(stacked_heights(panel(figure, "zoom"))) == {five}  # only the short bar is repeated
    assert stacked_heights(panel(figure, "zoom"), in_pixels=True)[five] > 50


def test_estimate_bars_stack_to_allocated_with_reserved_marked(recorded):
    estimates, _ = load_estimates(recorded)
    memory_ax = panel(estimate_figure(estimates), "memory")
    heights = stacked_heights(memory_ax)
    assert heights == pytest.approx({column: estimate.allocated_bytes / GB
                                     for column, estimate in enumerate(estimates)}, rel=1e-9)
    without_breakdown = [column for column, estimate in enumerate(estimates)
                         if all(value is None for value in estimate.breakdown_bytes.values())]
    assert [estimates[column].script for column in without_breakdown] == ["02_mixed_precision"]
    grey = {column_of(bar) for bar in memory_ax.patches if bar.get_gid() == NOT_BROKEN_DOWN}
    assert grey == set(without_breakdown)  # the rest are broken down completely
    reserved_marks = {round(segment[:, 0].mean()): segment[0, 1]
                      for lines in memory_ax.collections if lines.get_gid() == "reserved"
                      for segment in lines.get_segments()}
    assert reserved_marks == pytest.approx({column: estimate.reserved_bytes / GB
                                            for column, estimate in enumerate(estimates)
                                            if estimate.reserved_bytes is not None})


def test_estimate_chart_marks_only_published_settings(recorded):
    estimates, _ = load_estimates(recorded)
    memory_ax = panel(estimate_figure(estimates), "memory")
    study_bars = [bar for bar in memory_ax.patches if bar.get_gid() == "published"]
    assert sorted(round(bar.get_height(), 2) for bar in study_bars) == [3.91, 5.69, 18.21, 26.84]
    assert {column_of(bar) for bar in study_bars} == {
        column for column, estimate in enumerate(estimates) if estimate.published_gb is not None}


def test_estimate_chart_magnifies_settings_too_small_to_read(recorded):
    estimates, _ = load_estimates(recorded)
    figure = rendered(estimate_figure(estimates))
    largest = max(max(e.allocated_bytes or 0, e.reserved_bytes or 0, (e.published_gb or 0) * GB)
                  for e in estimates)
    small = {column for column, estimate in enumerate(estimates)
             if max(estimate.allocated_bytes, estimate.reserved_bytes or 0) < 0.05 * largest}
    assert [estimates[column].script for column in small] == ["09_activation_checkpointing"]
    full_scale = stacked_heights(panel(figure, "memory"), in_pixels=True)
    magnified = stacked_heights(panel(figure, "zoom"), in_pixels=True)
    zoom_labels = " ".join(text.get_text() for text in panel(figure, "zoom").texts)
    for column in small:
        assert full_scale[column] < 5  # a sliver beside 01
        assert magnified[column] >= 12  # taller than the digits of its label
        assert f"{estimates[column].allocated_bytes / GB:.2f} alloc" in zoom_labels


def overlapping_texts(figure, panel_names):
    """The pairs of labels in these panels whose rendered boxes overlap, and how many labels."""
    rendered(figure)
    boxes = [(text.get_text(), text.get_window_extent())
             for name in panel_names for text in panel(figure, name).texts]
    return [(a, b) for (a, box_a), (b, box_b) in combinations(boxes, 2)
            if box_a.overlaps(box_b)], len(boxes)


def test_tour_chart_lower_labels_do_not_overlap(recorded):
    # 07 has the longest training time and an accuracy high on the axis: where the time label
    # and the accuracy label once collided
    rows = load_step_rows(recorded)
    overlaps, count = overlapping_texts(tour_figure(rows), ["time", "accuracy"])
    assert overlaps == [] and count == 2 * len(rows)  # a time and an accuracy label per step


def test_estimate_chart_labels_do_not_overlap(recorded):
    estimates, _ = load_estimates(recorded)
    overlaps, count = overlapping_texts(estimate_figure(estimates), ["memory", "zoom"])
    assert overlaps == [] and count >= len(estimates)


def test_report_without_tour_json_or_estimate(recorded):
    (recorded / "tour.json").unlink()
    (recorded / "estimate.json").unlink()
    (recorded / "06_on_device_init.json").write_text('{"script": "06_on_dev')  # cut short
    text = write_report(recorded)
    rows = table_rows((recorded / TOUR_TABLE).read_text())
    assert list(rows) == ["01_baseline", "02_mixed_precision", "05_sgd_cosine",
                          "06_on_device_init", "07_fsdp (2 processes, cpu)"]
    assert rows["06_on_device_init"][-1].startswith("failed: unreadable 06_on_device_init.json")
    assert "GPU estimate chart skipped: no estimate.json" in text
    assert not (recorded / ESTIMATE_CHART).exists()
    assert_png(recorded / TOUR_CHART)


def fake_estimate_step(results_dir):
    command = [sys.executable, str(FIXTURES / "fake_estimate.py"), "--results-dir",
               str(results_dir)]
    return tour.Command("estimate", command, "estimate.json", "estimate")


def test_tour_shows_failed_steps_and_runs_the_rest(tmp_path, monkeypatch, capfd):
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    # a previous run's files: a record for a step that will now fail, and its table
    (results / "03_writes_nothing.json").write_text('{"script": "03_writes_nothing", "steps": 9}')
    (results / TOUR_TABLE).write_text("stale table\n")
    monkeypatch.setattr(tour, "estimate_command", fake_estimate_step)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the CPU's launch, on any machine

    status = tour.main(["--results-dir", str(results), "--max-steps", "2", "--publish", str(docs)],
                       scripts_dir=FIXTURES / "fake_steps")

    assert status == 1
    output = capfd.readouterr()
    stack = " ".join(whole_stack("classification"))
    positions = [output.out.index(f"[{n}/7] {name} ...") for n, name in enumerate(
        ["01_writes_record.py", "02_crashes.py", "03_writes_nothing.py", "07_distributed.py",
         "10_takes_switches.py", f"10_takes_switches.py {stack}", "estimate"], 1)]
    assert positions == sorted(positions)  # the combined script twice, after the steps
    assert "RuntimeError: broken on purpose" in output.err  # stderr streamed through
    rows = table_rows((results / TOUR_TABLE).read_text())
    assert list(rows) == ["01_writes_record", "02_crashes", "03_writes_nothing",
                          "07_distributed (2 processes, cpu)", "10_takes_switches",
                          "10_takes_switches (whole stack)"]
    assert rows["01_writes_record"][-1] == "ok"
    assert rows["02_crashes"][-1] == "failed: exit status 1: RuntimeError: broken on purpose"
    assert rows["03_writes_nothing"][-1] == "failed: exit status 0 but no 03_writes_nothing.json"
    assert not (results / "03_writes_nothing.json").exists()  # the stale record is gone
    assert rows["07_distributed (2 processes, cpu)"][:2] == ["1.00", "0.50x"]
    assert "Quick run (--max-steps 2)" in (results / TOUR_TABLE).read_text()
    # the table says how the sharded steps were started
    assert "Sharded steps (07 on): 0 GPUs visible" in (results / TOUR_TABLE).read_text()
    for name in [TOUR_TABLE, TOUR_CHART, ESTIMATE_TABLE, ESTIMATE_CHART]:
        assert (docs / name).read_bytes() == (results / name).read_bytes()
    assert [path.name for path in results.iterdir() if path.name.startswith(".")] == []


def test_a_text_tour_passes_its_preset_and_keeps_its_results_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default results directory goes
    status = tour.main(["--preset", "tiny-text", "--steps", "01", "--max-steps", "2"],
                       scripts_dir=FIXTURES / "fake_steps")
    assert status == 0
    results = tmp_path / "results" / "tiny-text"  # apart from the image tour's results/
    table = (results / TOUR_TABLE).read_text()
    assert "Preset tiny-text" in table
    assert "skipped (the tour's GPU estimate predicts the image steps (article preset); for " \
           "text, python -m estimate --preset imdb)" in table
    assert not (tmp_path / "results" / "01_writes_record.json").exists()


@pytest.mark.parametrize("preset, task", [("tiny", "classification"), ("tiny-text", "causal-lm")])
def test_the_combined_script_runs_twice_and_both_records_are_kept(preset, task, tmp_path):
    """--steps 10: its default, then every switch of the stack that one run combines."""
    results = tmp_path / "results"
    status = tour.main(["--steps", "10", "--preset", preset, "--task", task, "--max-steps", "2",
                        "--skip-estimate", "--results-dir", str(results)],
                       scripts_dir=FIXTURES / "fake_steps")
    assert status == 0
    stack = whole_stack(task)
    assert ("--loss" in stack) is (task == "causal-lm") and "--offload" not in stack
    default, _ = read_json(results / "10_takes_switches.json")
    whole, _ = read_json(results / "10_takes_switches_stack.json")
    assert default["switches"] == [] and whole["switches"] == stack  # neither overwrote the other
    assert sorted(path.name for path in results.iterdir() if path.is_dir()) == []
    tour_json, _ = read_json(results / "tour.json")
    assert [(step["script"], step["switches"]) for step in tour_json["steps"]] == [
        ("10_takes_switches", []), ("10_takes_switches_stack", stack)]
    table = (results / TOUR_TABLE).read_text()
    assert list(table_rows(table)) == ["10_takes_switches", "10_takes_switches (whole stack)"]
    assert f"10_takes_switches (whole stack): `{' '.join(stack)}`" in table
    assert "10_takes_switches: no switch" in table


@pytest.mark.parametrize("steps, ids", [(None, ["01", "02", "03", "07", "10"]),
                                        (["01"], ["01"]), (["10"], ["10"]), (["7", "10"], ["07", "10"])])
def test_the_tour_runs_the_combined_script_by_default_or_when_named(steps, ids):
    args = tour.parse_args(["--steps", *steps] if steps else [], scripts_dir=FIXTURES / "fake_steps")
    assert [script.name[:2] for script in args.scripts] == ids


def test_the_whole_stacks_record_reads_as_such_without_tour_json(tmp_path):
    for name in ("10_combined", "10_combined_stack"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"script": "10_combined",
                                                           "peak_memory_bytes": 2**20}))
    write_report(tmp_path)
    table = (tmp_path / TOUR_TABLE).read_text()
    assert list(table_rows(table)) == ["10_combined", "10_combined (whole stack)"]
    assert "The combined script" not in table  # which switches ran: only tour.json says
    labels = [label.get_text() for label in
              panel(tour_figure(load_step_rows(tmp_path)), "accuracy").get_xticklabels()]
    assert labels == ["10\ncombined", "10\ncombined\nwhole stack"]


@pytest.mark.timeout(60)
def test_a_hung_step_is_stopped_and_shown_as_failed(tmp_path):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    (scripts / "01_hangs.py").write_text("import time\ntime.sleep(120)\n")
    started = time.perf_counter()
    status = tour.main(["--results-dir", str(results), "--skip-estimate", "--step-timeout", "2"],
                       scripts_dir=scripts)
    assert status == 1 and time.perf_counter() - started < 30
    row = table_rows((results / TOUR_TABLE).read_text())["01_hangs"]
    assert row[-1].startswith("failed: timed out after 2 s")


WAITS_FOR = """# a fake step that writes its record only if the other starts while it runs
import os, sys, time
from pathlib import Path
from fake_record import write_record
staging = Path(sys.argv[sys.argv.index("--results-dir") + 1])
(staging / "{mine}.started").touch()
print("waiting threads:", os.environ.get("OMP_WAIT_POLICY"), flush=True)
print("started by the tour itself:", os.getppid() == {tour_pid}, flush=True)
for _ in range(300):  # 30 s at most
    if (staging / "{other}.started").exists():
        write_record(__file__)
        sys.exit(0)
    time.sleep(0.1)
sys.exit("{other} did not start beside me")
"""


def test_a_cpu_tour_runs_two_single_process_steps_side_by_side(tmp_path, monkeypatch, capfd):
    """Each of two fake steps finishes only if the other starts while it runs; the table says
    the training times were shared. --publish, --one-at-a-time and a GPU run each step alone."""
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    shutil.copy(FIXTURES / "fake_steps" / "fake_record.py", scripts)
    for mine, other in (("01", "02"), ("02", "01")):
        (scripts / f"{mine}_waits_for_{other}.py").write_text(
            WAITS_FOR.format(mine=mine, other=other, tour_pid=os.getpid()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert tour.main(["--results-dir", str(results), "--skip-estimate"], scripts_dir=scripts) == 0
    output = capfd.readouterr().out
    assert "[1/2] 01_waits_for_02.py ... (beside 02_waits_for_01.py)" in output
    assert output.index("01_waits_for_02 wrote its record") < output.index("[1/2] 01_waits_for_02.py ok")
    assert list(table_rows((results / TOUR_TABLE).read_text())) == ["01_waits_for_02", "02_waits_for_01"]
    assert "ran two at a time" in (results / TOUR_TABLE).read_text()
    # waiting threads sleep, so that two steps' threads on few cores do not spin on each other's
    # (the same threads as alone: the same sums, the same results)
    assert output.count("waiting threads: PASSIVE") == 2
    # on Linux each forked from the fork server, which has imported what the scripts import
    # (tour/warm.py), not a fresh Python the tour started
    assert output.count(f"started by the tour itself: {sys.platform != 'linux'}") == 2
    for flags in (["--one-at-a-time"], ["--publish", str(tmp_path / "docs")]):
        assert not tour.parse_args(flags, scripts_dir=scripts).side_by_side
    assert tour.parse_args([], scripts_dir=scripts).side_by_side
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not tour.parse_args([], scripts_dir=scripts).side_by_side


SAYS_HOW_IT_STARTED = """# a fake sharded step: says how it was started, then writes its record (rank 0)
import os, signal
from pathlib import Path
import torch
from fake_record import write_record
forked = b"forkserver" in Path("/proc/self/cmdline").read_bytes()  # (no new program since)
print(f"process {{os.environ['RANK']}} of {{os.environ['WORLD_SIZE']}}: torchrun's: "  # (one write)
      f"{{'TORCHELASTIC_RUN_ID' in os.environ}} | threads: {{torch.get_num_threads()}} | forked "
      f"from the fork server: {{forked}} | SIGTERM's handler the default: "
      f"{{signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}}", flush=True)
write_record(__file__)
"""
FAILS_IN_ONE = """import os, time
if os.environ["RANK"] == "1":
    raise RuntimeError("process 1 broke on purpose")
time.sleep(60)  # until torchrun ends it, on process 1's failure
"""


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_a_cpu_tours_sharded_step_is_torchrun_forking_its_processes_warm(tmp_path, monkeypatch,
                                                                        capfd):
    """On Linux torchrun runs in a child of the fork server and forks its processes (tour/warm.py),
    each with torchrun's environment and its one thread a process; one that raises fails the
    step with its error, and torchrun ends the other."""
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    shutil.copy(FIXTURES / "fake_steps" / "fake_record.py", scripts)
    (scripts / "07_says_how_it_started.py").write_text(
        SAYS_HOW_IT_STARTED.format(tour_pid=os.getpid()))
    (scripts / "08_fails_in_one.py").write_text(FAILS_IN_ONE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # (torchrun's 1 where none is set)
    assert tour.main(["--results-dir", str(results), "--skip-estimate", "--step-timeout", "120"],
                     scripts_dir=scripts) == 1
    output = capfd.readouterr()
    for rank in (0, 1):
        assert (f"process {rank} of 2: torchrun's: True | threads: 1 | forked from the fork "
                "server: True | SIGTERM's handler the default: True") in output.out
    rows = {name: row[-1] for name, row in table_rows((results / TOUR_TABLE).read_text()).items()}
    assert rows == {"07_says_how_it_started (2 processes, cpu)": "ok",
                    "08_fails_in_one":
                        "failed: exit status 1: RuntimeError: process 1 broke on purpose"}
    # the failed process's traceback streamed through; torchrun ended the other at once
    assert 'raise RuntimeError("process 1 broke on purpose")' in output.err
    assert json.loads((results / "tour.json").read_text())["steps"][1]["wall_seconds"] < 60


def test_every_module_the_fork_server_imports_is_installed():
    """tour/preload.py passes over a module that fails to import (a step imports it then, and
    says why), so a name that names no module would only slow every step, silently."""
    for name in warm.SCRIPTS_MODULES:
        top, *inner = name.split(".")
        spec = importlib.util.find_spec(top)  # (a submodule's would import its package)
        assert spec is not None, name
        folder = Path(spec.origin).parent.joinpath(*inner)
        assert not inner or folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file(), name


ESTIMATES_BESIDE = """# stands in for python -m estimate: notes it started, says its priority
import os, shutil, sys
from pathlib import Path
staging = Path(sys.argv[sys.argv.index("--results-dir") + 1])
(staging / "estimate.started").touch()  # (the steps' --results-dir too)
print("the estimate's nice value:", os.getpriority(os.PRIO_PROCESS, 0), flush=True)
if Path("/proc/self/autogroup").is_file():  # Linux's scheduling of sessions as groups
    print("its session's:", Path("/proc/self/autogroup").read_text().split()[-1], flush=True)
shutil.copy({records!r}, staging / "estimate.json")
"""
@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no process priorities here")
def test_a_cpu_tours_estimate_runs_from_the_start_at_the_lowest_priority(tmp_path, monkeypatch,
                                                                       capfd):
    """Beside every step, on the cores they leave idle: 01 ends only once it has started."""
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    shutil.copy(FIXTURES / "fake_steps" / "fake_record.py", scripts)
    (scripts / "01_waits_for_the_estimate.py").write_text(
        WAITS_FOR.format(mine="01", other="estimate", tour_pid=os.getpid()))
    (scripts / "02_ends_at_once.py").write_text(STARTS_AND_ENDS.format(mine="02"))
    estimates = tmp_path / "estimates.py"
    estimates.write_text(ESTIMATES_BESIDE.format(records=str(FIXTURES / "tour" / "estimate.json")))
    monkeypatch.setattr(tour, "estimate_command", lambda results_dir: tour.Command(
        "estimate", [sys.executable, str(estimates), "--results-dir", str(results_dir)],
        "estimate.json", "estimate"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert tour.main(["--results-dir", str(results), "--steps", "01", "02"],
                     scripts_dir=scripts) == 0
    output = capfd.readouterr().out
    assert "[3/3] estimate ... (in the background from the start, at the lowest priority" in output
    assert f"the estimate's nice value: {tour.LOWEST_PRIORITY}" in output
    assert (f"its session's: {tour.LOWEST_PRIORITY}" in output
            or not Path("/proc/self/autogroup").is_file())
    assert "[3/3] estimate ok" in output and (results / "estimate.json").is_file()
    steps = json.loads((results / "tour.json").read_text())
    assert [step["status"] for step in steps["steps"]] == ["ok", "ok"]
    assert steps["estimate"]["status"] == "ok" and steps["estimate"]["waited_seconds"] >= 0


@pytest.mark.timeout(60)
def test_a_side_by_side_tour_shows_its_failed_steps_as_alone(tmp_path, monkeypatch, capfd):
    """Forked from the fork server (tour/warm.py), a step that raises, one that exits with a
    message, one that hangs and one killed by a signal are shown as a Python of their own
    would be, their output kept; the steps beside them write their records."""
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    shutil.copytree(FIXTURES / "fake_steps", scripts, ignore=shutil.ignore_patterns("0[37]_*"))
    (scripts / "03_says_why.py").write_text('import sys\nprint("03 output")\n'
                                            'sys.exit("03 cannot go on: a message")\n')
    (scripts / "04_hangs.py").write_text("import time\ntime.sleep(120)\n")
    (scripts / "05_killed.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    status = tour.main(["--results-dir", str(results), "--skip-estimate", "--step-timeout", "3",
                        "--steps", "01", "02", "03", "04", "05"], scripts_dir=scripts)
    assert status == 1
    output = capfd.readouterr()
    rows = {name: row[-1] for name, row in table_rows((results / TOUR_TABLE).read_text()).items()}
    assert rows == {
        "01_writes_record": "ok",
        "02_crashes": "failed: exit status 1: RuntimeError: broken on purpose",
        "03_says_why": "failed: exit status 1: 03 cannot go on: a message",
        "04_hangs": "failed: timed out after 3 s (--step-timeout) and was stopped",
        "05_killed": "failed: exit status -9: no error message"}
    assert "02 starting" in output.out and "03 output" in output.out
    assert "a warning before the error" in output.err and "Traceback" in output.err


STARTS_AND_ENDS = """# a fake step that notes it started and writes its record at once
import sys
from pathlib import Path
from fake_record import write_record
(Path(sys.argv[sys.argv.index("--results-dir") + 1]) / "{mine}.started").touch()
write_record(__file__)
"""


def test_a_step_starts_as_soon_as_a_slot_frees_not_when_its_pair_ends(tmp_path, monkeypatch, capfd):
    """01 ends only once 03 has started: 02 ends at once, and 03 takes its slot while 01 still
    runs (two steps at a time in pairs would wait for 01 first, which then waits for 03)."""
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    shutil.copy(FIXTURES / "fake_steps" / "fake_record.py", scripts)
    (scripts / "01_waits_for_03.py").write_text(
        WAITS_FOR.format(mine="01", other="03", tour_pid=os.getpid()))
    for mine in ("02", "03"):
        (scripts / f"{mine}_ends_at_once.py").write_text(STARTS_AND_ENDS.format(mine=mine))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert tour.main(["--results-dir", str(results), "--skip-estimate"], scripts_dir=scripts) == 0
    output = capfd.readouterr().out
    assert "[3/3] 03_ends_at_once.py ... (beside 01_waits_for_03.py)" in output
    assert "[1/3] 01_waits_for_03.py (ran beside 02_ends_at_once.py, 03_ends_at_once.py):" in output
    steps = {step["script"]: step for step in json.loads((results / "tour.json").read_text())["steps"]}
    assert [steps[name]["status"] for name in steps] == ["ok"] * 3
    assert steps["03_ends_at_once"]["beside"] == "01_waits_for_03.py"


SLEEPS = """import os, sys, time
from pathlib import Path
results = Path(sys.argv[sys.argv.index("--results-dir") + 1]).parent  # above the tour's staging
(results / "{mine}.pid").write_text(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_side_by_side_tour_ends_both_steps_in_one_line(tmp_path):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    for mine in ("01", "02"):
        (scripts / f"{mine}_sleeps.py").write_text(SLEEPS.format(mine=mine))
    argv = ["--results-dir", str(results), "--skip-estimate", "--device", "cpu"]  # side by side
    # python -m tour itself (tour/__main__.py), its scripts the fakes; Ctrl-C raises
    # KeyboardInterrupt even where the test runner ignores SIGINT
    code = ("import functools, runpy, signal, sys; from tour import runner; "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"runner.main = functools.partial(runner.main, scripts_dir={str(scripts)!r}); "
            f"sys.argv = ['tour', *{argv!r}]; runpy.run_module('tour', run_name='__main__')")
    tour_process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pid_files = [results / "01.pid", results / "02.pid"]
    try:
        deadline = time.monotonic() + 60
        while not all(path.is_file() and path.read_text() for path in pid_files):
            assert time.monotonic() < deadline and tour_process.poll() is None, "no steps started"
            time.sleep(0.1)
        tour_process.send_signal(signal.SIGINT)
        stdout, stderr = tour_process.communicate(timeout=30)
        assert tour_process.returncode != 0 and "Traceback" not in stderr, stderr
        assert "interrupted (Ctrl-C)" in stderr and "FAILED" not in stdout, stdout
        for path in pid_files:  # both steps ended (not left sleeping)
            deadline = time.monotonic() + 10
            while alive(int(path.read_text())):
                assert time.monotonic() < deadline, f"{path.stem} still runs"
                time.sleep(0.1)
    finally:  # whatever failed, nothing of it left running
        tour_process.kill()
        for path in pid_files:
            if path.is_file() and path.read_text() and alive(int(path.read_text())):
                os.kill(int(path.read_text()), signal.SIGKILL)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tour_rejects_unknown_steps(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tour.main(["--steps", "01", "42"])
    assert exit_info.value.code == 2
    assert "--steps: no script '42'; the scripts are: 01 02 03 04 04a" in capsys.readouterr().err


def test_tour_runs_two_real_steps(tmp_path):
    """From another working directory; forked from a Python that has imported every module of
    tour/warm.py's SCRIPTS_MODULES (tour/preload.py passes over one that fails to import, and the
    tour says so)."""
    results = tmp_path / "results"
    command = [sys.executable, "-m", "tour", "--steps", "01", "3", *QUICK,
               "--skip-estimate", "--results-dir", str(results)]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "\nready (" in run.stdout and "did not import" not in run.stdout, run.stdout
    assert "[1/2] 01_baseline.py ..." in run.stdout and "[2/2] 03_bf16.py ok" in run.stdout
    assert sorted(path.name for path in results.iterdir()) == sorted([
        "01_baseline.json", "03_bf16.json", "tour.json", TOUR_TABLE, TOUR_CHART])
    table = (results / TOUR_TABLE).read_text()
    assert table in run.stdout  # the table is printed
    rows = table_rows(table)
    assert list(rows) == ["01_baseline", "03_bf16"]
    assert rows["01_baseline"][1] == "1.00x" and rows["03_bf16"][-1] == "ok"
    assert float(rows["03_bf16"][1].rstrip("x")) < 0.75  # bfloat16 halves most of the memory
    assert "GPU memory prediction: skipped (--skip-estimate)" in table
    assert_png(results / TOUR_CHART)


def test_error_excerpt_finds_the_childs_error_under_torchrun():
    stderr = (FIXTURES / "torchrun_stderr.txt").read_text().splitlines()  # 2 ranks, then torchrun
    error_line, lines = tour.error_excerpt(stderr)
    assert error_line == "ValueError: broken on purpose in rank 1"  # not ChildFailedError
    assert lines[-1] == error_line and len(lines) <= tour.ERROR_LINES
    assert "ValueError: broken on purpose in rank 0" in lines


def test_error_excerpt_keeps_a_message_of_several_lines():
    stderr = ["Traceback (most recent call last):", '  File "06_on_device_init.py", line 9',
              "[rank0]: common.hub.HubUnavailable: could not fetch the model",
              "  Run offline with the default preset instead:  --preset tiny", "",
              "E1121 23:17:57.048000 4141 api.py:1002] failed (exitcode: 1)"]
    error_line, lines = tour.error_excerpt(stderr)
    assert error_line == "common.hub.HubUnavailable: could not fetch the model"
    assert lines[-1] == "  Run offline with the default preset instead:  --preset tiny"


@pytest.mark.parametrize("device, said", [("cuda", True), ("cpu", False)])
def test_the_tour_says_why_05a_and_05b_are_slow_on_a_gpu(device, said):
    from tour.records import StepRow
    from tour.report import SYNCHRONIZING_NOTE, tour_markdown
    rows = [StepRow(script, preset="article", device=device)
            for script in ("04_grad_accum", "05a_adamw_8bit", "05b_adafactor")]
    assert (SYNCHRONIZING_NOTE in tour_markdown(rows)) is said
