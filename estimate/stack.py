"""`python -m estimate --gpu-memory SIZE` ends with the stack: the first prefix of a chain of
the combined script's switches, cheapest first, whose run fits the asked batch in SIZE, the
largest micro-batch it fits (fit.py's search on 10_combined.py) and the command that runs it.

The chain and the reason for its order live here, as data: CHAIN, its GROUPS, and COST, the
rates the cost model assumes. Exact techniques come first, by the time they add to a step
(counted recomputation FLOPs at COST's GPU rate); then 8-bit and 4-bit AdamW and 8-bit GaLore,
which change the optimizer's arithmetic; then Adam stepped in backward, which takes no time but
gives up accumulation (the micro-batch becomes the batch); then what moves bytes over PCIe each
step (activations, the optimizer's state and step), then the weights too. Within a group the
links are ordered by the seconds the cost model gives them for the model asked about
(activation offloading's bytes grow with the tokens, the host optimizer's with the parameters,
GaLore's SVD with both and the hidden size), and the printed chain says where that differs
from CHAIN. A link that 10_combined.py refuses beside an earlier one
replaces it, and the printed chain says so. Adapters train something else: they are answered
apart, with the activation switches of the answer.

With several GPUs (--world-size N above 1) the walk weighs sharding against one GPU by time.
A step's seconds (step_time) are the plain step of the tokens one GPU runs (batch/N of them when
sharded), what its switches add, priced as the one-GPU links price them, and when sharded the
interconnect's bytes: the weights all-gathered and the gradients reduce-scattered each
micro-batch, (N-1)/N of 2 bytes a parameter each, twice gathered under ZeRO-3 (FSDP's default)
and once under ZeRO-2 (--reshard-after-forward false). SHARDED_CHAIN's links (each a whole
switch set: Adam exact first, then with the switches 10_combined.py takes beside sharding, in
GROUPS' order) are tried cheapest first; a sharded fit keeps SHARDED_MARGIN of the GPU free.
The first that fits is searched and priced at the micro-batches it needs; a later sharded link
whose step could cost less (priced at one micro-batch a GPU, its least) is tried too, and the
cheaper kept. Then the one-GPU chain: its first prefix that fits in fewer seconds a step than
that answer replaces it; a prefix that cannot (priced before its estimate) is not estimated.
Where no sharded link fits, the chain is walked as with one GPU. The printed chain gives each
link's seconds, and the answer says why it won.
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
        # a GPU's all-gather and reduce-scatter, as bus bandwidth (the bytes it receives, (N-1)/N
        # of the whole, a second): an A100 SXM's NVLink, 300 GB/s each way, at about two thirds, as
        # collectives of a block's weights reach it; python -m estimate --interconnect RATE
        "interconnect_bytes_per_s": 200e9,
        # 8-bit GaLore: a float32 SVD of each block matrix every --galore-gap steps (its default),
        # far from the products' rate (cuSOLVER's Jacobi gesvdj): an assumption, not measured
        # (benchmarks/galore_svd.py measures it on a GPU)
        "svd_flops": 1e12, "galore_gap": 200,
        }
# Of --gpu-memory, kept free by a sharded fit (N GPUs): the estimate sees one process of N and
# leaves out what NCCL holds outside the tensors it is given (its own buffers; gloo's copy on the
# CPU is counted, and 2-process CPU runs equal their estimates: tests/test_distributed.py); no
# sharded run has been measured on GPUs (docs/gpus.md: groups of one), and one-GPU runs at scale
# reserved up to 1.036 of their prediction.
SHARDED_MARGIN = 0.10


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
    Link("8-bit GaLore", (("--optimizer", "galore-8bit"),),
         "inexact beyond 8-bit states: Adam's step on a rank-r projection of each block matrix's "
         "gradient (r a quarter of its narrower side: moments of 0.5 bytes a parameter there; the "
         "embeddings' and output layer's whole); each 200 steps an SVD of every block matrix (Golub "
         "and Van Loan's thin SVD: at most 26 x hidden FLOPs a parameter, at an assumed 1 TFLOP/s "
         "in float32) and each step the two products of its projection (hidden FLOPs a parameter)",
         group=1),
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

# With several GPUs (--world-size N above 1) the walk first shards: 10_combined.py under
# torchrun splits parameters, gradients and the optimizer's state N ways (07), Adam exact in the
# first group, then with the switches it takes beside sharding. Each link is a whole
# switch set; they are tried cheapest first by step_time (the chain's own terms for the same
# switches, on batch/N of the tokens, and the interconnect's), a group at a time: adding one is
# adding a line here.
SHARDED_CHAIN = (
    Link("FSDP ZeRO-2", (("--reshard-after-forward", "false"),),
         "the weights gathered once a micro-batch and kept until backward (every block's weights "
         "whole at the peak), the gradients reduce-scattered: (N-1)/N x 4 bytes a parameter over "
         "the interconnect; Adam exact", sharded=True),
    Link("FSDP ZeRO-3", (), "the weights gathered in forward and again in backward, the gradients "
         "reduce-scattered: (N-1)/N x 6 bytes a parameter a micro-batch over the interconnect; "
         "Adam exact", sharded=True),
    Link("FSDP ZeRO-3, selective checkpointing", (("--checkpointing", "selective"),),
         "as FSDP ZeRO-3, and the element-wise operators again", sharded=True),
    Link("FSDP ZeRO-3, full checkpointing", (("--checkpointing", "full"),),
         "as FSDP ZeRO-3, and the blocks' forward again (09)", sharded=True),
    # the switches 10_combined.py takes beside sharding (docs/combined.md#beside-sharding)
    Link("FSDP ZeRO-3, fused loss, full checkpointing",
         (("--loss", "fused"), ("--checkpointing", "full")),
         "as FSDP ZeRO-3 with full checkpointing; the loss a piece at a time, as the root's "
         "forward", sharded=True, causal_lm_only=True),
    Link("FSDP ZeRO-3, full checkpointing, 8-bit AdamW",
         (("--checkpointing", "full"), ("--optimizer", "adamw-8bit")),
         "as FSDP ZeRO-3 with full checkpointing; each process's shards stepped by 8-bit AdamW",
         group=1, sharded=True),
    Link("FSDP ZeRO-3, full checkpointing, optimizer in backward",
         (("--checkpointing", "full"), ("--optimizer-in-backward", True)),
         "as FSDP ZeRO-3 with full checkpointing; each weight stepped as its gradient shard is "
         "reduce-scattered, no accumulation", group=2, sharded=True),
)
ADAPTERS = ((("--lora-rank", "8"),), (("--lora-rank", "8"), ("--qlora", True)))
ACTIVATION_FLAGS = ("--loss", "--checkpointing")


@dataclass(frozen=True)
class Costs:
    """What the cost model prices: the model's parameters and shape, the tokens of one optimizer
    step over all GPUs, and the interconnect's bytes a second."""
    parameters: int
    tokens: int
    layers: int = 0
    hidden: int = 0
    vocabulary: int = 0
    interconnect: float = COST["interconnect_bytes_per_s"]


def rates(costs, world=1, micro_batches=1):
    """The cost model's terms, in seconds a step on each of `world` GPUs running 1/world of the
    tokens in `micro_batches` micro-batches, by COST (the links' and step_time's one home)."""
    parameters, tokens = costs.parameters, costs.tokens / world
    forward = 2 * parameters * tokens / COST["gpu_flops"]
    pcie = COST["pcie_bytes_per_s"]
    host_step = parameters * COST["adam_bytes_per_parameter"] / COST["host_bytes_per_s"]
    # one collective of the bfloat16 weights a micro-batch: each GPU moves (N-1)/N of them
    collective = micro_batches * WEIGHT_BYTES * parameters * (world - 1) / world / costs.interconnect
    return {"forward": forward, "elementwise": COST["elementwise_forward"] * forward,
            "activations over PCIe": 2 * costs.layers * tokens * costs.hidden * 2 / pcie,
            "4-bit step": parameters / world * COST["adamw_4bit_bytes_per_parameter"]
            / COST["gpu_bytes_per_s"],
            "GaLore's projections": parameters * costs.hidden * (
                1 / COST["gpu_flops"] + 26 / COST["galore_gap"] / COST["svd_flops"]),
            "optimizer on the host": 4 * parameters / pcie + host_step,
            "offload": (4 * micro_batches + 2) * parameters / world / pcie + host_step,
            "all-gather": collective, "reduce-scatter": collective}


def step_seconds(link, parameters, tokens, layers, hidden, vocabulary, micro_batches=1):
    """The seconds the link adds to an optimizer step of `tokens` tokens, by COST."""
    terms = rates(Costs(parameters, tokens, layers, hidden, vocabulary), 1, micro_batches)
    return {"bf16": 0.0, "8-bit AdamW": 0.0, "optimizer in backward": 0.0, "fused loss": 0.0,
            "4-bit AdamW": terms["4-bit step"],
            "8-bit GaLore": terms["GaLore's projections"],
            "selective checkpointing": terms["elementwise"],
            "full checkpointing": terms["forward"],
            "activation offloading": terms["activations over PCIe"],
            "optimizer on the host": terms["optimizer on the host"],
            "gradients to host": terms["optimizer on the host"],
            "offload": terms["offload"]}[link.name]


def step_time(costs, switches, world=1, micro_batches=1):
    """{what: seconds} of one optimizer step under `switches` on each of `world` GPUs, in
    `micro_batches` micro-batches a GPU: the plain step of its tokens (a forward and a backward,
    3 forwards), what the switches add as the chain's links price them, and when sharded the
    interconnect's: the weights all-gathered twice a micro-batch (ZeRO-3: in forward, again in
    backward) or once (ZeRO-2: --reshard-after-forward false), the gradients reduce-scattered."""
    chosen, terms = dict(switches), rates(costs, world, micro_batches)
    checkpointing = chosen.get("--checkpointing")
    parts = {"compute": 3 * terms["forward"]}
    again = {"selective": "elementwise", "full": "forward", "offloaded": "forward"}
    if checkpointing in again:
        parts["recompute"] = terms[again[checkpointing]]
    if checkpointing == "offloaded":
        parts["activations over PCIe"] = terms["activations over PCIe"]
    if chosen.get("--offload"):
        parts["weights over PCIe, Adam on the host"] = terms["offload"]
    elif chosen.get("--optimizer-on-host"):
        parts["optimizer on the host"] = terms["optimizer on the host"]
    elif chosen.get("--optimizer") == "adamw-4bit":
        parts["4-bit step"] = terms["4-bit step"]
    elif chosen.get("--optimizer") == "galore-8bit":
        parts["GaLore's projections"] = terms["GaLore's projections"]
    if world > 1:
        gathers = 1 if str(chosen.get("--reshard-after-forward")).lower() == "false" else 2
        parts["interconnect"] = gathers * terms["all-gather"] + terms["reduce-scatter"]
    return parts


def parts_text(parts, costs=None):
    """A step's seconds by part, the interconnect's with its rate where `costs` are given."""
    return ", ".join(f"{what} {seconds:.3g} s" + (f" at {costs.interconnect / 1e9:.3g} GB/s"
                                                    if costs and what == "interconnect" else "")
                     for what, seconds in parts.items())


def ordered(seconds=None):
    """CHAIN's links in GROUPS' order, and within a group by the `seconds` each adds to a step
    ({link name: seconds}, step_seconds' for a model); CHAIN's own order without them."""
    return sorted(CHAIN, key=lambda link: (link.group, (seconds or {}).get(link.name, 0)))


def sharded_links(costs=None, world_size=2):
    """SHARDED_CHAIN in GROUPS' order, and within a group by the seconds of its step at one
    micro-batch a GPU (its least: step_time) for `costs`; SHARDED_CHAIN's own order without."""
    def least(link):
        return sum(step_time(costs, link.sets, world_size).values()) if costs else 0
    return sorted(SHARDED_CHAIN, key=lambda link: (link.group, least(link)))


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
    why: str = ""  # why it and not the other chain, where sharding was weighed against one GPU


WEIGHT_BYTES = 2  # a parameter's bytes: the chain trains 10_combined.py's bfloat16 weights
STATE_BYTES = {"adam": 2 * WEIGHT_BYTES,  # Adam's two moments, in the weights' dtype
               "adamw-8bit": 2,           # two moments of one byte (more in tensors too small to quantize)
               "adamw-4bit": 1 + 8 / 128,  # two of half a byte, a float32 scale per 128 weights each
               # two of a byte for a quarter of a block matrix's narrower side: a floor (the
               # embeddings' and output layer's moments stay whole, 2 bytes a parameter)
               "galore-8bit": 0.5}


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
         searched=True, costs=None, parameters=0, host_capacity=None):
    """The first prefix of CHAIN whose run fits `batch_size` in `capacity`, searched (unless not
    `searched`) for its largest micro-batch per GPU, up to the batch; `base_argv`: the model's
    flags without --batch-size. With `world_size` above 1, SHARDED_CHAIN's links first (a fit
    keeping SHARDED_MARGIN free), and with `costs` (a Costs: the chain ordered by it) the
    quicker of the sharded answer and a one-GPU prefix (the module's docstring), the sharded
    answer searched to price it. Up to `jobs` prefixes are estimated at a time, in order; with
    the model's `parameters`, a prefix whose resident_bytes exceed its room is not."""
    run = Walk(script, base_argv, batch_size, world_size, capacity, gpu, report, jobs, host_capacity,
               Answer(parameters=parameters))
    chain = prefixes(task, costs and chain_seconds(costs.parameters, costs.tokens,
                                                   (costs.layers, costs.hidden, costs.vocabulary)))
    sharded = ([(link, list(link.sets), []) for link in sharded_links(costs, world_size)
                if task == "causal-lm" or not link.causal_lm_only] if world_size > 1 else [])
    if costs is None or not sharded:  # nothing to weigh: the first that fits, in order
        found = run.first_fit([*sharded, *chain])
        return run.answered(found and run.candidate(found, searched))
    found = run.first_fit(sharded)
    if found is None:  # no sharded link fits: the one-GPU chain, as on one GPU
        found = run.first_fit(chain)
        best = found and run.candidate(found, searched)
        if best:
            best["why"] = (f"no sharded link fits in {size_text(run.room(world_size))} "
                           f"({SHARDED_MARGIN:.0%} of --gpu-memory kept free)")
        return run.answered(best)
    best = run.candidate(found, True, costs)
    for link, switches, notes in sharded[after(sharded, found[0]):]:  # quicker in fewer micro-batches?
        if link.group != best["link"].group or least(costs, switches, world_size) >= best["total"]:
            break  # the rest cannot be quicker: ordered by their least
        other = run.first_fit([(link, switches, notes)])
        other = other and run.candidate(other, True, costs)
        if other and other["total"] < best["total"]:
            report(f"[stack] {link.name}: {other['total']:.3g} s a step, under {best['link'].name}'s "
                   f"{best['total']:.3g} s at the micro-batches each fits")
            best = other
    sharded_best, rest = best, chain

    def slower(link, switches):  # a one-GPU prefix that cannot be quicker is not estimated
        seconds = least(costs, switches, run.world(link))
        return seconds >= sharded_best["total"] and (
            f"not estimated: its step takes {seconds:.3g} s at the least, not under "
            f"{sharded_best['link'].name}'s {sharded_best['total']:.3g} s")
    while rest:  # the one-GPU chain's first prefix that fits in less time
        found = run.first_fit(rest, slower)
        if found is None:
            break
        other = run.candidate(found, True, costs)
        if other["total"] < best["total"]:
            best = other
            break
        report(f"[stack] {found[0].name}: fits, but its step takes {other['total']:.3g} s at the "
               f"micro-batches it fits, not under {best['total']:.3g} s")
        rest = rest[after(rest, found[0]):]
    best["why"] = why(best, sharded_best, chain, costs, world_size)
    return run.answered(best)


def least(costs, switches, world):
    """A step's seconds at one micro-batch a GPU: the least its switches can take."""
    return sum(step_time(costs, switches, world).values())


def after(entries, link):
    """The index past `link` in `entries` ((link, switches, notes))."""
    return next(index for index, (other, _, _) in enumerate(entries) if other is link) + 1


def why(best, sharded, chain, costs, world_size):
    """The answer's reason, when the sharded answer was weighed against the one-GPU chain."""
    def on(world):
        return f"on each of {world} GPUs" if world > 1 else "on one GPU"
    said = f"{best['total']:.3g} s a step {on(best['world_size'])} ({parts_text(best['seconds'], costs)})"
    if best is not sharded:
        return (f"{said}, against {sharded['total']:.3g} s for {sharded['link'].name} "
                f"{on(world_size)} ({parts_text(sharded['seconds'], costs)})")
    steps = [(least(costs, switches, world_size if link.sharded else 1), link.name,
              world_size if link.sharded else 1) for link, switches, _ in chain if switches is not None]
    seconds, name, world = min(steps)
    quicker = sum(1 for step, _, _ in steps if step < best["total"])
    return said + "; " + (f"every prefix of the one-GPU chain takes longer (the quickest: {name}, "
                          f"{seconds:.3g} s {on(world)})" if not quicker else
                          f"none of the {quicker} prefixes of the one-GPU chain that could take less "
                          "fits in less")


class Walk:
    """One walk's question, and its answer as it goes (answer.tried: each prefix tried)."""

    def __init__(self, script, base_argv, batch_size, world_size, capacity, gpu, report, jobs,
                 host_capacity, answer):
        self.script, self.base_argv, self.batch_size = script, base_argv, batch_size
        self.world_size, self.capacity, self.gpu = world_size, capacity, gpu
        self.report, self.jobs, self.host_capacity, self.answer = report, jobs, host_capacity, answer

    def world(self, link):
        return self.world_size if link.sharded else 1

    def room(self, world):
        """What a run on `world` GPUs may reserve: --gpu-memory, less SHARDED_MARGIN when sharded."""
        return int(self.capacity * (1 - SHARDED_MARGIN)) if world > 1 else self.capacity

    def planned(self, entries, slower=None):
        """Each entry (link, switches, notes) with its plan: (argv, world, micro-batch,
        accumulates) to estimate, or the words why not (None: skipped by the task)."""
        plans = []
        for link, switches, notes in entries:
            world = self.world(link)
            floor = switches is not None and resident_bytes(switches, self.answer.parameters, world)
            if switches is None:
                plan = None
            elif slower and slower(link, switches):
                plan = slower(link, switches)
            elif floor > self.room(world):
                plan = f"not estimated: its weights and optimizer state alone hold {size_text(floor)}"
            else:
                accumulates = ("--optimizer-in-backward", True) not in switches
                plan = ([*self.base_argv, *argv_of(switches)], world,
                        1 if accumulates else self.batch_size // world, accumulates)
            plans.append((link, switches, notes, plan))
        return plans

    def first_fit(self, entries, slower=None):
        """The first of `entries` whose run fits, as (link, switches, record, plan), or None;
        estimated up to `jobs` at a time, in order; `slower(link, switches)`: the words why one
        is not estimated, or False. Each is reported and added to answer.tried."""
        plans = self.planned(entries, slower)
        rows = [micro_row(self.script, plan[0], *plan[1:], self.gpu) for *_, plan in plans
                if isinstance(plan, tuple)]
        outcomes = in_order(estimated, rows, self.jobs, lambda: "during the stack's walk: no stack")
        for link, switches, notes, plan in plans:
            if not isinstance(plan, tuple):  # skipped by the task, its floor or its time (words)
                self.answer.tried.append((link, switches, notes, plan))
                if plan:
                    self.report(f"[stack] {link.name}: {plan}")
                continue
            argv, world, micro, accumulates = plan
            record, problem, took = next(outcomes)
            reserved = record and record["reserved_bytes"]
            self.answer.parameters = self.answer.parameters or (record or {}).get("parameter_count", 0)
            self.answer.tried.append((link, switches, notes, reserved if record else problem))
            room = (f" of {size_text(self.room(world))} (--gpu-memory less the sharded margin, "
                    f"{SHARDED_MARGIN:.0%})" if world > 1 else "")
            self.report(f"[stack] {link.name}: " + (f"{size_text(reserved)} reserved at micro-batch "
                                                    f"{micro}{room}" if record else f"failed: {problem}")
                        + f" ({took_text(took)})")
            if record is None or reserved > self.room(world) or self.batch_size % world:
                continue
            host = record["host_bytes"] * world  # the processes of one machine
            if self.host_capacity is not None and host > self.host_capacity:
                self.report(f"[stack] {link.name}: needs {size_text(host)} of host memory, above "
                            f"--host-memory ({size_text(self.host_capacity)})")
                self.answer.tried[-1] = (link, switches, notes, f"needs {size_text(host)} of host memory")
                continue
            outcomes.close()  # the later prefixes are not needed: their estimates stop
            return link, switches, record, plan
        return None

    def candidate(self, found, searched, costs=None):
        """A prefix that fits as an answer: its search's arguments, its Fit where `searched`, and
        with `costs` its step's seconds at the micro-batches it fits."""
        link, switches, record, (argv, world, micro, accumulates) = found
        task = (self.script, argv, world, self.room(world), accumulates,
                {micro: (record["allocated_bytes"], record["reserved_bytes"])}, self.gpu,
                self.batch_size // world, bytes_per_sample(record, micro))
        best = {"link": link, "switches": switches, "world_size": world, "search": task,
                "host_bytes": record["host_bytes"], "fit": None}
        if searched:
            best["fit"] = settle(("search", task), self.batch_size)
        if costs and best["fit"]:
            best["seconds"] = step_time(costs, switches, world, micro_batches(best["fit"]))
            best["total"] = sum(best["seconds"].values())
        return best

    def answered(self, best):
        """The answer, made of the candidate `best` (None: none fits)."""
        for name in ("link", "switches", "world_size", "search", "host_bytes", "fit", "why"):
            if best and name in best:
                setattr(self.answer, name, best[name])
        return self.answer


def micro_batches(fit):
    """The micro-batches a GPU runs a step, as command() splits the batch."""
    if not fit.accumulates:
        return 1
    return (fit.largest and accumulation_for(fit)) or fit.batch_size // fit.world_size


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
               costs=None, parameters=0, host_capacity=None):
    """The stack (walk, its chain ordered and weighed by `costs`, its prefixes floored by
    `parameters`) and the adapters' answers, their searches up to `jobs` at a time."""
    answer = walk(script, base_argv, batch_size, world_size, capacity, task, gpu, report, jobs,
                  searched=False, costs=costs, parameters=parameters, host_capacity=host_capacity)
    activation = activation_switches(answer)
    switch_sets = [[*activation, *adapter] for adapter in ADAPTERS]
    tasks = [("adapter", (script, [*base_argv, *argv_of(switches)], capacity, gpu,
                          " ".join(argv_of(switches)))) for switches in switch_sets]
    unsearched = answer.link is not None and answer.fit is None  # a weighed answer was searched
    if unsearched:
        tasks.insert(0, ("search", answer.search))
    fits = list(in_order(partial(settle, batch_size=batch_size), tasks, jobs,
                         lambda: "during the stack's searches: no stack"))
    if unsearched:
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


def chain_text(task, parameters, tokens, shape, world_size, interconnect=None):
    """The chain as printed: each link, what it sets or replaces, and its cost per step; where
    the cost model orders this model's chain otherwise than CHAIN, a line says so. With
    `world_size` above 1, the sharded links first, each with its step's seconds (step_time; the
    interconnect at `interconnect` bytes a second, COST's by default), and each one-GPU prefix's."""
    costs = Costs(parameters, tokens, *shape, interconnect=interconnect or COST["interconnect_bytes_per_s"])
    seconds = chain_seconds(parameters, tokens, shape)
    wire = f", interconnect {costs.interconnect / 1e9:.3g} GB/s" if world_size > 1 else ""
    lines = [f"The chain, cheapest first (cost model: {COST['gpu_flops'] / 1e12:.0f} TFLOP/s, "
             f"PCIe {COST['pcie_bytes_per_s'] / 1e9:.0f} GB/s, host {COST['host_bytes_per_s'] / 1e9:.0f} "
             f"GB/s{wire}; seconds added to a step of {tokens} tokens, a plain step "
             f"{6 * parameters * tokens / COST['gpu_flops']:.3g} s):"]
    if world_size > 1:
        lines.append(f"  sharded over {world_size} GPUs first (10_combined.py under "
                     f"torchrun --nproc_per_node={world_size}), quickest first: a step's seconds on "
                     f"each GPU, computing 1/{world_size} of the tokens, at one micro-batch a GPU; a "
                     f"fit keeps {SHARDED_MARGIN:.0%} of --gpu-memory free (SHARDED_MARGIN: the "
                     "estimate leaves out NCCL's own buffers):")
        listed = [link for link in sharded_links(costs, world_size)
                  if task == "causal-lm" or not link.causal_lm_only]
        for number, link in enumerate(listed, 1):
            parts = step_time(costs, link.sets, world_size)
            lines.append(f"  {number}. {link.name}: {' '.join(argv_of(link.sets)) or '(none)'}; "
                         f"{sum(parts.values()):.3g} s a step ({parts_text(parts)}); {link.cost}")
        lines.append("  then one GPU, answered instead where a prefix fits and its step (the "
                     "whole batch on one GPU) takes fewer seconds than the sharded answer's at the "
                     "micro-batches it fits:")
    group = None
    for number, (link, switches, notes) in enumerate(prefixes(task, seconds),
                                                     1 + (len(listed) if world_size > 1 else 0)):
        if link.group != group:
            group = link.group
            lines.append(f"  {GROUPS[group]}:")
        sets = " ".join(argv_of([(f, v) for f, v in link.sets if v is not REMOVE])) or "(none)"
        if link.sharded and world_size > 1:
            sets += f" under torchrun --nproc_per_node={world_size}"
        added = "" if switches is None else f" +{seconds[link.name]:.3g} s;"
        if switches is not None and world_size > 1:  # its whole step, to weigh against sharding's
            world = world_size if link.sharded else 1
            where = f" on each of {world} GPUs" if world > 1 else ""
            added = f"{added[:-1]}, a step {least(costs, switches, world):.3g} s{where};"
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
                 + peak_words(fit) + (f" ({fit.problem})" if fit.problem else "")
                 + (f" (a fit keeps {SHARDED_MARGIN:.0%} of it free when sharded: "
                    f"{size_text(fit.capacity)} at most)" if answer.world_size > 1 else ""),
                 "  " + command(model_argv, batch_size, answer.switches, fit, answer.world_size)]
        if answer.why:
            lines.append(f"  why: {answer.why}")
        if answer.host_bytes:  # what left the GPU (and its pinned blocks, rounded) is in host memory
            machine = (f", {size_text(answer.host_bytes * answer.world_size)} for the "
                       f"{answer.world_size} on one machine" if answer.world_size > 1 else "")
            offloaded = dict(answer.switches).get("--offload")
            held = ("the sharded weights, gradients and Adam's state" if offloaded
                    else "what its switches keep there")
            lines.append(f"  host memory: {size_text(answer.host_bytes)} a process ({held}, "
                         f"pinned blocks as the host allocator rounds them){machine}, beside the GPU's")
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
