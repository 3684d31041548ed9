"""How the tour starts the sharded steps (07 on), for the GPUs a machine has."""
import pytest

from tour import runner


@pytest.mark.parametrize("gpus, nproc, preset, split, processes, device", [
    (0, None, "tiny", (64, 4), 2, "cpu"),     # no GPU: two CPU processes show the technique
    (1, None, "tiny", (64, 4), 2, "cpu"),     # one GPU cannot give two processes a device each
    (1, None, "article", (64, 4), 1, "cuda"),  # ViT-L on the CPU would train until the time-out
    (1, None, "imdb", (16, 4), 1, "cuda"),
    (0, None, "imdb", (16, 4), 2, "cpu"),     # no GPU at all: the CPU (the scripts will say why)
    (2, None, "tiny", (64, 4), 2, "cuda"),    # one process per GPU
    (8, None, "tiny", (64, 4), 8, "cuda"),
    (8, 4, "tiny", (64, 4), 4, "cuda"),       # --nproc caps the processes
    (6, None, "tiny", (64, 4), 4, "cuda"),    # 16 micro-batches do not split into 6 processes
    (3, None, "tiny", (64, 4), 2, "cuda"),
    (8, None, "imdb", (16, 4), 4, "cuda"),    # 16 in 4 micro-batches per process: at most 4
    (2, 3, "tiny", (64, 4), 2, "cuda"),
    (0, 4, "tiny", (64, 4), 4, "cpu"),
    (0, 3, "tiny", (64, 4), 2, "cpu"),        # --nproc 3 on the CPU: 64 does not split in 12
])
def test_sharded_steps_take_one_gpu_per_process_as_the_batch_splits(gpus, nproc, preset, split,
                                                                    processes, device):
    launch = runner.sharded_launch(gpus, nproc, "auto", preset, split)
    assert (launch.processes, launch.device) == (processes, device)
    assert f"{gpus} GPU" in launch.reason  # the table says why
    batch_size, accum_steps = split
    assert batch_size % (processes * accum_steps) == 0  # check_batch_split lets every one run
    if nproc and processes < min(nproc, gpus or nproc):
        assert "splits evenly over at most" in launch.reason


def test_device_cpu_keeps_the_sharded_steps_on_the_cpu_even_with_gpus():
    launch = runner.sharded_launch(8, None, device="cpu")
    assert (launch.processes, launch.device) == (2, "cpu") and "--device cpu" in launch.reason


def test_device_cuda_with_one_gpu_runs_one_process_on_it():
    launch = runner.sharded_launch(1, None, device="cuda")
    assert (launch.processes, launch.device) == (1, "cuda") and "group of one" in launch.reason


def test_device_cuda_without_a_gpu_is_refused_with_a_message():
    with pytest.raises(ValueError, match="no GPU visible"):
        runner.sharded_launch(0, None, device="cuda")


@pytest.mark.parametrize("preset, gpus, processes", [("imdb", 8, 4), ("article", 1, 1),
                                                     ("tiny", 1, 2)])
def test_the_tour_takes_the_split_from_its_preset_and_the_sharded_scripts(
        preset, gpus, processes, monkeypatch):
    """The tour reads the preset's batch and 07's micro-batches itself (faked GPU counts)."""
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = runner.parse_args(["--preset", preset, "--steps", "07"])
    assert args.launch.processes == processes


def test_the_launch_goes_into_the_sharded_steps_commands(tmp_path):
    script = tmp_path / "07_fsdp.py"
    launch = runner.Launch(processes=4, device="cuda", reason="4 GPUs")
    command = runner.script_command(script, tmp_path, ["--max-steps", "2"], launch)
    assert "--nproc_per_node=4" in command.argv
    assert command.argv[-2:] == ["--device", "cuda"]
    single = runner.script_command(tmp_path / "03_bf16.py", tmp_path, ["--max-steps", "2"], launch)
    assert "--device" not in single.argv and "torch.distributed.run" not in single.argv


def test_on_a_gpu_each_run_checks_its_estimate_but_cpu_processes(tmp_path, monkeypatch):
    """One GPU, tiny: the single-device scripts run on it with --check-estimate; 07-09 run as two
    CPU processes, where there is no GPU figure to check, without it."""
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = runner.parse_args(["--steps", "03", "07"])
    assert "--check-estimate" in args.passed_flags and args.launch.device == "cpu"
    single = runner.script_command(tmp_path / "03_bf16.py", tmp_path, args.passed_flags, args.launch)
    sharded = runner.script_command(tmp_path / "07_fsdp.py", tmp_path, args.passed_flags, args.launch)
    assert "--check-estimate" in single.argv and "--check-estimate" not in sharded.argv
    assert "--check-estimate" not in runner.parse_args(["--device", "cpu"]).passed_flags
