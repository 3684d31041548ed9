"""The optimizer-state branches' claims: 04a (optimizer in backward) takes 03's step and never
holds the whole model's gradients; 05a (8-bit AdamW), 05j (4-bit AdamW) and 05b (Adafactor) keep
the state they promise, and learn; 04b's stochastic rounding keeps on average what 03 rounds
away; 05f (Adam on the host) and 05i (its gradients sent as made) take 04's step off the GPU."""
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import CPU, QUICK, assert_trains_as, load_script, run_script, script_path


@pytest.mark.numerical
def test_the_optimizer_in_backward_takes_03s_step(runs):
    """One Adam per weight, stepped during backward, updates as one Adam after it."""
    assert_trains_as("04a", "03", runs)


def test_the_optimizer_in_backward_holds_one_parameters_gradient_at_most(tmp_path, monkeypatch):
    parameters, held = [], []
    adam_init, adam_step = torch.optim.Adam.__init__, torch.optim.Adam.step

    def init(self, params, *args, **kwargs):
        params = list(params)
        parameters.extend(params)
        adam_init(self, params, *args, **kwargs)

    def step(self, *args, **kwargs):  # each weight's step: what gradients exist right then
        held.append(sum(param.grad.nbytes for param in parameters if param.grad is not None))
        return adam_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "__init__", init)
    monkeypatch.setattr(torch.optim.Adam, "step", step)
    run_script("04a", QUICK, tmp_path)
    largest = max(param.nbytes for param in parameters)
    assert len(held) == 2 * len(parameters)  # two optimizer steps of every weight
    assert max(held) <= largest < sum(param.nbytes for param in parameters) / 4


def test_accumulation_is_refused_by_the_optimizer_in_backward(capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script("04a").main(["--accum-steps", "4"])
    assert stopped.value.code == 2  # a usage error, as argparse reports one
    assert re.search("cannot accumulate gradients.*use 04_grad_accum.py", capsys.readouterr().err)


def optimizer_state_bytes(optimizer):
    """{parameter: bytes of its optimizer state}, the step counters left out."""
    return {param: sum(value.nbytes for name, value in state.items()
                       if torch.is_tensor(value) and name != "step")
            for param, state in optimizer.state.items()}


LEARNING = ["--epochs", "1", "--max-steps", "12"]  # enough steps for the loss to fall


def test_8bit_adamw_keeps_two_bytes_per_weight_in_large_tensors(runs):
    _, meter = runs("05a", LEARNING)
    sizes = optimizer_state_bytes(meter.optimizer)
    large = [param for param in sizes if param.numel() >= 4096]  # bitsandbytes' min_8bit_size
    assert large
    for param in large:  # two uint8 states, and a float32 scale per block of 256 for each
        assert sizes[param] == 2 * param.numel() + 2 * 4 * -(-param.numel() // 256) + 2 * 256 * 4
    assert sum(sizes[param] for param in large) / sum(param.numel() for param in large) < 2.1


def test_4bit_adamw_keeps_about_one_byte_per_weight_in_large_tensors(runs):
    _, meter = runs("05j", LEARNING)
    sizes = optimizer_state_bytes(meter.optimizer)
    block = load_script("05j").BLOCK
    large = [param for param in sizes if param.numel() >= 4096 and param.numel() % block == 0]
    assert large and len(large) < len(sizes)
    coded_ids = {id(param) for param in large}
    for param in sizes:  # two states of 4-bit codes, two to a byte, and a float32 scale per block
        coded = 2 * (param.numel() // 2 + 4 * param.numel() // block)
        assert sizes[param] == (coded if id(param) in coded_ids else 8 * param.numel()), tuple(param.shape)
    assert sum(sizes[param] for param in large) / sum(param.numel() for param in large) == 1 + 8 / block


@pytest.mark.numerical
def test_4bit_codes_stand_for_the_nearest_value_of_their_table():
    """Each value comes back as the table's value nearest to it, times its block's scale (the
    block's largest magnitude), for blocks of sizes 1e-6 to 1: the two roundings (dividing by the
    scale, multiplying back) are the only other error. Half the blocks' largest values are
    negative (randn's), which a table without -1 would shrink at every step."""
    module = load_script("05j")
    generator = torch.Generator().manual_seed(0)
    sizes = torch.logspace(-6, 0, 64).repeat_interleave(module.BLOCK)
    values = torch.randn(64 * module.BLOCK, generator=generator) * sizes
    for table, data in ((module.SIGNED, values), (module.UNSIGNED, values.abs())):
        bounds = (table[1:] + table[:-1]) / 2  # halfway between neighbours
        codes, scales = module.encode(data, bounds)
        assert codes.dtype == torch.uint8 and codes.numel() == data.numel() // 2
        assert torch.equal(scales, data.view(-1, module.BLOCK).abs().amax(dim=1))
        decoded = module.decode(codes, scales, table)
        scale = scales.repeat_interleave(module.BLOCK)
        nearest = ((data / scale)[:, None] - table).abs().amin(dim=1) * scale
        assert ((decoded - data).abs() <= nearest + 4 * 2.0**-24 * scale).all()
        assert set(torch.cat([codes & 15, codes >> 4]).tolist()) <= set(range(16))
        # coded again, decoded values come back unchanged: no block shrinks from step to step
        # (a block's largest value, of either sign, is a value of the table times its scale)
        assert torch.equal(module.decode(*module.encode(decoded, bounds), table), decoded)


@pytest.mark.numerical
def test_4bit_adamws_first_step_is_adams_and_its_small_tensors_step_as_adam():
    """From states of zero, the first update is made before any state is coded: Adam's, within
    the rounding of its few operations. Tensors kept in float32 go on stepping as Adam."""
    module = load_script("05j")
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(100))]
    copies = [torch.nn.Parameter(weight.detach().clone()) for weight in weights]
    ours, adam = module.AdamW4bit(weights, lr=1e-2), torch.optim.Adam(copies, lr=1e-2)
    u, bound = 2.0**-24, [0, 0]  # the rounding the weights' difference may have gathered
    for step in range(3):
        before = [copy.detach().clone() for copy in copies]
        for weight, copy in zip(weights, copies):
            weight.grad = torch.randn_like(weight)
            copy.grad = weight.grad.clone()
        ours.step()
        adam.step()
        for index, (copy, old) in enumerate(zip(copies, before)):  # about ten roundings of the
            moved = (copy.detach() - old).abs()                    # update, one of the weight
            bound[index] = bound[index] + 16 * u * moved + 2 * u * copy.detach().abs()
        assert ((weights[1] - copies[1]).abs() <= bound[1]).all(), step
        if step == 0:
            assert ((weights[0] - copies[0]).abs() <= bound[0]).all()
    assert not torch.equal(weights[0], copies[0])  # the coded states differ from Adam's after


def test_adafactor_keeps_rows_plus_columns_for_a_matrix(runs):
    _, meter = runs("05b", LEARNING)
    for param, state in meter.optimizer.state.items():
        kept = sum(value.numel() for name, value in state.items() if name != "step")
        if param.dim() >= 2:  # the last two dimensions are factored, for each leading index
            rows, columns = param.shape[-2:]
            expected = (rows + columns) * param[..., 0, 0].numel()
        else:
            expected = param.numel()
        assert kept == expected, (tuple(param.shape), {n: v.shape for n, v in state.items()})


@pytest.mark.parametrize("name", ["05a", "05j", "05b"])
def test_a_few_steps_of_the_leaner_optimizers_lower_the_loss(name, runs):
    record, _ = runs(name, LEARNING)
    losses = record["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, losses


def mean_and_its_spread(rounded, lower, upper, share_up):
    """The mean of `rounded` (each `lower` or `upper`) in float64, and the standard deviation of
    that mean if each rounds up with probability `share_up` on its own (a binomial count)."""
    count = rounded.numel()
    spread = (upper - lower) * (share_up * (1 - share_up) / count) ** 0.5
    return rounded.double().mean().item(), spread


def test_stochastic_rounding_is_right_on_average():
    """1 + 2^-10 lies between the bfloat16 numbers 1 and 1 + 2^-7, an eighth of the way up."""
    stochastic_round = load_script("04b").stochastic_round
    torch.manual_seed(0)
    value = 1 + 2**-10
    rounded = stochastic_round(torch.full((2**20,), value))
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # bfloat16 numbers already
    assert set(rounded.unique().tolist()) == {1.0, 1 + 2**-7}
    mean, spread = mean_and_its_spread(rounded, 1.0, 1 + 2**-7, share_up=1 / 8)
    assert abs(mean - value) < 6 * spread  # one chance in 10^8 of failing by bad luck
    assert stochastic_round(torch.tensor([-value] * 4096)).double().mean().item() < -1.0  # sign kept
    nan_bits = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32)  # -1: 0xFFFFFFFF
    assert stochastic_round(nan_bits.view(torch.float32).repeat(1000)).isnan().all()  # no carry


def test_the_updates_03_rounds_away_are_kept_on_average():
    """Adam's first step moves every weight by the learning rate; 1e-4 from a weight of 1 is a
    fortieth of the gap to the next bfloat16 number below (2^-8), so 03's Adam loses it."""
    optimizer_class = load_script("04b").AdamStochasticRounding
    torch.manual_seed(0)
    lr, gap = 1e-4, 2**-8
    weights = {}
    for name, make in (("03", torch.optim.Adam), ("04b", optimizer_class)):
        weight = torch.nn.Parameter(torch.ones(2**20, dtype=torch.bfloat16))
        weight.grad = torch.ones_like(weight)
        make([weight], lr=lr).step()
        weights[name] = weight.detach()
    assert torch.all(weights["03"] == 1.0)  # every update rounded away
    mean, spread = mean_and_its_spread(weights["04b"], 1 - gap, 1.0, share_up=1 - lr / gap)
    assert abs(mean - (1 - lr)) < 6 * spread


@pytest.mark.numerical
def test_adam_on_the_host_trains_as_04(runs):
    """The same Adam, on a copy of the weights: the same losses and weights."""
    assert_trains_as("05f", "04", runs)


@pytest.mark.numerical
def test_gradients_sent_to_the_host_as_they_are_made_train_as_05f(runs):
    """The same Adam on the host, each gradient copied out during backward and the micro-batches'
    added up there: the same losses and weights."""
    assert_trains_as("05i", "05f", runs)


def test_gradients_sent_to_the_host_leave_the_device_one_at_a_time(tmp_path):
    """At each copy out, the gradients on the device are the one backward just finished: none
    waits for the end of backward (05f holds them all there), with 4 micro-batches a step."""
    module = load_script("05i")
    held, copies = [], []

    class Watched(module.GradientsToHost):
        def __init__(self, weights, host_weights, device):
            self.weights = list(weights)
            super().__init__(self.weights, host_weights, device)

        def to_host(self, weight, host_weight):
            held.append(sum(each.grad is not None for each in self.weights))
            super().to_host(weight, host_weight)
            copies.append(weight.grad is None)  # freed on the device at once

    module.GradientsToHost = Watched
    _, meter = run_script("05i", QUICK, tmp_path, module)
    trained = sum(1 for param in meter.model.parameters() if param.requires_grad)
    assert len(held) == 2 * 4 * trained  # two steps of four micro-batches, every weight
    assert max(held) == 1 and all(copies)


def test_a_micro_batchs_copies_are_added_by_their_next_copy_and_sum_as_05fs(tmp_path):
    """add_up() after a micro-batch's backward adds nothing (on a GPU a thread adds while the
    next micro-batch runs); each weight's copy is in its .grad by the weight's next copy, and all
    by add_all(), before Adam's step. What Adam reads is then 05f's accumulated gradient exactly:
    the same bfloat16 additions, in the same order, each rounded alike (4 micro-batches, 2 steps)."""
    module = load_script("05i")
    copies, checks = {}, []

    class Watched(module.GradientsToHost):
        def add_up(self):
            before = [(host_weight, host_weight.grad) for _, host_weight in self.arrived]
            values = [None if grad is None else grad.clone() for _, grad in before]
            super().add_up()
            checks.append(all(host_weight.grad is grad and (grad is None or torch.equal(grad, value))
                              for (host_weight, grad), value in zip(before, values)))
            checks.append(len(self.copies) == len(before) > 0)  # every copy still waits

        def to_host(self, weight, host_weight):
            earlier = copies.setdefault(host_weight, [])  # this step's copies of it so far
            super().to_host(weight, host_weight)
            sum_so_far = None
            for copy in earlier:  # added in turn, as autograd accumulates 05f's .grad
                sum_so_far = copy.clone() if sum_so_far is None else sum_so_far + copy
            checks.append(host_weight not in self.copies and (
                host_weight.grad is None if sum_so_far is None
                else torch.equal(host_weight.grad, sum_so_far)))
            earlier.append(self.arrived[-1][0].clone())

        def add_all(self):
            super().add_all()
            checks.append(not self.copies and len(copies) > 0)
            copies.clear()  # the next step starts anew

    def gradients(optimizer, args, kwargs):  # what each of Adam's steps reads
        read.append([weight.grad.clone() for weight in optimizer.param_groups[0]["params"]])

    module.GradientsToHost = Watched
    read = []
    handle = register_optimizer_step_pre_hook(gradients)
    try:
        run_script("05i", QUICK, tmp_path, module)
        run_script("05f", QUICK, tmp_path)
    finally:
        handle.remove()
    assert checks and all(checks)
    assert len(read) == 4  # two steps of each
    for step, their_step in zip(read[:2], read[2:], strict=True):
        assert all(torch.equal(mine, other) for mine, other in zip(step, their_step, strict=True))


def test_a_gpus_thread_adds_the_copies_while_the_next_micro_batch_runs():
    """The GPU's way, its thread run on a CPU: add_up() returns while the thread cannot have added
    (it is held busy here), the next micro-batch's forward runs meanwhile, and each weight's next
    copy waits for its sum; .grad is then the two gradients added once, on the thread."""
    module = load_script("05i")
    threads = set()

    class OnAThread(module.GradientsToHost):
        def add_copy(self, host_weight, copied=None):
            threads.add(threading.current_thread())
            super().add_copy(host_weight, copied)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    first, second = torch.randn(2, 3, 8)
    expected = [one + two for one, two in zip(*(torch.autograd.grad(model(inputs).sum(), list(
        model.parameters())) for inputs in (first, second)))]  # float32 sums, rounded once each
    host_weights = [weight.detach().clone() for weight in model.parameters()]
    to_host = OnAThread(model.parameters(), host_weights, torch.device("cpu"))
    to_host.adder = ThreadPoolExecutor(1)
    busy = threading.Event()
    to_host.adder.submit(busy.wait)  # the thread held until released
    model(first).sum().backward()
    to_host.add_up()
    loss = model(second).sum()  # the next forward, while the sums wait
    assert all(host_weight.grad is None for host_weight in host_weights)
    assert len(to_host.adding) == 2 and not any(sum_.done() for sum_ in to_host.adding.values())
    busy.set()
    loss.backward()  # each hook waits for its weight's sum before the next copy
    to_host.add_up()
    to_host.add_all()
    assert not to_host.copies and not to_host.adding
    assert all(torch.equal(host_weight.grad, sum_) for host_weight, sum_ in zip(host_weights, expected))
    assert threads and threading.main_thread() not in threads


def test_a_gpus_adding_thread_is_set_to_the_runs_gpu(monkeypatch):
    """A new thread's CUDA calls go to GPU 0, opening a context there, unless it is told its GPU:
    the thread that adds the copies is set to the device of their stream before its first sum."""
    module = load_script("05i")
    set_to = []

    class Stream:  # what the constructor reads of a CUDA stream
        def __init__(self, device):
            self.device = device

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: set_to.append((device, threading.current_thread())))
    to_host = module.GradientsToHost([], [], torch.device("cuda", 3))
    to_host.adder.submit(lambda: None).result()
    assert [device for device, _ in set_to] == [torch.device("cuda", 3)]
    assert set_to[0][1] is not threading.main_thread()


def test_gradients_sent_as_they_are_made_are_not_in_a_predicted_gpus_peak():
    """Predicted for a GPU: 05f's peak holds every gradient at the end of backward; 05i's holds
    none (each is freed as it is sent), so it is lower by at least their bytes."""
    from estimate.predict import predict
    after, as_made = (predict(script_path(name), ["--preset", "tiny"]) for name in ("05f", "05i"))
    gradients = after["breakdown_bytes"]["gradients"]
    assert as_made["breakdown_bytes"]["gradients"] == 0 < gradients
    assert as_made["allocated_bytes"] <= after["allocated_bytes"] - gradients


def test_adam_on_the_host_leaves_no_optimizer_state_on_a_gpu():
    """Predicted for a GPU: Adam's state and the weights' copy are in host memory, so the device
    holds 05's model state (weights and gradients, 4 bytes per parameter in bfloat16) where 04
    holds 8 or more; on the CPU (--device cpu, the host is the device) they are counted."""
    from estimate.predict import predict
    on_gpu = predict(script_path("05f"), ["--preset", "tiny"])
    plain = predict(script_path("04"), ["--preset", "tiny"])
    # what is left are Adam's step counters, a float32 number per tensor in a block of 512 bytes
    # each: on a GPU they live on the host too (estimate/gpu_choices.py: left out)
    assert on_gpu["breakdown_bytes"]["optimizer_state"] < 0.02 * plain["breakdown_bytes"]["optimizer_state"]
    assert on_gpu["model_state_bytes_per_parameter"] < 4.1 < 8 <= plain["model_state_bytes_per_parameter"]
    on_cpu = predict(script_path("05f"), ["--preset", "tiny", *CPU])
    assert on_cpu["breakdown_bytes"]["optimizer_state"] > 0
