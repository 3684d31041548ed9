"""04c GaLore's claims: its step is the authors' (galore-torch, on the package index) given the same
weights, gradients and projection, on either side of a weight, in both its forms; its moments are
the projections' size; its first step, which makes the projections with every state held, holds
what any later projection's does, so the tracked steps reach a run's peak; bad input stops in one
line; 10's --optimizer galore|galore-8bit trains as the script."""
import math

import pytest
import torch

from conftest import QUICK, TEXT, assert_follows, load_script, run_script, script_path, unevaluated
from support.architecture_matrix import model_flags, write_model
from support.rounding import assert_same_sum

galore_torch = pytest.importorskip("galore_torch")  # requirements-dev.txt pins it

# a narrower side of rows (left: R = P^T G) or of columns (right: R = G P^T); a rank below both
# sides; projections of 32 x 160, at least bitsandbytes' 4,096 numbers, so the 8-bit form quantizes
SHAPES = {"left": (64, 160), "right": (160, 64)}
RANK, SCALE, LR, EPS = 32, 0.25, 1e-2, 1e-6
GAP, TAKEN = 2, 3  # projections made at steps 1 and 3, the moments of steps 1-2 kept across the second


@pytest.fixture
def same_singular_vectors(monkeypatch):
    """torch.linalg.svd computed once per input: both optimizers project with the same vectors
    (an SVD's vectors are no sum whose rounding a bound follows)."""
    svd, made = torch.linalg.svd, {}

    def once(matrix, full_matrices=True, **options):
        key = (tuple(matrix.shape), matrix.detach().numpy().tobytes(), full_matrices)
        if key not in made:
            made[key] = svd(matrix, full_matrices=full_matrices, **options)
        return made[key]
    monkeypatch.setattr(torch.linalg, "svd", once)


def pair(shape, generator):
    """A weight drawn at random, as two parameters of equal values: ours and the authors'."""
    values = torch.randn(shape, generator=generator)
    return torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())


def projected_magnitude(projector, low, left):
    """|P| |L| (or |L| |P|): the sizes of the terms the product of P and L adds up."""
    return projector.abs() @ low.abs() if left else low.abs() @ projector.abs()


@pytest.mark.numerical
@pytest.mark.parametrize("side", SHAPES)
def test_the_step_is_the_authors_given_the_same_projection(side, same_singular_vectors):
    """Three steps of GaLoreAdam and galore-torch's GaLoreAdamW (weight decay 0) on one projected
    weight and one weight stepped as Adam, from the same values and gradients: equal within what
    rounding of the projection's sums can produce. R = P^T G adds `inner` terms, whose rounding
    reaches the normalised step through both moments; the step back adds RANK; then the weight's
    own addition. Each step's bound adds to the earlier ones'. Step 3 makes a new projection with
    the moments kept: reset moments would fail it."""
    module = load_script("04c")
    generator = torch.Generator().manual_seed(0)
    (ours, theirs), (our_bias, their_bias) = (pair(shape, generator)
                                             for shape in (SHAPES[side], SHAPES[side][:1]))
    mine = module.GaLoreAdam([dict(params=[ours], rank=RANK), dict(params=[our_bias])], lr=LR,
                             gap=GAP, scale=SCALE, eps=EPS)
    authors = galore_torch.GaLoreAdamW(
        [dict(params=[theirs], rank=RANK, update_proj_gap=GAP, scale=SCALE, proj_type="std"),
         dict(params=[their_bias])], lr=LR, eps=EPS, weight_decay=0.0, no_deprecation_warning=True)
    left, inner = side == "left", min(SHAPES[side])
    (beta1, beta2), moment, bias_moment = mine.defaults["betas"], 0.0, 0.0
    magnitude, bias_magnitude = torch.zeros(SHAPES[side]), torch.zeros(SHAPES[side][:1])
    for step in range(1, TAKEN + 1):
        give_same_gradients(((ours, theirs), (our_bias, their_bias)), generator)
        mine.step()
        authors.step()
        state, step_size = mine.state[ours], LR * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        projector = state["projector"]
        moment = beta1 * moment + (1 - beta1) * projected_magnitude(projector.T, ours.grad, left)
        low = moment / (state["exp_avg_sq"].sqrt() + EPS)
        magnitude += SCALE * step_size * projected_magnitude(projector, low, left) + ours.detach().abs()
        assert_same_sum(ours.detach(), theirs.detach(), magnitude, 2 * inner + RANK + 2,
                        what=f"{side} projection, step {step}")
        bias_state = mine.state[our_bias]
        bias_moment = beta1 * bias_moment + (1 - beta1) * our_bias.grad.abs()
        bias_magnitude += step_size * bias_moment / (bias_state["exp_avg_sq"].sqrt() + EPS) \
            + our_bias.detach().abs()
        assert_same_sum(our_bias.detach(), their_bias.detach(), bias_magnitude, 2, what=f"Adam, step {step}")
    assert state["step"] == TAKEN


def give_same_gradients(pairs, generator):
    """Both weights of each pair (ours, the reference's) the same random gradient."""
    for weights in pairs:
        gradient = torch.randn(weights[0].shape, generator=generator)
        for weight in weights:
            weight.grad = gradient.clone()


@pytest.mark.numerical
@pytest.mark.parametrize("side", SHAPES)
def test_the_8bit_step_is_the_authors_8bit_step(side, monkeypatch):
    """--galore-8bit against galore-torch's GaLoreAdamW8bit, given the same projection (its own
    made by our `projection`, so that both compute R by one product of the same tensors): the
    same 8-bit codes and scales byte for byte, the same step on R, and weights within the rounding
    of the step back and the weight's addition. A weight of 4,096 numbers or more stepped as Adam
    is bitsandbytes' 8-bit Adam on both sides: equal. (The reference waits for a GPU after each
    weight, which a CPU build has not: made a no-op.)"""
    import bitsandbytes.functional
    from galore_torch.galore_projector import GaLoreProjector
    module = load_script("04c")
    monkeypatch.setattr(GaLoreProjector, "get_orthogonal_matrix", lambda self, gradient, rank, type:
                        module.projection(gradient, rank, type == "left"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    kernel, stepped = bitsandbytes.functional.optimizer_update_8bit_blockwise, []

    def noted(name, gradient, target, *args, **kwargs):  # the step on R, as each side makes it
        kernel(name, gradient, target, *args, **kwargs)
        stepped.append(target.detach().clone())
    monkeypatch.setattr(bitsandbytes.functional, "optimizer_update_8bit_blockwise", noted)
    generator = torch.Generator().manual_seed(0)
    (ours, theirs), (our_plain, their_plain) = (pair(shape, generator) for shape in (SHAPES[side],) * 2)
    mine = module.GaLoreAdam([dict(params=[ours], rank=RANK), dict(params=[our_plain])], lr=LR,
                             gap=GAP, scale=SCALE, eight_bit=True, eps=EPS)
    authors = galore_torch.GaLoreAdamW8bit(
        [dict(params=[theirs], rank=RANK, update_proj_gap=GAP, scale=SCALE, proj_type="std"),
         dict(params=[their_plain])], lr=LR, eps=EPS, weight_decay=0.0)
    magnitude = torch.zeros(SHAPES[side])
    for step in range(1, TAKEN + 1):
        give_same_gradients(((ours, theirs), (our_plain, their_plain)), generator)
        stepped.clear()
        mine.step()
        authors.step()
        (our_low, _), (their_low, _) = stepped[:2], stepped[2:]  # each side: R's step, the plain one's
        assert torch.equal(our_low, their_low), f"{side}, step {step}: the step on R"
        for name in ("state1", "state2", "absmax1", "absmax2"):
            assert torch.equal(mine.state[ours][name], authors.state[theirs][name]), (side, step, name)
        magnitude += SCALE * projected_magnitude(mine.state[ours]["projector"], our_low, side == "left") \
            + ours.detach().abs()
        assert_same_sum(ours.detach(), theirs.detach(), magnitude, RANK + 1, what=f"{side}, step {step}")
        assert torch.equal(our_plain, their_plain), f"Adam's 8-bit step, step {step}"


def state_bytes(optimizers, *names):
    return sum(optimizer.state[weight][name].nbytes for optimizer in optimizers
               for weight in optimizer.state for name in names if name in optimizer.state[weight])


@pytest.mark.parametrize("eight_bit", [False, True], ids=["16-bit", "8-bit"])
def test_the_moments_are_the_projections_size_and_the_rest_adams(eight_bit, runs):
    """Each projected weight's moments are R's size (a quarter of its narrower side by default,
    times its wider side), its projector that rank times the narrower side; the other weights
    keep Adam's two moments of their own size. 8-bit: a byte a number and a float32 scale per
    256, where the moments hold 4,096 numbers or more; fewer stay in the weights' dtype."""
    _, meter = runs("04c", [*QUICK, *(["--galore-8bit"] if eight_bit else [])])
    model, optimizers = meter.model, meter.optimizer
    projected = {weight: rank for optimizer in optimizers for group in optimizer.param_groups
                 for weight in group["params"] for rank in [group["rank"]] if rank}
    blocks = [weight for block in load_script("04c").transformer_blocks(model)
              for weight in block.parameters() if weight.ndim == 2]
    assert set(projected) == set(blocks) and len(projected) == 24  # 4 blocks of 6 matrices
    assert all(rank == min(weight.shape) // 4 for weight, rank in projected.items())
    moments = {weight: rank * max(weight.shape) for weight, rank in projected.items()}
    moments.update({weight: weight.numel() for weight in model.parameters() if weight not in projected})
    expected = 0
    for weight, numbers in moments.items():
        if eight_bit and numbers >= 4096:
            expected += 2 * (numbers + 4 * -(-numbers // 256) + 4 * 256)  # codes, scales, a map
        else:
            expected += 2 * numbers * weight.element_size()
    names = ("exp_avg", "exp_avg_sq", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")
    assert state_bytes(optimizers, *names) == expected
    projectors = sum(rank * min(weight.shape) * weight.element_size() for weight, rank in projected.items())
    assert state_bytes(optimizers, "projector") == projectors
    parameters = sum(weight.numel() for weight in model.parameters())
    adam = 4 * parameters  # 04a's two bfloat16 moments a parameter
    assert expected + projectors < (0.3 if eight_bit else 0.4) * adam


def test_the_breakdown_prints_the_states_bytes_per_parameter(tmp_path, capsys):
    """The run prints its model state per parameter: the weights', gradients' and optimizer
    state's bytes at the peak over the parameters. That optimizer state holds every state 04c
    keeps (moments, 8-bit codes and scales, projectors: all made with the optimizer) and what a
    step holds while it runs, which MemTracker counts as the optimizer's: at most one SVD's
    float32 tensors for the widest matrix (its input, a column-major copy of it, U, S and Vh)."""
    from common.breakdown import MODEL_STATE_KEYS
    record, meter = run_script("04c", [*QUICK, "--galore-8bit"], tmp_path, unevaluated("04c"))
    printed = capsys.readouterr().out
    names = ("exp_avg", "exp_avg_sq", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2",
             "projector")
    kept = state_bytes(meter.optimizer, *names)
    rows, columns = max((weight.shape for optimizer in meter.optimizer for group in optimizer.param_groups
                         if group["rank"] for weight in group["params"]), key=math.prod)
    side = min(rows, columns)
    svd = 4 * (2 * rows * columns + rows * side + side + side * columns)
    breakdown = record["breakdown_bytes"]
    assert kept <= breakdown["optimizer_state"] <= kept + svd
    per_parameter = record["model_state_bytes_per_parameter"]
    assert per_parameter == sum(breakdown[key] for key in MODEL_STATE_KEYS) / record["parameter_count"]
    assert (f"model state (parameters, gradients, optimizer state): {per_parameter:.2f} bytes per "
            "parameter") in printed
    assert f"optimizer state {breakdown['optimizer_state'] / 2**20:,.2f} MiB" in printed


def test_the_estimate_with_a_projection_on_each_tracked_step_is_the_runs_peak(tmp_path):
    """--galore-gap 1: each tracked step makes every projection anew (step 2's after a step of
    the moments); the tiny preset's estimate on the CPU equals that run to the byte."""
    from estimate.predict import predict
    flags = ["--galore-gap", "1"]
    real, _ = run_script("04c", [*QUICK, *flags], tmp_path, unevaluated("04c"))
    predicted = predict(script_path("04c"), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]
    assert predicted["model_state_bytes_per_parameter"] == real["model_state_bytes_per_parameter"]


def test_the_first_step_holds_what_every_projection_step_holds(runs, tmp_path):
    """The states are made with the optimizer, so the first step, which makes every projection,
    holds each weight's moments already, as step T+1 does: with a projection at both tracked steps
    (--galore-gap 1) the tracked peak and what fills it are those of the default gap's run, where
    only the first step makes them, but for the first step's loss, which the run keeps for its
    record (as every script keeps each step's: 4 bytes a step). The estimate tracks the same steps."""
    default, _ = runs("04c", QUICK)
    every_step, _ = run_script("04c", [*QUICK, "--galore-gap", "1"], tmp_path)
    kept = torch.zeros((), dtype=torch.float32).nbytes  # step 1's loss
    assert every_step["peak_memory_bytes"] == default["peak_memory_bytes"] + kept
    assert every_step["breakdown_bytes"] == {**default["breakdown_bytes"],
                                             "activations": default["breakdown_bytes"]["activations"] + kept}


def test_a_projection_is_made_every_gap_steps(monkeypatch, tmp_path):
    """One SVD per projected weight at steps 1 and 3 of three with --galore-gap 2; none for the
    weights stepped as Adam."""
    svd, calls = torch.linalg.svd, []
    monkeypatch.setattr(torch.linalg, "svd", lambda matrix, **options: (calls.append(matrix.shape),
                                                                        svd(matrix, **options))[1])
    _, meter = run_script("04c", ["--epochs", "1", "--max-steps", "3", "--galore-gap", "2"], tmp_path,
                          unevaluated("04c"))
    projected = [weight for optimizer in meter.optimizer for group in optimizer.param_groups
                 for weight in group["params"] if group["rank"]]
    assert sorted(calls) == sorted(2 * [weight.shape for weight in projected])


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_it_trains_the_text_presets_and_the_estimate_is_the_runs_peak(task, tmp_path, small_snippets):
    """tiny-text: MiniLM finetuned as a classifier, and the small Llama drawn anew under
    --task causal-lm (its key and value projections 32 wide: ranks of 8 and 16 by default)."""
    from estimate.predict import predict
    flags = [*TEXT, "--task", task, "--batch-size", "8"]
    real, _ = run_script("04c", [*QUICK, *flags], tmp_path, unevaluated("04c"))
    assert real["steps"] == 2 and all(math.isfinite(loss) for loss in real["losses"])
    predicted = predict(script_path("04c"), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


def test_the_8bit_forms_estimate_is_its_runs_peak(tmp_path):
    """bitsandbytes' dynamic maps and 8-bit kernel on fake tensors count as in the run (the
    architecture matrix checks the default form on every architecture it runs 04c on)."""
    from estimate.predict import predict
    flags = ["--galore-8bit", "--galore-rank", "16"]
    real, _ = run_script("04c", [*QUICK, *flags], tmp_path, unevaluated("04c"))
    predicted = predict(script_path("04c"), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


def test_the_combined_scripts_8bit_galore_trains_as_the_script(tmp_path, small_snippets):
    """10's --optimizer galore-8bit is 04c's --galore-8bit: the same peak and breakdown, to the
    byte, and the same losses (tests/scripts/test_combined.py compares --optimizer galore with 04c)."""
    flags = [*QUICK, "--batch-size", "8"]
    script, _ = run_script("04c", [*flags, "--galore-8bit"], tmp_path / "script", unevaluated("04c"))
    combined, _ = run_script("10", [*flags, "--optimizer", "galore-8bit", "--optimizer-in-backward"],
                             tmp_path / "combined", unevaluated("10"))
    assert combined["peak_memory_bytes"] == script["peak_memory_bytes"]
    assert combined["breakdown_bytes"] == script["breakdown_bytes"]
    assert_follows(combined["losses"], script["losses"])


def test_the_combined_scripts_stack_with_galore_is_estimated_to_the_byte(tmp_path, small_snippets):
    """8-bit GaLore stepped in backward beside the fused loss and full checkpointing, on a decoder:
    the estimate on the CPU equals the run's peak."""
    from estimate.predict import predict
    flags = [*TEXT, "--task", "causal-lm", "--loss", "fused", "--checkpointing", "full",
             "--optimizer", "galore-8bit", "--optimizer-in-backward", "--batch-size", "8"]
    real, _ = run_script("10", [*QUICK, *flags], tmp_path, unevaluated("10"))
    predicted = predict(script_path("10"), [*flags, "--device", "cpu"])
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


def stopped(main, argv, capsys):
    """The one line `main(argv)` stops with, and its exit status (1 for a SystemExit's words)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    code = stop.value.code
    said = code if isinstance(code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in said
    return said, 1 if isinstance(code, str) else code


@pytest.mark.parametrize("argv, words, status", [
    (["--galore-rank", "129"], "--galore-rank 129 is above 128, the narrower side of the blocks' "
                               "narrowest 2-D weight, which has no more singular vectors: use at most "
                               "128", 1),
    (["--galore-rank", "0"], "argument --galore-rank: must be positive, got 0", 2),
    (["--galore-gap", "0"], "argument --galore-gap: must be positive, got 0", 2),
    (["--galore-scale", "-1"], "argument --galore-scale: must be positive, got -1", 2),
    (["--accum-steps", "4"], "cannot accumulate gradients over micro-batches; for --accum-steps "
                             "use 10_combined.py --optimizer galore", 2),
])
def test_bad_input_stops_in_one_line_and_writes_nothing(argv, words, status, tmp_path, capsys):
    said, code = stopped(load_script("04c").main, [*QUICK, *argv, "--results-dir", str(tmp_path)], capsys)
    assert words in said and code == status
    assert not any(tmp_path.iterdir())


def test_a_model_whose_blocks_have_no_2d_weight_is_refused(tmp_path, capsys):
    resnet = write_model(tmp_path / "resnet", "ResNet")
    said, _ = stopped(load_script("04c").main, [*QUICK, *model_flags(resnet, "ResNet"),
                                                "--results-dir", str(tmp_path / "out")], capsys)
    assert "no 2-D weight for GaLore to project" in said and "04a_optimizer_in_backward.py" in said


@pytest.mark.parametrize("argv, words", [
    (["--galore-gap", "10"], "--galore-gap without --optimizer galore|galore-8bit: it times"),
    (["--optimizer", "adamw-8bit", "--galore-rank", "8"], "--galore-rank without --optimizer galore"),
    (["--optimizer", "galore", "--offload"], "--optimizer galore with --offload: each process holds a "
                                             "slice of each weight's rows"),
    (["--optimizer", "galore-8bit", "--optimizer-on-host"], "--optimizer galore-8bit with "
                                                            "--optimizer-on-host"),
])
def test_the_combined_script_refuses_what_galore_cannot_train_beside(argv, words, tmp_path, capsys):
    said, _ = stopped(load_script("10").main, [*QUICK, *argv, "--results-dir", str(tmp_path)], capsys)
    assert words in said
