"""`python -m estimate --gpu-memory SIZE` ends with the stack: the first prefix of a chain of
the combined script's switches, cheapest first, whose run fits the asked batch in SIZE, the
largest micro-batch it fits (fit.py's search on 10_combined.py) and the command that runs it.

The chain and the reason for its order live here, as data: CHAIN, its GROUPS, and COST, the
rates the cost model assumes. Exact techniques come first, by the time they add to a step
(counted recomputation FLOPs at COST's GPU rate); then 8-bit and 4-bit AdamW, which change the
optimizer's arithmetic; then Adam stepped in backward, which takes no time but gives up accumulation (the
micro-batch becomes the batch); then what moves bytes over PCIe each step (activations, the
optimizer's state and step), then the weights too. Within a group the links are ordered by the
seconds the cost model gives them for the model asked about (activation offloading's bytes
grow with the tokens, the host optimizer's with the parameters), and the printed chain says
where that differs from CHAIN. A link that 10_combined.py refuses beside an earlier one
replaces it, and the printed chain says so. Adapters train something else: they are answered
apart, with the activation switches of the answer.
"""
from dataclasses import dataclass, field
from functools import partial

from estimate.fit import Fit, accumulation_for, bytes_per_sample, micro_row, search
from estimate.predict import attempt, took_text
from estimate.records import size_text
from estimate.workers import in_order

REMOVE = None  # a link's value for a switch it takes out (10_combined.py refuses the pair)
COST = {"gpu_flops": 150e12,  # bfloat16 matrix products actually reached (an A100's 312 peak at ~50%)
        "pcie_bytes_per_s": 25e9,  # PCIe 4.0 x16 as copies reach it (32 GB/s on paper)
        "host_bytes_per_s": 50e9,  # host memory for the optimizer's step on the host
        "elementwise_forward": 0.1,  # selective: the operators between matrix products, of a forward's time
        "adam_bytes_per_parameter": 16,  # read and written by a step on the host (float32 state)
        "gpu_bytes_per_s": 1.5e12,  # an A100 80GB's 2.0 TB/s as element-wise kernels reach it
        # read and written by 05j's step, its operators' inputs and outputs (tests/estimate/test_stack.py)
        "adamw_4bit_bytes_per_parameter": 324,
        }


@dataclass(frozen=True)
class Link:
    """One link: the switches it sets (a value, True for a flag, REMOVE), and its cost."""
    name: str
    sets: tuple              # ((flag, value), ...)
    cost: str                # the cost model's words
    group: int = 0           # GROUPS: the chain keeps their order, and orders by cost within one
    causal_lm_only: bool = False
    sharded: bool = False    # --offload: sharded (under torchrun when --world-size N > 1)
    gives_back: str = ""     # what taking out the switches it REMOVEs gives back


GROUPS = ("exact: the same arithmetic, more time", "inexact: the optimizer's arithmetic changes",
          "no accumulation: the micro-batch is the batch", "bytes over PCIe every step",
          "the weights in host memory too")


CHAIN = (
    Link("bf16", (), "the default: bfloat16 weights, Adam, the model's loss"),
    Link("fused loss", (("--loss", "fused"),),
         "none: the output layer's products, as the model's own loss makes them, a piece at a "
         "time (the chunked loss holds as little for a second forward of the output layer)",
         causal_lm_only=True),
    Link("selective checkpointing", (("--checkpointing", "selective"),),
         "the element-wise operators again: ~0.1 of a forward's time, no matrix product"),
    Link("full checkpointing", (("--checkpointing", "full"),),
         "the blocks' forward again: 1.0 forward (2 x parameters FLOPs a token)"),
    Link("8-bit AdamW", (("--optimizer", "adamw-8bit"),),
         "no time to speak of, but the state is quantized: the first inexact link", group=1),
    Link("4-bit AdamW", (("--optimizer", "adamw-4bit"),),
         "its plain-PyTorch step reads and writes ~324 bytes a parameter on the GPU; the state "
         "quantized to 4 bits", group=1),
    Link("optimizer in backward", (("--optimizer-in-backward", True),),
         "no time, but no accumulation: the micro-batch is the batch", group=2),
    Link("activation offloading", (("--checkpointing", "offloaded"),),
         "each block's input over PCIe out and back (2 x layers x tokens x hidden x 2 bytes), "
         "overlapped with compute", group=3),
    Link("optimizer on the host", (("--optimizer-on-host", True), ("--optimizer", "adamw-8bit")),
         "gradients down and weights up over PCIe (4 bytes a parameter) and Adam on the host; "
         "8-bit there (bitsandbytes' CPU step the quicker, 32 against 37-39 ns a weight here)", group=3),
    Link("gradients to host", (("--gradients-to-host", True), ("--optimizer-on-host", True),
                               ("--optimizer", "adamw-8bit"), ("--optimizer-in-backward", REMOVE)),
         "the same bytes as the optimizer on the host, each gradient as backward makes it, "
         "so accumulation comes back with no gradient held on the GPU", group=3,
         gives_back="accumulation again"),
    Link("offload", (("--offload", True), ("--loss", REMOVE), ("--optimizer", REMOVE),
                     ("--optimizer-in-backward", REMOVE), ("--optimizer-on-host", REMOVE),
                     ("--gradients-to-host", REMOVE)),
         "the weights up twice per micro-batch, gradients down (6 bytes a parameter) and Adam "
         "on the host", group=4, sharded=True, gives_back="the model's loss, Adam, accumulation again"),
)
# With several GPUs (--world-size N above 1) the walk first shards, Adam exact: 10_combined.py
# under torchrun splits parameters, gradients and Adam's state N ways (07), then recomputes
# activations as 09 does; only where none of these fits does it walk CHAIN, whose last link
# shards again with everything on the host. Their cost is the interconnect's: the weights
# gathered in forward and again in backward, the gradients reduce-scattered, each (N-1)/N of
# 2 bytes a parameter a micro-batch.
SHARDED_CHAIN = (
    Link("FSDP", (), "the weights gathered twice and the gradients reduce-scattered each "
         "micro-batch ((N-1)/N x 6 bytes a parameter over the interconnect); Adam exact",
         sharded=True),
    Link("FSDP, selective checkpointing", (("--checkpointing", "selective"),),
         "as FSDP, and the element-wise operators again", sharded=True),
    Link("FSDP, full checkpointing", (("--checkpointing", "full"),),
         "as FSDP, and the blocks' forward again (09)", sharded=True),
)
ADAPTERS = ((("--lora-rank", "8"),), (("--lora-rank", "8"), ("--qlora", True)))
ACTIVATION_FLAGS = ("--loss", "--checkpointing")


def step_seconds(link, parameters, tokens, layers, hidden, vocabulary, micro_batches=1):
    """The seconds the link adds to an optimizer step of `tokens` tokens, by COST."""
    forward = 2 * parameters * tokens / COST["gpu_flops"]
    host_step = parameters * COST["adam_bytes_per_parameter"] / COST["host_bytes_per_s"]
    pcie = COST["pcie_bytes_per_s"]
    return {"bf16": 0.0, "8-bit AdamW": 0.0, "optimizer in backward": 0.0,
            "fused loss": 0.0,
            "4-bit AdamW": parameters * COST["adamw_4bit_bytes_per_parameter"] / COST["gpu_bytes_per_s"],
            "selective checkpointing": COST["elementwise_forward"] * forward,
            "full checkpointing": forward,
            "activation offloading": 2 * layers * tokens * hidden * 2 / pcie,
            "optimizer on the host": 4 * parameters / pcie + host_step,
            "gradients to host": 4 * parameters / pcie + host_step,
            "offload": (4 * micro_batches + 2) * parameters / pcie + host_step}[link.name]


def ordered(seconds=None):
    """CHAIN's links in GROUPS' order, and within a group by the `seconds` each adds to a step
    ({link name: seconds}, step_seconds' for a model); CHAIN's own order without them."""
    return sorted(CHAIN, key=lambda link: (link.group, (seconds or {}).get(link.name, 0)))


def prefixes(task, seconds=None):
    """[(link, switches as [(flag, value)], notes)] for each prefix of the chain, in order (by
    `seconds`: see ordered()); notes say what a link skipped or replaced."""
    out, current = [], {}
    for link in ordered(seconds):
        if link.causal_lm_only and task != "causal-lm":
            out.append((link, None, [f"{link.name} skipped: --task {task} has nothing to chunk"]))
            continue
        replaced, refused = [], []
        for flag, value in link.sets:
            if value is REMOVE:
                if flag in current:
                    refused.append(flag_text(flag, current.pop(flag)))
            else:
                if flag in current and current[flag] != value:
                    replaced.append(flag_text(flag, current[flag]))
                current[flag] = value
        notes = [f"replaces {', '.join(replaced)}"] if replaced else []
        if refused:
            notes.append(f"replaces {', '.join(refused)} (10_combined.py refuses them with "
                         f"{link.sets[0][0]}: {link.gives_back})")
        out.append((link, list(current.items()), notes))
    return out


def whole_stack(task):
    """The argv of every switch that combines in one run: the longest prefix of CHAIN before a
    link that takes switches out (offload), what the tour runs 10_combined.py with."""
    switches = []
    for link, prefix, _ in prefixes(task):
        if any(value is REMOVE for _, value in link.sets):
            break
        switches = prefix if prefix is not None else switches
    return argv_of(switches)


def flag_text(flag, value):
    return flag if value is True else f"{flag} {value}"


def argv_of(switches):
    return [part for flag, value in switches for part in
            ([flag] if value is True else [flag, str(value)])]


@dataclass
class Answer:
    """The stack found: the prefix that fits, its search, and every prefix tried."""
    link: Link | None = None
    switches: list = field(default_factory=list)
    fit: Fit | None = None
    world_size: int = 1
    parameters: int = 0  # the model's, from the first estimate (for the cost model)
    tried: list = field(default_factory=list)  # (link, switches, notes, reserved or problem)
    search: tuple = ()  # search()'s arguments for the prefix that fits
    host_bytes: int = 0  # the host memory a process of the answer holds (--offload's shards)


WEIGHT_BYTES = 2  # a parameter's bytes: the chain trains 10_combined.py's bfloat16 weights
STATE_BYTES = {"adam": 2 * WEIGHT_BYTES,  # Adam's two moments, in the weights' dtype
               "adamw-8bit": 2,           # two moments of one byte (more in tensors too small to quantize)
               "adamw-4bit": 1 + 8 / 128}  # two of half a byte, a float32 scale per 128 weights each


def resident_bytes(switches, parameters, world_size=1):
    """A floor under a prefix's peak: the weights and the optimizer's state, which stay on the
    GPU through every step of the run (no state under --optimizer-on-host, neither under
    --offload; a `world_size`-th of them when sharded); a prefix whose floor exceeds the GPU is
    not estimated."""
    chosen = dict(switches)
    if chosen.get("--offload"):
        return 0
    state = 0 if chosen.get("--optimizer-on-host") else STATE_BYTES[chosen.get("--optimizer", "adam")]
    return parameters * (WEIGHT_BYTES + state) // world_size


def walk(script, base_argv, batch_size, world_size, capacity, task, gpu, report=print, jobs=1,
         searched=True, seconds=None, parameters=0, host_capacity=None):
    """The first prefix of CHAIN whose run fits `batch_size` in `capacity`, searched (unless not
    `searched`) for its largest micro-batch per GPU, up to the batch; `base_argv`: the model's
    flags without --batch-size. Up to `jobs` prefixes are estimated at a time, in chain order;
    with the model's `parameters`, a prefix whose resident_bytes exceed `capacity` is not."""
    answer, plans = Answer(parameters=parameters), []
    sharded_first = [(link, list(link.sets), []) for link in SHARDED_CHAIN] if world_size > 1 else []
    for link, switches, notes in [*sharded_first, *prefixes(task, seconds)]:
        if switches is None:
            plans.append((link, None, notes, None))
            continue
        floor = resident_bytes(switches, parameters, world_size if link.sharded else 1)
        if floor > capacity:
            plans.append((link, switches, notes, f"not estimated: its weights and optimizer "
                                                 f"state alone hold {size_text(floor)}"))
            continue
        world = world_size if link.sharded else 1
        accumulates = ("--optimizer-in-backward", True) not in switches
        micro = 1 if accumulates else batch_size // world
        argv = [*base_argv, *argv_of(switches)]
        plans.append((link, switches, notes, (argv, world, micro, accumulates)))
    rows = [micro_row(script, plan[0], *plan[1:], gpu) for *_, plan in plans
            if isinstance(plan, tuple)]
    outcomes = in_order(estimated, rows, jobs, lambda: "during the stack's walk: no stack")
    for link, switches, notes, plan in plans:
        if not isinstance(plan, tuple):  # skipped by the task, or by its floor (words)
            answer.tried.append((link, switches, notes, plan))
            if plan:
                report(f"[stack] {link.name}: {plan}")
            continue
        argv, world, micro, accumulates = plan
        record, problem, took = next(outcomes)
        reserved = record and record["reserved_bytes"]
        answer.parameters = answer.parameters or (record or {}).get("parameter_count", 0)
        answer.tried.append((link, switches, notes, reserved if record else problem))
        report(f"[stack] {link.name}: " + (f"{size_text(reserved)} reserved at micro-batch "
                                            f"{micro}" if record else f"failed: {problem}")
               + f" ({took_text(took)})")
        if record is None or reserved > capacity or batch_size % world:
            continue
        host = record["host_bytes"] * world  # the processes of one machine
        if host_capacity is not None and host > host_capacity:
            report(f"[stack] {link.name}: needs {size_text(host)} of host memory, above "
                   f"--host-memory ({size_text(host_capacity)})")
            answer.tried[-1] = (link, switches, notes, f"needs {size_text(host)} of host memory")
            continue
        outcomes.close()  # the later prefixes are not needed: their estimates stop
        answer.link, answer.switches, answer.world_size = link, switches, world
        answer.host_bytes = record["host_bytes"]
        answer.search = (script, argv, world, capacity, accumulates,
                         {micro: (record["allocated_bytes"], reserved)}, gpu, batch_size // world,
                         bytes_per_sample(record, micro))
        if searched:
            answer.fit = settle(("search", answer.search), batch_size)
        return answer
    return answer


def estimated(row):
    """attempt(row), looked up when called (a worker process is sent this function by name)."""
    return attempt(row)


def settle(task, batch_size):
    """The Fit of a search task: ("search", search()'s arguments), or ("adapter", (script, argv,
    capacity, gpu, label)), estimated at micro-batch 1 first (its problem if that fails);
    module-level, for the worker processes."""
    kind, arguments = task
    if kind == "search":
        fit = search(*arguments)
        fit.batch_size, fit.world_size = batch_size, arguments[2]
        return fit
    script, argv, capacity, gpu, label = arguments
    record, problem, seconds = attempt(micro_row(script, argv, 1, 1, True, gpu))
    print(f"[stack] {label}: "
          + (size_text(record["reserved_bytes"]) if record else "failed") + f" ({took_text(seconds)})",
          flush=True)
    if record is None:
        return problem
    known = {1: (record["allocated_bytes"], record["reserved_bytes"])}
    fit = (search(script, argv, 1, capacity, True, known, gpu, batch_size,
                  bytes_per_sample(record, 1))
           if record["reserved_bytes"] <= capacity else Fit(script.stem, True, tried=known))
    fit.batch_size, fit.world_size, fit.capacity = batch_size, 1, capacity
    return fit


def answer_all(script, base_argv, batch_size, world_size, capacity, task, gpu, jobs=1, report=print,
               seconds=None, parameters=0, host_capacity=None):
    """The stack (walk, its chain ordered by `seconds`, its prefixes floored by `parameters`)
    and the adapters' answers, their searches up to `jobs` at a time."""
    answer = walk(script, base_argv, batch_size, world_size, capacity, task, gpu, report, jobs,
                  searched=False, seconds=seconds, parameters=parameters, host_capacity=host_capacity)
    activation = activation_switches(answer)
    switch_sets = [[*activation, *adapter] for adapter in ADAPTERS]
    tasks = [("adapter", (script, [*base_argv, *argv_of(switches)], capacity, gpu,
                          " ".join(argv_of(switches)))) for switches in switch_sets]
    if answer.link is not None:
        tasks.insert(0, ("search", answer.search))
    fits = list(in_order(partial(settle, batch_size=batch_size), tasks, jobs,
                         lambda: "during the stack's searches: no stack"))
    if answer.link is not None:
        answer.fit = fits.pop(0)
    adapter_answers = [(switches, None, fit) if isinstance(fit, str) else (switches, fit, None)
                       for switches, fit in zip(switch_sets, fits)]
    return answer, adapter_answers


def command(model_argv, batch_size, switches, fit, world_size):
    """The command that runs the answer."""
    launch = (f"torchrun --nproc_per_node={world_size} 10_combined.py" if world_size > 1
              else "python 10_combined.py")
    words = [launch, *model_argv, "--batch-size", str(batch_size)]
    steps = (accumulation_for(fit) or batch_size // world_size) if fit.accumulates else 1
    if steps > 1:  # 1: the script's default, left out
        words += ["--accum-steps", str(steps)]
    return " ".join([*words, *argv_of(switches)])


def chain_seconds(parameters, tokens, shape):
    """{link name: seconds it adds to a step of `tokens` tokens} by COST, for a model of
    `parameters` and shape (layers, hidden, vocabulary)."""
    return {link.name: step_seconds(link, parameters, tokens, *shape) for link in CHAIN}


def chain_text(task, parameters, tokens, shape, world_size):
    """The chain as printed: each link, what it sets or replaces, and its cost per step; where
    the cost model orders this model's chain otherwise than CHAIN, a line says so."""
    seconds = chain_seconds(parameters, tokens, shape)
    lines = [f"The chain, cheapest first (cost model: {COST['gpu_flops'] / 1e12:.0f} TFLOP/s, "
             f"PCIe {COST['pcie_bytes_per_s'] / 1e9:.0f} GB/s, host {COST['host_bytes_per_s'] / 1e9:.0f} "
             f"GB/s; seconds added to a step of {tokens} tokens, a plain step "
             f"{6 * parameters * tokens / COST['gpu_flops']:.3g} s):"]
    if world_size > 1:
        lines.append(f"  sharded over {world_size} GPUs first, Adam exact (10_combined.py under "
                     f"torchrun --nproc_per_node={world_size}):")
        lines += [f"  {number}. {link.name}: {' '.join(argv_of(link.sets)) or '(none)'}; {link.cost}"
                  for number, link in enumerate(SHARDED_CHAIN, 1)]
    group = None
    for number, (link, switches, notes) in enumerate(prefixes(task, seconds),
                                                     1 + (len(SHARDED_CHAIN) if world_size > 1 else 0)):
        if link.group != group:
            group = link.group
            lines.append(f"  {GROUPS[group]}:")
        sets = " ".join(argv_of([(f, v) for f, v in link.sets if v is not REMOVE])) or "(none)"
        if link.sharded and world_size > 1:
            sets += f" under torchrun --nproc_per_node={world_size}"
        added = "" if switches is None else f" +{seconds[link.name]:.3g} s;"
        lines.append(f"  {number}. {link.name}: {sets};{added} {link.cost}"
                     + "".join(f"; {note}" for note in notes))
    moved = [link.name for link, usual in zip(ordered(seconds), CHAIN) if link is not usual]
    if moved:
        named = " and ".join([", ".join(moved[:-1]), moved[-1]] if len(moved) > 2 else moved)
        lines.append(f"  (for this model the cost model orders {named} otherwise "
                     "than the usual chain: cheaper first within a group)")
    return "\n".join(lines)


def stack_text(answer, model_argv, batch_size, capacity, size, adapter_answers):
    """The stack's answer, the adapters' line."""
    if answer.fit is None:
        last = next(((link, value) for link, sw, _, value in reversed(answer.tried)
                     if sw is not None), None)
        nearest = (f"{size_text(last[1])} reserved against {size} ({size_text(capacity)})"
                   if last and isinstance(last[1], int) else f"its estimate failed: {last and last[1]}")
        lines = [f"The stack: no prefix fits batch {batch_size} in --gpu-memory {size}; the "
                 f"nearest is the whole chain ({last[0].name if last else 'none'}): {nearest}"]
    else:
        fit = answer.fit
        per = " per GPU" if answer.world_size > 1 else ""
        lines = [f"The stack: {answer.link.name} fits batch {batch_size} in --gpu-memory {size}; "
                 + (micro_words(fit, per) if fit.accumulates
                    else "the whole batch at once (stepped in backward, it is not split)")
                 + peak_words(fit) + (f" ({fit.problem})" if fit.problem else ""),
                 "  " + command(model_argv, batch_size, answer.switches, fit, answer.world_size)]
        if answer.host_bytes:  # --offload: the state that left the GPU is in host memory
            machine = (f", {size_text(answer.host_bytes * answer.world_size)} for the "
                       f"{answer.world_size} on one machine" if answer.world_size > 1 else "")
            lines.append(f"  host memory: {size_text(answer.host_bytes)} a process (the sharded "
                         f"weights, gradients and Adam's state){machine}, beside the GPU's")
    words = []
    for switches, fit, problem in adapter_answers:
        name = " ".join(argv_of(switches))
        if fit is None:
            words.append(f"{name}: not estimated ({problem.split('. ')[0]})")
        elif fit.largest is None:
            reserved = max(nbytes for _, nbytes in fit.tried.values())
            words.append(f"{name}: not even micro-batch 1 ({size_text(reserved)})")
        else:
            words.append(f"{name}: {micro_words(fit)}, --accum-steps {accumulation_for(fit)}")
    if words:
        lines.append("with adapters (they train something else): " + "; ".join(words))
    return "\n".join(lines)


def peak_words(fit):
    """The predicted peak of the largest micro-batch estimated that fits."""
    fitting = [micro for micro, (_, reserved) in fit.tried.items()
               if micro <= fit.largest and reserved <= fit.capacity]
    if not fitting:
        return ""
    micro = max(fitting)
    return f"; {size_text(fit.tried[micro][1])} reserved at micro-batch {micro}"


def micro_words(fit, per=""):
    """The largest micro-batch the search found; it stops at the asked batch."""
    return f"micro-batches of up to {fit.largest}{per}" + (
        " (the whole batch: the search stops there)" if fit.capped else "")


def activation_switches(answer):
    """The answer's activation switches (the last prefix's when none fits), for the adapters."""
    switches = answer.switches or next((sw for link, sw, _, _ in reversed(answer.tried)
                                        if sw is not None and not link.sharded), [])
    return [(flag, value) for flag, value in switches if flag in ACTIVATION_FLAGS]
