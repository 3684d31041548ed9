"""--gpu-memory: the search for the largest batch (or micro-batch) that fits, on fake tensors."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, script_path
from estimate.command import parse_size
from estimate.predict import Row, attempt, predict
from estimate.question import Question
from estimate.search.fit import Fit, accumulation_for, search, search_by_estimates

SMALL_BERT = dict(model_type="bert", vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    (folder / "config.json").write_text(json.dumps(SMALL_BERT))
    return str(folder)


@pytest.mark.parametrize("text, nbytes", [("24GB", 24 * 10**9), ("24GiB", 24 * 2**30),
                                          ("24G", 24 * 2**30), ("80 gb", 80 * 10**9),
                                          ("1.5GB", 1_500_000_000), ("16000MB", 16 * 10**9)])
def test_sizes_read_as_written(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["lots", "24 GBs", "-3GB", "0GB", ""])
def test_a_size_that_cannot_be_read_is_refused_with_examples(text):
    with pytest.raises(ValueError, match="24GB, 24GiB"):
        parse_size(text)


def test_an_unreadable_gpu_memory_gets_a_message():
    done = subprocess.run([sys.executable, "-m", "estimate", "--gpu-memory", "big"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--gpu-memory 'big'" in done.stderr and "24GB" in done.stderr


def predicted(script, argv, exact=False):
    record = predict(script_path(script), ["--device", "cuda", *argv], exact=exact)
    return record["allocated_bytes"], record["reserved_bytes"]


def reserved(script, argv):
    return predicted(script, argv)[1]


def test_micro_batches_peak_alike_however_many_there_are(bert):
    """Why the search runs two micro-batches of a size to answer for any number of them."""
    flags = ["--model", bert]
    sixteen = predicted("04", [*flags, "--batch-size", "32", "--accum-steps", "16"], exact=True)
    assert sixteen == predicted("04", [*flags, "--batch-size", "4", "--accum-steps", "2"])
    larger = predicted("04", [*flags, "--batch-size", "16", "--accum-steps", "2"])
    assert sixteen[0] < larger[0]  # the micro-batch, not the batch, sets the peak


@pytest.mark.parametrize("script, accumulates", [("03", False), ("04", True)])
def test_the_search_finds_a_size_that_fits_and_one_more_that_does_not(script, accumulates, bert):
    base = ["--model", bert, "--device", "cuda", "--seq-len", "256"]  # activations matter
    one, four = (reserved(script, [*base, "--batch-size", str(2 * size if accumulates else size),
                                   *(["--accum-steps", "2"] if accumulates else [])])
                 for size in (1, 4))
    capacity = (one + four) // 2  # somewhere between one sample and four
    found = search(Question(script_path(script), base, accumulates=accumulates), capacity)
    assert len(found.tried) <= 6  # the line through allocated bytes lands near the answer
    assert found.problem is None and found.largest >= 1 and not found.capped
    largest, more = (found.largest, found.largest + (1 if found.largest < 32 else 8))
    as_run = (lambda size: ["--batch-size", str(2 * size), "--accum-steps", "2"]) if accumulates \
        else (lambda size: ["--batch-size", str(size)])
    assert reserved(script, [*base, *as_run(largest)]) <= capacity
    assert reserved(script, [*base, *as_run(more)]) > capacity


def test_nothing_fits_when_one_sample_does_not(bert):
    found = search(Question(script_path("03"), ["--model", bert, "--device", "cuda"], accumulates=False),
                   2**20)
    assert found.largest is None and found.problem is None


def test_the_asked_batch_is_split_into_the_fewest_micro_batches_that_fit():
    fit = Fit("04_grad_accum", True, batch_size=64, world_size=4, largest=5)
    assert accumulation_for(fit) == 4  # 16 per GPU: micro-batches of 4 (8 would not fit)
    assert accumulation_for(Fit("04", True, batch_size=64, world_size=4, largest=16)) == 1


def test_a_model_that_fails_on_fake_tensors_is_named_with_what_failed(bert, monkeypatch):
    from transformers import BertModel

    def needs_values(self, input_ids=None, **kwargs):
        if input_ids.sum() > 0:  # a Python branch on a value: fake tensors have none
            pass
    monkeypatch.setattr(BertModel, "forward", needs_values)
    record, problem, _ = attempt(Row(script_path("03"), ["--model", bert, "--device", "cuda"]))
    assert record is None
    assert f"--model {bert}" in problem and "fake tensors" in problem


@pytest.mark.parametrize("cap, fits_up_to, largest, estimates", [
    (8, 10**6, 8, {1, 8}),     # the asked batch fits whole: one estimate after the first
    (8, 5, 5, None),           # it does not: the largest that does, below it
    (36, 10**6, 36, {1, 36}),  # a batch off the granule of 8 above 32 is an answer too
])
def test_a_search_for_an_asked_batch_stops_at_it(cap, fits_up_to, largest, estimates, monkeypatch):
    """The stack's searches: a line of allocated bytes (100 + 10 a sample), capped at the batch."""
    def line(row, learned=None):
        micro = int(row.argv[row.argv.index("--batch-size") + 1]) // 2  # two micro-batches
        return {"allocated_bytes": 100 + 10 * micro, "reserved_bytes": 100 + 10 * micro}, None, 0.0
    monkeypatch.setattr("estimate.question.attempt", line)
    found = search_by_estimates(Question(script_path("04"), []), 100 + 10 * fits_up_to, cap=cap)
    assert (found.largest, found.capped) == (largest, largest == cap)
    assert max(found.tried) <= cap and found.problem is None
    if estimates:
        assert set(found.tried) == estimates
    else:
        assert largest + 1 in found.tried  # the next size was estimated, and does not fit


def killed(item):
    """A worker's estimate that the system kills (as the out-of-memory killer would)."""
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_stops_the_work_with_what_to_do():
    from estimate.output import in_order
    with pytest.raises(SystemExit, match="a worker process died .* after 0 of 2 estimates.*--jobs 1"):
        list(in_order(killed, [1, 2], 2, lambda: "after 0 of 2 estimates"))


PRINTING_AT_ONCE = """import os, sys, time
from estimate.output import print_whole, worker_pool

def say(name, until):  # lines until the parent is done, the first before it starts
    number = 0
    while number == 0 or not os.path.exists(until) and number < 200_000:
        print(f"{name} line {number} of words", flush=True)
        number += 1
        if number == 1:
            open(f"{until}.{name}", "w").close()
    return number

if __name__ == "__main__":
    until = sys.argv[1]
    with worker_pool(2, lambda: "") as pool:
        futures = [pool.submit(say, name, until) for name in ("first", "second")]
        for _ in range(3000):  # (30 s at most)
            if all(os.path.exists(f"{until}.{name}") for name in ("first", "second")):
                break
            time.sleep(0.01)
        for number in range(2000):  # and among the parent's lines, an answer of two lines
            print(f"parent line {number} of words", flush=True)  # as estimate/command.py prints it
            print_whole(f"answer {number}\\n  and its command")
        open(until, "w").close()
        counts = [future.result() for future in futures]
    print("after the workers", *counts, flush=True)
    print("words", end="", flush=True)
    print(" and their newline")
    print("unbuffered again:", sys.stdout.write_through)
"""


def test_lines_printed_at_once_by_the_workers_and_the_parent_stay_whole(tmp_path):
    """Unbuffered (PYTHONUNBUFFERED=1, as Docker images and the tour set it), print() writes
    its words and its newline apart: two processes printing at once glued each other's lines
    ("...(2.9 s)The stack: ..."), once every few asks; here, with two workers printing all the
    while the parent prints 2,000 lines and 2,000 answers of two lines, thousands of times.
    Inside the pool every line is written whole, the answer's too."""
    program = tmp_path / "printing_at_once.py"
    program.write_text(PRINTING_AT_ONCE)
    done = subprocess.run([sys.executable, str(program), str(tmp_path / "done")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    *printed, after, joined, unbuffered = lines
    first, second = (int(count) for count in after.split()[-2:])
    assert after.startswith("after the workers") and first > 0 and second > 0
    assert sorted(printed) == sorted([*(f"{name} line {number} of words"
                                        for name, count in (("first", first), ("second", second),
                                                            ("parent", 2000))
                                        for number in range(count)),
                                      *(f"answer {number}" for number in range(2000)),
                                      *["  and its command"] * 2000])
    assert [joined, unbuffered] == ["words and their newline", "unbuffered again: True"]


FREEZING = """import gc
import weakref
from estimate.collector import frozen
from estimate.output import worker_pool

def left_frozen():  # in a worker: what the pool's block froze, and its runs' blocks inside it
    before = gc.get_freeze_count()
    with frozen():
        pass
    return before > 0 and gc.get_freeze_count() >= before

def is_frozen(thing):  # (the collector's generations list all it tracks but the frozen)
    return not any(each is thing for each in gc.get_objects())

class Node:
    pass

cycle = Node()
cycle.itself = cycle  # garbage the outermost block frees before it freezes
cycle = weakref.ref(cycle)
before = []
with frozen():
    with frozen():
        pass
    print(cycle() is None, is_frozen(before), gc.get_freeze_count() > 0)
print(is_frozen(before), gc.get_freeze_count())
with worker_pool(2, lambda: "") as pool:
    print(pool.submit(left_frozen).result(), gc.get_freeze_count() > 0)
print(gc.get_freeze_count())
"""


def test_frozen_blocks_nest_and_only_the_outermost_thaws(tmp_path):
    """estimate/collector.py counts its blocks instead of asking gc.get_freeze_count() (a walk of
    every frozen object): an inner block (a fake run inside the workers' pool, a test's run inside
    its module's block) must leave what the outer one froze frozen, and the outermost thaw all."""
    program = tmp_path / "freezing.py"
    program.write_text(FREEZING)
    done = subprocess.run([sys.executable, str(program)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True", "False", "0", "True", "True", "0"]


def two_phase(micro):
    """A made-up step whose peak is the larger of two lines (the optimizer's step, flat, and
    backward, steep), with a reserve rounded up to 2 MB segments: what real peaks look like."""
    allocated = max(5_000_000 + 10_000 * micro, 1_000_000 + 700_000 * micro)
    return allocated, -(-allocated // 2_000_000) * 2_000_000


@pytest.mark.parametrize("capacity", [3_000_000, 9_000_000, 10_000_000, 23_000_000, 23_100_000,
                                      60_000_000, 2_000_000_000])
@pytest.mark.parametrize("hint", [None, 700_000, 200_000, 3_000_000])
def test_the_search_finds_the_largest_that_fits_from_any_first_guess(capacity, hint, monkeypatch):
    """Whatever the first guess (bytes_per_sample's, right or wrong, or none: one sample), the
    answer is the largest size on the grid whose reserve fits, and the next does not."""
    def step(row, learned=None):
        allocated, reserved = two_phase(int(row.argv[row.argv.index("--batch-size") + 1]) // 2)
        return {"allocated_bytes": allocated, "reserved_bytes": reserved}, None, 0.0
    monkeypatch.setattr("estimate.question.attempt", step)
    found = search_by_estimates(Question(script_path("04"), []), capacity, {8: two_phase(8)},
                                per_sample=hint)
    grid = [size for size in range(1, 5000) if size < 32 or size % 8 == 0]
    fitting = [size for size in grid if two_phase(size)[1] <= capacity]
    assert found.problem is None
    assert found.largest == (max(fitting) if fitting else None)
    assert len(found.tried) <= (4 if hint == 700_000 else 8)  # the right slope: a line and its checks


@pytest.mark.parametrize("hint, most", [(None, 4), (700_000, 3)])
def test_a_good_first_guess_saves_an_estimate(hint, most, monkeypatch):
    """The known point and a guess near the answer: the line through them lands on it, and one
    confirmation settles it (one sample as the second point takes one estimate more)."""
    def line(row, learned=None):
        micro = int(row.argv[row.argv.index("--batch-size") + 1]) // 2
        return {"allocated_bytes": 1_000_000 + 700_000 * micro,
                "reserved_bytes": 1_000_000 + 700_000 * micro}, None, 0.0
    monkeypatch.setattr("estimate.question.attempt", line)
    capacity = 1_000_000 + 700_000 * 20 + 1
    known = {8: (1_000_000 + 700_000 * 8,) * 2}
    found = search_by_estimates(Question(script_path("04"), []), capacity, known, per_sample=hint)
    assert found.largest == 20 and len(found.tried) == most

