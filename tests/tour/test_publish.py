"""Publishing the tour: the machine named under each table, the tables the README and docs/
embed, and the published tables themselves, which must hold every row their tour makes.

The two tests of the published tables read docs/ as it is: they fail while a published table
lags the scripts, and pass once its tour has published it again (the commands are in
tour/publish.py's PUBLISHED; with --steps NN, the rows of the steps named alone). The tests after
them publish fake steps' rows into a docs/ of their own (tour/partial.py).
"""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from estimate import records
from estimate.command import model_flags, parse_table_args, rows_for
from steps import select, with_parent
from tour import machine, partial, publish
from tour import runner as tour
from tour.charts import NOT_BROKEN_DOWN, tour_figure
from tour.machine import MADE_ON, cell_mark, machine_line, this_machine, without_mark
from tour.publish import PUBLISHED, embedded, embeds, refresh_embeds, step_cell, table_lines
from tour.records import StepRow, read_json
from tour.report import ESTIMATE_TABLE, TOUR_CHART, TOUR_TABLE, script_of, step_name, write_report

FIXTURES = Path(__file__).parent / "fixtures"
EPYC = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n")
AVX2_ONLY = ("model name\t: Intel(R) Xeon(R) CPU E5-2690 v4 @ 2.60GHz\n"
             "flags\t\t: fpu sse2 avx avx2 fma\n")
ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve bf16 svebf16 i8mm\nCPU part\t: 0xd40\n"


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Write a faked /proc/cpuinfo (the text given), or none at all (None); no cgroup quota."""
    def fake(text):
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(machine, "CPUINFO", path)
        monkeypatch.setattr(machine, "CPU_QUOTA", tmp_path / "no-cpu.max")
        monkeypatch.setattr(machine, "lscpu_model", lambda: "Neoverse-V1")  # lscpu's name on Arm
        return this_machine()
    return fake


def test_the_machine_is_named_from_cpuinfo_with_its_bfloat16_arithmetic(cpuinfo):
    epyc = cpuinfo(EPYC)
    cores = machine.cores_used()  # without a quota (the fixture's): the cores it may run on
    assert epyc == {"cpu": "AMD EPYC 9R14 96-Core Processor", "cores_used": cores,
                    "bfloat16": ["avx512_bf16"]}
    assert machine_line(epyc) == (f"Made on AMD EPYC 9R14 96-Core Processor, {cores} core"
                                  f"{'s' if cores > 1 else ''} used, with bfloat16 arithmetic "
                                  "(avx512_bf16).")
    xeon = cpuinfo(AVX2_ONLY)
    assert xeon["bfloat16"] == []
    assert "without bfloat16 arithmetic" in machine_line(xeon)
    arm = cpuinfo(ARM)  # no model name in cpuinfo: lscpu's; its flags in "Features"
    assert arm["cpu"] == "Neoverse-V1" and arm["bfloat16"] == ["bf16", "svebf16"]


def test_without_cpuinfo_the_machine_is_platforms_and_its_arithmetic_unknown(cpuinfo, monkeypatch):
    monkeypatch.setattr(machine.platform, "processor", lambda: "arm")  # what macOS says
    mac = cpuinfo(None)
    assert mac["bfloat16"] is None
    line = machine_line(mac)
    assert line.startswith(MADE_ON) and "unknown" in line and "without" not in line
    assert mac["cpu"] in line  # lscpu's or platform's name, whichever answered
    assert machine_line(None) is None  # a tour.json from before the machine was recorded


def test_the_cores_used_are_capped_by_a_containers_quota(tmp_path, monkeypatch):
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(machine, "CPU_QUOTA", quota)
    quota.write_text("max 100000\n")
    unlimited = machine.cores_used()
    assert unlimited >= 1
    quota.write_text("50000 100000\n")  # half a core: one
    assert machine.cores_used() == 1


def test_the_report_names_the_machine_under_each_table(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(FIXTURES / "tour", results)
    write_report(results)  # a tour.json without its machine: no line
    assert MADE_ON not in (results / TOUR_TABLE).read_text()
    tour_json = json.loads((results / "tour.json").read_text())
    made_on = {"cpu": "AMD EPYC 9R14", "cores_used": 2, "bfloat16": ["avx512_bf16"]}
    (results / "tour.json").write_text(json.dumps({**tour_json, "machine": made_on}))
    write_report(results)
    for name in (TOUR_TABLE, ESTIMATE_TABLE):
        lines = (results / name).read_text().splitlines()
        last_row = max(index for index, line in enumerate(lines) if line.startswith("|"))
        assert lines[last_row + 1:last_row + 3] == ["", machine_line(made_on)], name


def test_a_tour_records_its_machine_and_publishing_writes_the_embeds(tmp_path, monkeypatch, cpuinfo):
    """The fake steps' tour published into a docs/ of its own, beside a README that embeds its
    table whole and without branches: both embeds written, with the machine's line."""
    cpuinfo(EPYC)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    docs, results = tmp_path / "docs", tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text(f"# A page\n\n<!-- table: docs/{TOUR_TABLE} -->\nby hand\n<!-- /table -->\n\n"
                      f"<!-- table: docs/{TOUR_TABLE}, without branches -->\n<!-- /table -->\n"
                      f"<!-- table: elsewhere/{TOUR_TABLE} -->\nkept\n<!-- /table -->\n")
    monkeypatch.setattr(publish, "documents", lambda: [readme])
    status = tour.main(["--results-dir", str(results), "--publish", str(docs), "--steps", "01", "07",
                        "--max-steps", "2", "--skip-estimate"], scripts_dir=FIXTURES / "fake_steps")
    assert status == 0
    recorded, _ = read_json(results / "tour.json")
    assert recorded["machine"]["cpu"] == "AMD EPYC 9R14 96-Core Processor"
    table = (docs / TOUR_TABLE).read_text()
    assert machine_line(recorded["machine"]) in table
    [(_, _, whole), (_, _, main_steps), (_, _, elsewhere)] = embeds(readme)
    assert whole == main_steps == embedded(table)  # no branch among the fakes
    assert whole.splitlines()[2:4] == [line for line in table.splitlines() if line.startswith("| 0")]
    assert whole.endswith(f"\n\n{machine_line(recorded['machine'])}\n")
    assert elsewhere == "kept\n"  # another file's embed is left alone


SOURCE = """# A published table

| step | peak MiB | status |
| --- | ---: | --- |
| 01_baseline | 21.31 | ok |
| 04a_optimizer_in_backward (branch of 03) | 11.04 | ok |
| 07_fsdp (2 processes, cpu) | 4.32 | ok |
| 07b_qlora (branch of 07a) | 3.52 | ok |
| 10_combined | 11.04 | ok |
| 10_combined (whole stack) | 3.00 | ok |

Made on AMD EPYC, 2 cores used, with bfloat16 arithmetic (avx512_bf16).

The combined script (10), one process each run: ...
"""


def test_an_embed_without_branches_keeps_the_steps_and_the_combined_scripts_rows(tmp_path):
    shown = embedded(SOURCE, "without branches")
    assert [step_cell(line) for line in table_lines(shown)[2:]] == [
        "01_baseline", "07_fsdp (2 processes, cpu)", "10_combined", "10_combined (whole stack)"]
    assert shown.endswith("| 3.00 | ok |\n\nMade on AMD EPYC, 2 cores used, with bfloat16 "
                          "arithmetic (avx512_bf16).\n")
    assert table_lines(embedded(SOURCE)) == table_lines(SOURCE)
    with pytest.raises(ValueError, match="without branches"):
        embedded(SOURCE, "the best rows")
    # an embed edited by hand is not what publishing makes, and publishing writes it again
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / TOUR_TABLE).write_text(SOURCE)
    page = tmp_path / "page.md"
    hand_edited = shown.replace("21.31", "20.00")
    page.write_text(f"<!-- table: docs/{TOUR_TABLE}, without branches -->\n{hand_edited}<!-- /table -->\n")
    [(_, selection, held)] = embeds(page)
    assert held != embedded(SOURCE, selection)
    assert refresh_embeds([tmp_path / "docs" / TOUR_TABLE], [page]) == [page]
    assert embeds(page)[0][2] == shown
    assert refresh_embeds([tmp_path / "docs" / TOUR_TABLE], [page]) == []  # nothing to change


@pytest.mark.parametrize("script, world_size", [("05a_adamw_8bit", 1), ("07_fsdp", 2),
                                                ("10_combined", 1), ("10_combined_stack", 1)])
def test_a_tables_step_cell_reads_back_as_its_record(script, world_size):
    assert script_of(step_name(StepRow(script, world_size=world_size, device="cpu"))) == script


@pytest.mark.parametrize("flags", [
    ["--max-steps", "2"], ["--skip-estimate"], ["--preset", "tiny-text"], ["--epochs", "1"],
    ["--steps", "01_baseline", "--max-steps", "2"], ["--steps", "01_baseline", "--epochs", "1"],
    ["--steps", "01_baseline", "--skip-estimate"], ["--steps", "01_baseline", "--preset", "tiny-text"]])
def test_publishing_into_docs_takes_its_tour_at_full_length_with_or_without_steps(flags, capsys):
    """A shortened tour, one without its estimate or of another preset published into docs/
    would leave its tables short of rows or unlike the rest of them: refused in one line, before
    any step runs. Some steps' rows alone (--steps) are published."""
    with pytest.raises(SystemExit) as exit_info:
        tour.parse_args([*flags, "--publish", str(ROOT / "docs")])
    assert exit_info.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].startswith(f"python -m tour: error: --publish {ROOT / 'docs'}: docs/ holds the "
                               "whole tour of --preset tiny --task classification"), said
    assert tour.parse_args(["--publish", str(ROOT / "docs")]).publish == ROOT / "docs"
    some = tour.parse_args(["--publish", str(ROOT / "docs"), "--steps", "05a_adamw_8bit"])
    assert some.merging and [script.name for script in some.scripts] == ["05a_adamw_8bit.py"]


def published_tour(directory, results_dir):
    """parse_args of the tour that publishes into `directory` (PUBLISHED)."""
    preset, task = PUBLISHED[directory]
    return tour.parse_args(["--preset", preset, "--task", task, "--publish", str(ROOT / directory),
                            "--results-dir", str(results_dir)])




@pytest.mark.parametrize("directory", PUBLISHED)
def test_each_published_tour_table_lists_every_row_its_tour_makes(directory, tmp_path):
    """The rows the tour's own commands make (every step and branch of its task, then the
    combined script twice), in its order, each ok and named with the machine; fails until the
    table is published again after a script is added."""
    args = published_tour(directory, tmp_path)
    expected = [command.record_name for command in tour.tour_commands(args, tmp_path)]
    text = (ROOT / directory / TOUR_TABLE).read_text()
    lines = table_lines(text)
    shown = [script_of(step_cell(line)) for line in lines[2:]]
    assert shown == expected, (f"{directory}/{TOUR_TABLE}: missing {sorted(set(expected) - set(shown))}, "
                               f"not made now {sorted(set(shown) - set(expected))}")
    assert f"Preset {args.preset}," in text and ("test loss" in lines[0]) == (args.task == "causal-lm")
    assert [line.rstrip(" |").rsplit("| ", 1)[-1] for line in lines[2:]] == ["ok"] * len(shown)
    assert any(line.startswith(MADE_ON) for line in text.splitlines()), "no machine named"
    assert (ROOT / directory / ESTIMATE_TABLE).exists() == (tour.estimate_of(args, tmp_path) is not None)


def test_the_published_estimate_table_lists_every_row_the_tours_estimate_makes(tmp_path, monkeypatch):
    """The rows python -m estimate makes as the tour calls it: each script of the table (the
    study's other settings after its own), in order; fails until it is published again."""
    monkeypatch.setattr(records, "KEPT", records.KEPT)  # parse_table_args sets it
    for directory in PUBLISHED:
        command = tour.estimate_of(published_tour(directory, tmp_path), tmp_path)
        if command is None:
            continue
        asked = parse_table_args(command.argv[command.argv.index(tour.ESTIMATE_MODULE) + 1:])
        flags = model_flags(asked)
        expected = [with_parent(row.script.stem) for step in select(asked.steps, asked.task)
                    if not step.by_hand for row in rows_for(step.path, asked.preset, asked.device,
                                                            asked.world_size, flags, asked.gpu)]
        text = (ROOT / directory / ESTIMATE_TABLE).read_text()
        shown = [without_mark(step_cell(line)) for line in table_lines(text)[2:]]  # (¹: another CPU)
        assert shown == expected, (f"{directory}/{ESTIMATE_TABLE}: missing "
                                   f"{sorted(set(expected) - set(shown))}")
        assert any(line.startswith(MADE_ON) for line in text.splitlines()), "no machine named"


# Publishing some steps' rows (python -m tour --publish DIR --steps NN, tour/partial.py), with
# fake steps named as the scripts they stand in for, so that their rows read as the real ones

FAKE_STEP = "from fake_record import write_record\n\nwrite_record(__file__)\n"
CRASHES = "raise RuntimeError('broken on purpose')\n"


@pytest.fixture
def site(tmp_path, monkeypatch, cpuinfo):
    """A tour to publish into a docs/ of its own, beside a README that embeds its tables: fake
    steps in scripts/ (`add` writes one), the fake estimate, no GPU, an EPYC's CPU; `tour(...)`
    runs python -m tour with those and returns its exit status."""
    scripts, docs, results = tmp_path / "scripts", tmp_path / "docs", tmp_path / "results"
    scripts.mkdir()
    shutil.copy(FIXTURES / "fake_steps" / "fake_record.py", scripts)
    readme = tmp_path / "README.md"
    readme.write_text(f"<!-- table: docs/{TOUR_TABLE} -->\n<!-- /table -->\n\n"
                      f"<!-- table: docs/{TOUR_TABLE}, without branches -->\n<!-- /table -->\n\n"
                      f"<!-- table: docs/{ESTIMATE_TABLE} -->\n<!-- /table -->\n")
    monkeypatch.setattr(publish, "documents", lambda: [readme])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    estimates = []  # the --steps each estimate was asked for (None: every step)

    def fake_estimate(results_dir, steps=None):
        estimates.append(steps)
        return tour.Command("estimate", [sys.executable, str(FIXTURES / "fake_estimate.py"),
                                         "--results-dir", str(results_dir),
                                         *(["--steps", *steps] if steps else [])],
                            "estimate.json", "estimate")

    monkeypatch.setattr(tour, "estimate_command", fake_estimate)
    cpuinfo(EPYC)

    class Site:
        def add(self, name, source=FAKE_STEP):
            (scripts / f"{name}.py").write_text(source)

        def tour(self, *flags):
            return tour.main(["--results-dir", str(results), "--publish", str(docs), *flags],
                             scripts_dir=scripts)

        def text(self, name):
            return (docs / name).read_text()

    found = Site()
    found.scripts, found.docs, found.results, found.readme = scripts, docs, results, readme
    found.estimates, found.machine = estimates, cpuinfo
    for name in ("01_baseline", "03_bf16", "05_sgd_cosine"):
        found.add(name)
    return found


def rows_of(text):
    """{step cell: row line} of the first table in `text`."""
    return {step_cell(line): line for line in table_lines(text)[2:]}


def test_a_partial_publish_rewrites_only_the_named_rows(site, monkeypatch):
    """03 rerun (it now trains 2.5 s, its estimate doubled): its row in each table is this run's,
    and every other byte of both tables, the machine's line and the prose, is as published;
    the estimate's records beside its table follow, and the README's embeds are written again."""
    assert site.tour() == 0  # the whole tour: 01, 03, 05, and the estimate of the study's steps
    tour_before, estimate_before = site.text(TOUR_TABLE), site.text(ESTIMATE_TABLE)
    chart_before = (site.docs / "tour-chart.png").read_bytes()
    monkeypatch.setenv("FAKE_TRAIN_SECONDS", "2.5")
    monkeypatch.setenv("FAKE_ESTIMATE_SCALE", "2")
    assert site.tour("--steps", "03_bf16") == 0
    assert site.estimates == [None, ["03_bf16"]]  # 03's estimate alone, beside kept records
    tour_after, estimate_after = site.text(TOUR_TABLE), site.text(ESTIMATE_TABLE)
    old, new = rows_of(tour_before)["03_bf16"], rows_of(tour_after)["03_bf16"]
    assert "| 1.5 s |" in old and "| 2.5 s |" in new
    assert tour_after == tour_before.replace(old, new)
    old_rows = [line for cell, line in rows_of(estimate_before).items() if cell.startswith("03_bf16")]
    new_rows = [line for cell, line in rows_of(estimate_after).items() if cell.startswith("03_bf16")]
    assert len(old_rows) == len(new_rows) == 1 and "10.20 GB" in new_rows[0]  # 5.1 GB doubled
    assert estimate_after == estimate_before.replace(old_rows[0], new_rows[0])
    records = {record["script"]: record for record in json.loads(site.text("estimate.json"))}
    assert records["03_bf16"]["allocated_bytes"] == 10.2e9
    assert records["01_baseline"]["allocated_bytes"] == 25.1e9  # kept as published
    assert (site.docs / "tour-chart.png").read_bytes() != chart_before  # 03's time drawn again
    assert [shown for _, _, shown in embeds(site.readme)] == [
        embedded(tour_after), embedded(tour_after, "without branches"), embedded(estimate_after)]


def test_a_new_steps_row_lands_in_tour_order_and_a_gone_steps_row_is_dropped(site):
    """04a, new, goes between 03 and 05 (steps.py's order), its "vs 01" against the table's 01;
    05, whose script is gone, leaves the table; 01 and 03 stay byte for byte."""
    assert site.tour("--skip-estimate") == 0
    before = rows_of(site.text(TOUR_TABLE))
    site.add("04a_optimizer_in_backward")
    (site.scripts / "05_sgd_cosine.py").unlink()
    assert site.tour("--skip-estimate", "--steps", "04a_optimizer_in_backward") == 0
    after = rows_of(site.text(TOUR_TABLE))
    assert list(after) == ["01_baseline", "03_bf16", "04a_optimizer_in_backward (branch of 03)"]
    assert [after[cell] for cell in ("01_baseline", "03_bf16")] == [before["01_baseline"],
                                                                 before["03_bf16"]]
    assert after["04a_optimizer_in_backward (branch of 03)"].startswith("| 04a_optimizer_in_backward "
                                                                       "(branch of 03) | 1.00 | 0.50x |")
    assert "04a_optimizer_in_backward" not in embeds(site.readme)[1][2]  # without branches


def test_rerunning_01_computes_every_rows_vs_01_again(site, monkeypatch):
    """01's peak doubles: the other rows' ratios are computed again from the peaks the table
    shows (their other cells kept), and a row published after it is compared with the new 01."""
    assert site.tour("--skip-estimate") == 0
    before = rows_of(site.text(TOUR_TABLE))
    assert before["03_bf16"].startswith("| 03_bf16 | 1.00 | 0.50x |")
    monkeypatch.setenv("FAKE_BASELINE_MIB", "4")
    assert site.tour("--skip-estimate", "--steps", "01_baseline") == 0
    after = rows_of(site.text(TOUR_TABLE))
    assert after["01_baseline"].startswith("| 01_baseline | 4.00 | 1.00x |")
    assert after["03_bf16"] == before["03_bf16"].replace("0.50x", "0.25x")
    assert after["05_sgd_cosine"] == before["05_sgd_cosine"].replace("0.50x", "0.25x")
    site.add("04a_optimizer_in_backward")
    assert site.tour("--skip-estimate", "--steps", "04a_optimizer_in_backward") == 0
    assert "| 1.00 | 0.25x |" in rows_of(site.text(TOUR_TABLE))["04a_optimizer_in_backward (branch of 03)"]


def test_a_row_from_another_machine_is_marked_and_its_mark_survives_later_publishes(site, monkeypatch):
    """03 rerun on an AVX2 Xeon: marked ¹ in both tables, a second line names that machine, and
    the chart marks it and names both; 05 rerun on the EPYC leaves 03's row and line as they
    were; 01 on an Arm machine takes ²; once every row is the EPYC's again, one line, no mark."""
    charts = {}
    monkeypatch.setattr(partial, "save_png", lambda figure, path: charts.update({path.name: figure}))
    assert site.tour() == 0
    epyc = machine_line(site.machine(EPYC))
    xeon = machine_line(site.machine(AVX2_ONLY))
    assert site.tour("--steps", "03_bf16") == 0
    for name in (TOUR_TABLE, ESTIMATE_TABLE):
        text = site.text(name)
        assert [cell for cell in rows_of(text) if cell.startswith("03_bf16")] == ["03_bf16 ¹"], name
        assert [line for line in text.splitlines() if MADE_ON in line] == [epyc, f"¹ {xeon}"], name
    [_, _, shown], *_ = embeds(site.readme)
    assert shown.endswith(f"\n\n{epyc}\n\n¹ {xeon}\n")
    figure = charts[TOUR_CHART]  # every row of the table, 03's marked, both machines named
    ticks = [label.get_text() for label in figure.axes[-1].get_xticklabels()]
    assert [tick.split("\n", 1)[1] for tick in ticks] == ["baseline", "bf16", "sgd cosine"]
    assert [tick.split("\n")[0] for tick in ticks][1] == "03 ¹"
    assert figure.get_supxlabel().split() == f"{epyc} ¹ {xeon}".split()  # wrapped to its width

    marked = rows_of(site.text(TOUR_TABLE))["03_bf16 ¹"]
    site.machine(EPYC)
    assert site.tour("--steps", "05_sgd_cosine") == 0
    text = site.text(TOUR_TABLE)
    assert rows_of(text)["03_bf16 ¹"] == marked and "05_sgd_cosine" in rows_of(text)
    assert [line for line in text.splitlines() if MADE_ON in line] == [epyc, f"¹ {xeon}"]

    arm = machine_line(site.machine(ARM))
    assert site.tour("--skip-estimate", "--steps", "01_baseline") == 0
    text = site.text(TOUR_TABLE)
    assert list(rows_of(text)) == ["01_baseline ²", "03_bf16 ¹", "05_sgd_cosine"]
    assert [line for line in text.splitlines() if MADE_ON in line] == [epyc, f"¹ {xeon}", f"² {arm}"]

    site.machine(EPYC)
    assert site.tour("--steps", "01_baseline", "03_bf16") == 0
    for name in (TOUR_TABLE, ESTIMATE_TABLE):
        text = site.text(name)
        assert not any(cell_mark(cell) for cell in rows_of(text)), name
        assert [line for line in text.splitlines() if MADE_ON in line] == [epyc], name
    assert charts[TOUR_CHART].get_supxlabel() == ""  # one machine: nothing to say at its foot


def test_a_failed_step_publishes_nothing(site, capsys):
    assert site.tour() == 0
    before = {path.name: path.read_bytes() for path in site.docs.iterdir()}
    site.add("03_bf16", CRASHES)
    assert site.tour("--steps", "03_bf16") == 1
    assert "not published into" in capsys.readouterr().out
    assert {path.name: path.read_bytes() for path in site.docs.iterdir()} == before


def test_the_estimate_records_are_kept_beside_a_table_published_without_them(site, monkeypatch, capsys):
    """docs/ as published before the records were kept there: the estimate runs over every step
    once, its records of the rows kept must make those rows to the byte, and are kept from then
    on; where they make other rows (the estimate changed since), nothing is published."""
    assert site.tour() == 0
    (site.docs / "estimate.json").unlink()
    before = {path.name: path.read_bytes() for path in site.docs.iterdir()}
    monkeypatch.setenv("FAKE_ESTIMATE_SCALE", "2")
    assert site.tour("--steps", "03_bf16") == 1
    said = capsys.readouterr().err
    assert "the rows of 01_baseline, 02_mixed_precision, 04_grad_accum, 07_fsdp, " \
           "09_activation_checkpointing are not what their estimate records" in said
    assert {path.name: path.read_bytes() for path in site.docs.iterdir()} == before
    monkeypatch.setenv("FAKE_ESTIMATE_SCALE", "1")
    assert site.tour("--steps", "03_bf16") == 0
    assert site.estimates == [None, None, None]  # each time every step, for want of records
    assert site.text(ESTIMATE_TABLE).encode() == before[ESTIMATE_TABLE]
    assert len(json.loads(site.text("estimate.json"))) == 6  # every record, kept from now on
    assert site.tour("--steps", "03_bf16") == 0
    assert site.estimates[-1] == ["03_bf16"]


def test_a_merged_tables_chart_is_drawn_from_the_table_as_it_shows_its_rows():
    """The tour chart of a partial publish is drawn from the published table itself (docs/'s
    here): a bar per row as tall as its peak, stacked by its breakdown without a grey sliver for
    the table's rounding, and each time and accuracy labelled as the table shows it."""
    text = (ROOT / "docs" / TOUR_TABLE).read_text()
    lines = table_lines(text)
    rows = partial.chart_rows(lines[0], lines[2:])
    figure = tour_figure(rows)
    memory = [ax for ax in figure.axes if ax.get_label() == "memory"][0]
    heights = {}
    for bar in memory.patches:
        assert bar.get_gid() != NOT_BROKEN_DOWN, bar
        column = round(bar.get_x() + bar.get_width() / 2)
        heights[column] = heights.get(column, 0) + bar.get_height()
    cells = [partial.row_cells(line) for line in lines[2:]]
    assert [round(heights[column], 2) for column in range(len(cells))] == [
        float(row[1].replace(",", "")) for row in cells]
    labels = {ax.get_label(): [label.get_text() for label in ax.texts] for ax in figure.axes}
    assert labels["time"] == [row[9] for row in cells]
    assert labels["accuracy"] == [row[10] for row in cells]
