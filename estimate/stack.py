"""`python -m estimate --gpu-memory SIZE` ends with the stack: the first prefix of a chain of
the combined script's switches, cheapest first, whose run fits the asked batch in SIZE, the
largest micro-batch it fits (the search on 10_combined.py) and the command that runs it. Its walk
(search/walk.py) and cost model (search/costs.py) read the chain from here.

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
apart, with the activation switches of the answer. With several GPUs SHARDED_CHAIN's links,
each a whole switch set, come first.
"""
from dataclasses import dataclass

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
# CPU is counted, and 2-process CPU runs equal their estimates: tests/scripts/test_distributed.py); no
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

# --longest-sequence's chain (search/longest.py): CHAIN with the tiled MLP (05l), which only a long
# sequence needs (at the lengths the batch search asks about it makes one tile), placed by its
# cost like every link; without 4-bit AdamW, whose step on fake tensors is a Python loop over
# pieces of every weight (minutes an estimate for an 8B model on 2 cores, and a length search
# makes several), while the links after it take the state off the GPU altogether; and the
# weights' offload keeping the fused loss, the tiles and the checkpoints (10_combined.py takes
# them beside sharding), a long run's three pieces
TILED_MLP = Link("tiled MLP", (("--mlp-tiles", "auto"),),
                 "each block's MLP a tile of the sequence at a time, each tile's forward again in "
                 "backward: one more forward of the MLPs (2 x their parameters FLOPs a token)",
                 causal_lm_only=True)
LONG_CHAIN = (*[link for link in CHAIN if link.name not in ("4-bit AdamW", "offload")], TILED_MLP,
              Link("offload", (("--offload", True), ("--optimizer", REMOVE),
                               ("--optimizer-in-backward", REMOVE), ("--optimizer-on-host", REMOVE),
                               ("--gradients-to-host", REMOVE)),
                   "the weights up twice per micro-batch, gradients down (6 bytes a parameter) "
                   "and Adam on the host", group=4, sharded=True, gives_back="Adam again"))

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
# --longest-sequence with several GPUs (--world-size N above 1; search/longest.py): each link a
# whole switch set under torchrun, walked in this order: every GPU a whole text of its own (FSDP
# ZeRO-3 with the long chain's three exact pieces), then each text split across the GPUs
# (sequence parallelism, 08a, with the fused loss of each slice), its checkpoints in host memory,
# then the weights and Adam there too.
LONG_SHARDED_CHAIN = (
    Link("FSDP ZeRO-3, fused loss, full checkpointing, tiled MLP",
         (("--loss", "fused"), ("--checkpointing", "full"), ("--mlp-tiles", "auto")),
         "every GPU a whole text: as FSDP ZeRO-3 with full checkpointing and the MLP's tiles",
         sharded=True, causal_lm_only=True),
    Link("sequence parallel, fused loss, full checkpointing, tiled MLP",
         (("--sequence-parallel", True), ("--loss", "fused"), ("--checkpointing", "full"),
          ("--mlp-tiles", "auto")),
         "each text split across the GPUs, attention over all of it for 1/N of the heads: four "
         "all-to-alls a block in forward, its recomputation and backward, besides FSDP ZeRO-3's",
         sharded=True, causal_lm_only=True),
    Link("sequence parallel, fused loss, offloaded checkpointing, tiled MLP",
         (("--sequence-parallel", True), ("--loss", "fused"), ("--checkpointing", "offloaded"),
          ("--mlp-tiles", "auto")),
         "as the one before, and each block's input over PCIe out and back", group=3,
         sharded=True, causal_lm_only=True),
    Link("sequence parallel, fused loss, offloaded checkpointing, tiled MLP, offload",
         (("--sequence-parallel", True), ("--loss", "fused"), ("--checkpointing", "offloaded"),
          ("--mlp-tiles", "auto"), ("--offload", True)),
         "as the one before, and the weights' shards up twice per micro-batch, gradients down "
         "and Adam on the host", group=4, sharded=True, causal_lm_only=True),
)
ADAPTERS = ((("--lora-rank", "8"),), (("--lora-rank", "8"), ("--qlora", True)))
ACTIVATION_FLAGS = ("--loss", "--checkpointing")
WEIGHT_BYTES = 2  # a parameter's bytes: the chain trains 10_combined.py's bfloat16 weights
STATE_BYTES = {"adam": 2 * WEIGHT_BYTES,  # Adam's two moments, in the weights' dtype
               "adamw-8bit": 2,           # two moments of one byte (more in tensors too small to quantize)
               "adamw-4bit": 1 + 8 / 128,  # two of half a byte, a float32 scale per 128 weights each
               # two of a byte for a quarter of a block matrix's narrower side: a floor (the
               # embeddings' and output layer's moments stay whole, 2 bytes a parameter)
               "galore-8bit": 0.5}


def resident_bytes(switches, parameters, world_size=1):
    """A floor under a prefix's peak: the weights, their gradients and the optimizer's state,
    which are all held at once when the optimizer steps (no gradients held whole under
    --optimizer-in-backward or --gradients-to-host, no state under --optimizer-on-host, neither
    under --offload; a `world_size`-th of them when sharded). Under ZeRO-2
    (--reshard-after-forward false) every weight is gathered whole at the end of forward, when a
    micro-batch's gradient shards need not exist yet: whole weights and the shards of weights and
    state, which outweigh the step's shards. A prefix whose floor exceeds the GPU is not
    estimated."""
    chosen = dict(switches)
    if chosen.get("--offload"):
        return 0
    state = 0 if chosen.get("--optimizer-on-host") else STATE_BYTES[chosen.get("--optimizer", "adam")]
    if world_size > 1 and chosen.get("--reshard-after-forward") == "false":
        return parameters * WEIGHT_BYTES + parameters * (WEIGHT_BYTES + state) // world_size
    held = 0 if chosen.get("--optimizer-in-backward") or chosen.get("--gradients-to-host") else WEIGHT_BYTES
    return parameters * (WEIGHT_BYTES + held + state) // world_size


def ordered(seconds=None, chain=CHAIN):
    """`chain`'s links in GROUPS' order, and within a group by the `seconds` each adds to a step
    ({link name: seconds}, step_seconds' for a model); the chain's own order without them."""
    return sorted(chain, key=lambda link: (link.group, (seconds or {}).get(link.name, 0)))


def prefixes(task, seconds=None, chain=CHAIN):
    """[(link, switches as [(flag, value)], notes)] for each prefix of `chain`, in order (by
    `seconds`: see ordered()); notes say what a link skipped or replaced."""
    out, current = [], {}
    for link in ordered(seconds, chain):
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


