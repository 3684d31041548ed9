"""Traces for any micro-batch size (estimate/shortcuts/sizes.py) and the --gpu-memory search built
on them (estimate/search/fit.py): a trace written from runs at a few sizes is the run at that size, event for
event, on every architecture; a choice made by the size is caught; the search's answer is the
one a search of estimates gives."""
import re

import pytest

from conftest import script_path
from estimate.predict import predict, record_of, run_for
from estimate.question import Question
from estimate.search.fit import search, search_by_estimates
from estimate.search.grid import next_size
from estimate.shortcuts.sizes import Family, NotBySizes, canonical
from support.architecture_matrix import ARCHITECTURES, model_flags, write_model

COMPARED = ("allocated_bytes", "reserved_bytes", "breakdown_bytes", "host_bytes",
            "init_allocated_bytes", "init_reserved_bytes", "parameter_count",
            "model_state_bytes_per_parameter")


def runs(step, flags, sizes, world_size=1, accumulates=True):
    """{size: KeptRun} of `step` at micro-batches of each of `sizes` (as the search runs them)."""
    question = Question(script_path(step), flags, world_size, accumulates=accumulates)
    return {size: run_for(question.row(size)) for size in sizes}


def assert_written_is_run(step, flags, world_size=1, accumulates=True):
    """A line through micro-batches of 2 and 6, checked on 3, writes 4 and 5 as they run."""
    made = runs(step, flags, (2, 3, 4, 5, 6), world_size, accumulates)
    family = Family({size: made[size] for size in (2, 3, 6)})
    for size in (4, 5):
        written = family.written(size)
        assert written.events == canonical(made[size].events)  # (frees of a run in one order)
        assert ({key: record_of(written)[key] for key in COMPARED}
                == {key: record_of(made[size])[key] for key in COMPARED})


@pytest.mark.parametrize("name", [name for name in ARCHITECTURES if name != "ResNet"])
def test_a_size_between_runs_is_written_as_it_runs_on_every_architecture(name, tmp_path):
    folder = write_model(tmp_path / re.sub(r"\W", "", name.lower()), name)
    assert_written_is_run("04", [*model_flags(folder, name), "--device", "cuda"])


@pytest.mark.parametrize("step, world_size, accumulates", [
    ("03", 1, False),   # every sample in one pass
    ("05c", 1, True),   # recomputation in backward
    ("05i", 1, True),   # gradients to the host as backward makes them
    ("09", 2, True),    # sharded over 2 processes, checkpointed
])
def test_a_size_between_runs_is_written_as_it_runs_for_every_kind_of_step(step, world_size,
                                                                         accumulates):
    assert_written_is_run(step, ["--device", "cuda"], world_size, accumulates)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("llama"), "Llama")


def causal(llama, tokens):
    return ["--model", str(llama), "--task", "causal-lm", "--seq-len", str(tokens),
            "--device", "cuda"]


def test_the_fused_loss_chooses_by_size_and_is_not_written(llama):
    """05h cuts a micro-batch's tokens into 8 pieces of ceil(tokens / 8): with texts of 13
    tokens, 8 samples make pieces of 13 tokens, 24 samples of 39, 10 samples of 17, not the 16.25
    of a line. The run says so as it cuts, and the family refuses to be written; drawn
    regardless, the line (whole bytes all the same) would miss."""
    made = runs("05h", causal(llama, 13), (8, 10, 24))
    assert all("fused loss" in " ".join(kept.size_choices) for kept in made.values())
    with pytest.raises(NotBySizes, match="fused loss"):
        Family({8: made[8], 24: made[24]})
    for kept in made.values():  # had the choice gone unsaid:
        kept.size_choices = []
    assert Family({8: made[8], 24: made[24]}).written(10).events != canonical(made[10].events)


def test_the_4bit_matmul_chooses_by_size_and_is_not_written():
    made = runs("07b", ["--device", "cuda"], (2, 3))
    assert all("4-bit" in " ".join(kept.size_choices) for kept in made.values())
    with pytest.raises(NotBySizes, match="4-bit"):
        Family(made)


@pytest.mark.parametrize("step, accumulates, world_size", [("03", False, 1), ("04", True, 1),
                                                           ("05c", True, 1), ("08", True, 2)])
def test_the_search_by_sizes_finds_the_largest_that_fits_each_size_estimated(step, accumulates,
                                                                           world_size, tmp_path):
    """The answer fits and the next size does not, each (estimated, or written from the checked
    line) equal to the whole run's (every block, every micro-batch) to the byte."""
    folder = write_model(tmp_path / "bert", "BERT")
    flags = [*model_flags(folder, "BERT"), "--device", "cuda"]
    at = {size: record_of(kept)["reserved_bytes"]
          for size, kept in runs(step, flags, (2, 200), world_size, accumulates).items()}
    capacity = (at[2] + at[200]) // 2
    question = Question(script_path(step), flags, world_size, accumulates=accumulates)
    found = search(question, capacity)
    assert found.problem is None and found.not_by_sizes is None and found.written
    assert 2 < found.largest < 200
    answered = {size: found.tried.get(size) or figures(record_of(question.line.written(size)))
                for size in (found.largest, next_size(found.largest))}
    assert answered[found.largest][1] <= capacity < answered[next_size(found.largest)][1]
    for size in answered:
        row = question.row(size)
        exact = predict(row.script, row.argv, world_size=world_size, any_batch_size=True,
                        exact=True)
        assert figures(exact) == answered[size]


def figures(record):
    return record["allocated_bytes"], record["reserved_bytes"]


@pytest.mark.parametrize("name", [name for name in ARCHITECTURES if name != "ResNet"])
def test_the_sizes_the_search_answers_with_are_written_as_they_run(name, tmp_path, monkeypatch):
    """The line through two runs is checked by one run, the answer's; the next size up is then
    written, not run, and equals its estimate and the whole run's to the byte (allocated,
    reserved, breakdown), on every architecture."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))  # the known sizes' runs found
    folder = write_model(tmp_path / re.sub(r"\W", "", name.lower()), name)
    flags = [*model_flags(folder, name), "--device", "cuda"]
    question = Question(script_path("04"), flags)
    known = {size: question.estimate(size) for size in (2, 160)}  # far enough apart that the
    assert known[2][1] < known[160][1]  # state's segments do not hide the activations' growth
    capacity = (known[2][1] + known[160][1]) // 2  # the answer between the runs, then
    question = Question(script_path("04"), flags)
    found = search(question, capacity, known)
    assert found.problem is None and found.not_by_sizes is None
    assert found.estimated == 1 and set(question.runs) == {2, 160, found.largest}  # the check
    beyond = next_size(found.largest)
    written = record_of(question.line.written(beyond))
    assert found.tried[found.largest][1] <= capacity < written["reserved_bytes"]
    row = question.row(beyond)
    estimated, exact = record_of(run_for(row)), predict(row.script, row.argv, any_batch_size=True,
                                                        exact=True)
    assert {key: written[key] for key in COMPARED} == {key: estimated[key] for key in COMPARED}
    assert figures(written) == figures(exact)
    assert written["breakdown_bytes"] == exact["breakdown_bytes"]


def test_a_choice_by_the_size_left_undeclared_is_caught_by_the_check_run(tmp_path, monkeypatch):
    """A script that allocates by the square of its micro-batch, and says nothing: its runs at
    two sizes make a line all the same, and the run that checks it, off the line, is not the
    trace written there; every size is then estimated."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    source = script_path("04").read_text()
    line = "        loss.backward()\n"
    planted = tmp_path / "04_planted.py"
    planted.write_text(source.replace(line, line + "        torch.empty(len(micro_labels) ** 2 * "
                                      "4096, device=micro_labels.device)  # by the size, unsaid\n", 1))
    assert planted.read_text() != source and "import torch" in source
    question = Question(planted, ["--device", "cuda"])
    known = {size: question.estimate(size) for size in (2, 40)}
    capacity = (known[2][1] + known[40][1]) // 2
    found = search(Question(planted, ["--device", "cuda"]), capacity, known)
    assert found.not_by_sizes and "not on the line" in found.not_by_sizes
    exact = search_by_estimates(Question(planted, ["--device", "cuda"]), capacity, known)
    assert found.largest == exact.largest and found.tried[found.largest][1] <= capacity


def test_a_search_of_a_size_dependent_run_estimates_every_size(llama):
    flags = causal(llama, 13)
    at = record_of(run_for(Question(script_path("05h"), flags).row(8)))["reserved_bytes"]
    found = search(Question(script_path("05h"), flags), at)
    assert found.not_by_sizes and "fused loss" in found.not_by_sizes and not found.written
    assert found.largest >= 8 and found.tried[found.largest][1] <= at


def test_a_search_whose_asked_run_chose_by_its_size_runs_no_size_to_find_out(llama, monkeypatch):
    """The asked row's run said it chose by its size: no other size is run to draw a line, and
    the sizes the search tries are estimated one by one."""
    flags = causal(llama, 13)
    record = record_of(run_for(Question(script_path("05h"), flags).row(8)))
    known = {8: (record["allocated_bytes"], record["reserved_bytes"])}
    monkeypatch.setattr(Question, "estimate", lambda *_: pytest.fail("a size run for the line"))
    found = search(Question(script_path("05h"), flags), record["reserved_bytes"], known)
    assert found.not_by_sizes and "fused loss" in found.not_by_sizes and not found.written
    assert found.largest >= 8 and found.tried[found.largest][1] <= record["reserved_bytes"]


def test_the_search_stops_when_one_sample_does_not_fit():
    found = search(Question(script_path("03"), ["--device", "cuda"], accumulates=False), 2**20)
    assert found.largest is None and found.problem is None and 1 in found.tried


def test_a_later_question_between_the_sizes_run_is_answered_from_kept_runs_alone(tmp_path,
                                                                                  monkeypatch):
    """Another capacity: the runs of the first question are found again (cache.py keeps the
    sizes run for each search), and an answer between them on the checked line needs none."""
    monkeypatch.setenv("ESTIMATE_CACHE", str(tmp_path / "kept"))
    folder = write_model(tmp_path / "bert", "BERT")
    flags = [*model_flags(folder, "BERT"), "--device", "cuda"]
    at = {size: record_of(kept)["reserved_bytes"]
          for size, kept in runs("04", flags, (2, 400)).items()}
    first = search(Question(script_path("04"), flags), (at[2] + at[400]) // 2)
    assert first.estimated >= 2 and first.not_by_sizes is None
    lower = (at[2] + first.tried[first.largest][1]) // 2  # an answer between the sizes run
    again = search(Question(script_path("04"), flags), lower)
    assert again.estimated == 0 and again.written and 2 <= again.largest < first.largest
    exact = search_by_estimates(Question(script_path("04"), flags), lower)
    assert exact.largest == again.largest
