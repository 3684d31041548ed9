"""--check-estimate: a GPU run's prediction, made beside it in a subprocess. What a CPU can check:
the flags handed to the estimate, the fields it records from the estimate's own record, and the
refusals; the GPU's side is tests/test_cuda.py's."""
from pathlib import Path

import pytest
import torch

from conftest import QUICK, load_script, run_script, script_path
from estimate.check import EstimateCheck, check_estimate, estimate_argv
from estimate.predict import predict


def test_the_estimate_takes_the_runs_flags_but_its_device_results_and_snapshot():
    argv = ["--preset", "tiny", "--device", "cuda", "--check-estimate", "--results-dir=out",
            "--memory-snapshot", "s.pickle", "--batch-size", "8", "--compile"]
    assert estimate_argv(argv) == ["--preset", "tiny", "--batch-size", "8", "--compile"]


def test_the_record_holds_the_estimate_of_the_same_run_and_the_ratio(monkeypatch):
    """An A100 (8.0) is estimated as itself: the fields are the estimate's own figures."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    check = EstimateCheck(script_path("03"), ["--preset", "tiny", "--device", "cuda",
                                              "--check-estimate"], torch.device("cuda"), 1)
    expected = predict(script_path("03"), ["--preset", "tiny"], gpu="a100")
    measured = {"cuda_steps_max_allocated_bytes": expected["allocated_bytes"] * 11 // 10,
                "cuda_steps_max_reserved_bytes": expected["reserved_bytes"]}
    fields = check.result(measured)
    assert fields["predicted_allocated_bytes"] == expected["allocated_bytes"]
    assert fields["predicted_reserved_bytes"] == expected["reserved_bytes"]
    assert fields["measured_over_predicted_allocated"] == pytest.approx(1.1, abs=1e-4)
    assert fields["measured_over_predicted_reserved"] == 1.0
    assert fields["predicted_gpu"].startswith("A100 emulated, for the NVIDIA A100-SXM4-80GB")


def test_an_estimate_that_fails_is_said_and_the_run_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    check = EstimateCheck(script_path("03"), ["--preset", "tiny", "--batch-size", "0"],
                          torch.device("cuda"), 1)
    assert "--batch-size" in check.result({})["estimate_problem"]


@pytest.mark.parametrize("flags, said", [
    ([], "run it on a GPU, or leave --check-estimate out"),
    (["--estimate"], "leave one of them out"),
])
def test_check_estimate_where_there_is_nothing_to_check_stops_with_what_to_do(flags, said, tmp_path,
                                                                              capsys):
    with pytest.raises(SystemExit):
        run_script("03", [*QUICK, *flags, "--check-estimate"], tmp_path)
    assert said in capsys.readouterr().err


def test_under_torchrun_the_estimate_is_told_the_world_size_and_nothing_of_the_launcher(monkeypatch):
    """10 shards when WORLD_SIZE is set, 07-09 read it: the estimate gets it, and not the
    launcher's rendezvous (it joins no group); abbreviated flags of the run are dropped too."""
    import estimate.check
    started = {}

    class Started:
        def __init__(self, command, env, **kwargs):
            started.update(command=command, env=env)

        def poll(self):
            return 0

    monkeypatch.setattr(estimate.check.subprocess, "Popen", Started)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    check_estimate(script_path("10"), ["--offload", "--memory-snap", "s.pickle"],
                   torch.device("cuda")).stop()
    assert started["env"]["WORLD_SIZE"] == "4"
    assert "RANK" not in started["env"] and "MASTER_PORT" not in started["env"]
    assert started["command"][2:] == ["--offload", "--estimate", "--gpu", "a100", "--results-dir",
                                      started["command"][-1]]
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1: 10 shards, a group of one
    check_estimate(script_path("10"), [], torch.device("cuda")).stop()
    assert started["env"]["WORLD_SIZE"] == "1"
    monkeypatch.setenv("RANK", "1")  # the other processes start none
    assert check_estimate(script_path("10"), [], torch.device("cuda")) is None


@pytest.mark.parametrize("step", ["01", "07", "10"])
def test_the_scripts_main_starts_the_check_after_its_flags(step, monkeypatch, tmp_path):
    """main() starts it, as it starts --estimate (nothing in common/ imports estimate/); here on
    the CPU, with the flag's GPU check and the subprocess stood aside."""
    import common.cli
    import estimate.check
    started = []
    monkeypatch.setattr(common.cli, "check_estimate_flag", lambda parser, args: None)
    monkeypatch.setattr(estimate.check, "check_estimate",
                        lambda script, argv, device: started.append(script))
    run_script(step, [*QUICK, "--check-estimate"], tmp_path)
    assert [Path(script).name for script in started] == [script_path(step).name]


def test_the_combined_scripts_memory_budget_is_refused_beside_the_check(monkeypatch):
    """--checkpointing budget:F compiles (as --compile, which the flag's own check refuses): its
    estimate is a range, so nothing would be checked."""
    import common.cli
    monkeypatch.setattr(common.cli, "check_estimate_flag", lambda parser, args: None)
    combined = load_script("10")
    args = combined.parse_args("", ["--check-estimate", "--checkpointing", "budget:0.5"],
                               flags=combined.own_flags)
    assert "--check-estimate with --checkpointing budget:F" in combined.refusal(args)
    args = combined.parse_args("", ["--check-estimate", "--checkpointing", "full"],
                               flags=combined.own_flags)
    assert combined.refusal(args) is None
