"""tests/support/fsdp_probe.py, keeping the gradients of the first optimizer step rather than of
the first one after the memory meter's: for comparing one step of two runs, where the copy may
fall inside the measured steps.

  python -m torch.distributed.run --standalone --nproc_per_node=2 \\
      tests/support/first_step_probe.py OUT_DIR 08a --max-steps 1 ...
"""
import fsdp_probe

if __name__ == "__main__":
    fsdp_probe.TRACKED_STEPS = 0  # the probe copies the gradients of step TRACKED_STEPS + 1
    fsdp_probe.main()
