"""How the tour starts the sharded steps (07 on), for the GPUs a machine has."""
import pytest

from common.tour import runner


@pytest.mark.parametrize("gpus, nproc, processes, device", [
    (0, None, 2, "cpu"),    # no GPU: two CPU processes show the technique
    (1, None, 2, "cpu"),    # one GPU cannot give two processes a device each
    (2, None, 2, "cuda"),   # one process per GPU
    (8, None, 8, "cuda"),
    (8, 4, 4, "cuda"),      # --nproc caps the processes
    (6, None, 4, "cuda"),   # batches of 64 in 4 micro-batches do not split into 6 processes
    (3, None, 2, "cuda"),
])
def test_sharded_steps_take_one_gpu_per_process_or_the_cpu(gpus, nproc, processes, device):
    launch = runner.sharded_launch(gpus, nproc)
    assert (launch.processes, launch.device) == (processes, device)
    assert f"{gpus} GPU" in launch.reason  # the table says why


def test_device_cpu_keeps_the_sharded_steps_on_the_cpu_even_with_gpus():
    launch = runner.sharded_launch(8, None, device="cpu")
    assert (launch.processes, launch.device) == (2, "cpu") and "--device cpu" in launch.reason


def test_device_cuda_with_one_gpu_is_refused_with_a_message():
    with pytest.raises(ValueError, match="need at least 2"):
        runner.sharded_launch(1, None, device="cuda")


def test_the_launch_goes_into_the_sharded_steps_commands(tmp_path):
    script = tmp_path / "07_fsdp.py"
    launch = runner.Launch(processes=4, device="cuda", reason="4 GPUs")
    step = runner.script_step(script, tmp_path, ["--max-steps", "2"], launch)
    assert "--nproc_per_node=4" in step.command
    assert step.command[-2:] == ["--device", "cuda"]
    single = runner.script_step(tmp_path / "03_bf16.py", tmp_path, ["--max-steps", "2"], launch)
    assert "--device" not in single.command and "torch.distributed.run" not in single.command
