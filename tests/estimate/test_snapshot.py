"""--estimate --memory-snapshot: the predicted step in PyTorch's snapshot format (read back with
torch's own torch.cuda._memory_viz), its picture, and the refusals of the flag where it has no
snapshot to write."""
import pickle

import pytest
from torch.cuda import _memory_viz

from conftest import QUICK, run_script, script_path
from estimate.predict import predict
from estimate.replay.snapshot import spans
from estimate.replay.trace import PHASES


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """05c on tiny, predicted for an A100 with its snapshot: (record, snapshot, picture path)."""
    path = tmp_path_factory.mktemp("snapshot") / "05c.pickle"
    record = predict(script_path("05c"), ["--preset", "tiny"], snapshot=str(path))
    with open(path, "rb") as file:
        return record, pickle.load(file), path.with_name(path.name + ".png")


def test_the_predicted_snapshot_reads_back_with_torchs_memory_viz(predicted):
    record, snapshot, _ = predicted
    summary = _memory_viz.segsum(snapshot)  # checks that every segment's blocks add up
    assert f"segments: {len(snapshot['segments'])}" in summary
    assert "entries" in _memory_viz.trace(snapshot)
    for page in (_memory_viz.trace_plot(snapshot), _memory_viz.segment_plot(snapshot)):
        assert "MemoryViz.js" in page and "snapshot.pickle" in page


def test_the_snapshot_holds_the_predicted_peaks(predicted):
    """Its segments are what the allocator reserved (never given back: the reserved peak); its
    trace reaches the allocated peak, and every block freed was handed out before."""
    record, snapshot, _ = predicted
    assert sum(segment["total_size"] for segment in snapshot["segments"]) == record["reserved_bytes"]
    live, highest, handed_out = 0, 0, set()
    for entry in snapshot["device_traces"][0]:
        if entry["action"] == "alloc":
            live += entry["size"]
            handed_out.add(entry["addr"])
        elif entry["action"] == "free_completed":
            assert entry["addr"] in handed_out
            live -= entry["size"]
        highest = max(highest, live)
    assert highest == record["allocated_bytes"]
    what = {frame["name"] for entry in snapshot["device_traces"][0] for frame in entry["frames"]}
    assert {"parameters", "gradients", "optimizer state", "activations", "temporaries"} <= what


def test_the_picture_is_a_png_beside_the_snapshot(predicted):
    _, _, picture = predicted
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_parts_of_a_step_come_in_runs():
    assert spans(["forward", "forward", "backward", "optimizer step", "forward"]) == [
        (0, 1, "forward"), (2, 2, "backward"), (3, 3, "optimizer step"), (4, 4, "forward")]
    assert set(PHASES) >= {"forward", "backward", "optimizer step"}


@pytest.mark.parametrize("flags, said", [
    (["--device", "cpu"], "run it on a GPU, or add --estimate"),
    (["--estimate", "--device", "cpu"], "leave --device cpu out"),
])
def test_a_snapshot_where_there_is_none_to_write_stops_with_what_to_do(flags, said, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_script("03", [*QUICK, *flags, "--memory-snapshot", str(tmp_path / "s.pickle")], tmp_path)
    assert said in capsys.readouterr().err


def test_a_snapshot_in_a_missing_folder_stops_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_script("03", ["--estimate", "--memory-snapshot", str(tmp_path / "no" / "s.pickle")],
                   tmp_path)
    assert "no such folder, or not writable" in capsys.readouterr().err


def test_a_snapshot_named_as_a_folder_stops_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_script("03", ["--estimate", "--memory-snapshot", str(tmp_path)], tmp_path)
    assert "is a folder: name the file to write" in capsys.readouterr().err
