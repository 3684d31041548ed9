"""The stack's cost model: the seconds a link adds to a step, and a step's seconds under a switch
set on one GPU or sharded over N, by the rates estimate/stack.py's COST assumes."""
from dataclasses import dataclass

from estimate.stack import CHAIN, COST, SHARDED_CHAIN, WEIGHT_BYTES


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
    mlp_parameters: int = 0  # the blocks' MLPs' (the tiled MLP runs them once more)
    length: int = 0  # a sequence's tokens: attention's FLOPs priced (0: not priced)


def rates(costs, world=1, micro_batches=1):
    """The cost model's terms, in seconds a step on each of `world` GPUs running 1/world of the
    tokens in `micro_batches` micro-batches, by COST (the links' and step_time's one home)."""
    parameters, tokens = costs.parameters, costs.tokens / world
    forward = 2 * parameters * tokens / COST["gpu_flops"]
    pcie = COST["pcie_bytes_per_s"]
    host_step = parameters * COST["adam_bytes_per_parameter"] / COST["host_bytes_per_s"]
    # one collective of the bfloat16 weights a micro-batch: each GPU moves (N-1)/N of them
    collective = micro_batches * WEIGHT_BYTES * parameters * (world - 1) / world / costs.interconnect
    # causal attention's two products, half of length x length each: 2 x length x hidden FLOPs
    # a token a layer, beside the weights' 2 x parameters
    attention = 2 * costs.length * tokens * costs.hidden * costs.layers / COST["gpu_flops"]
    # sequence parallel: four all-to-alls a block (query, key, value in, the output back; key and
    # value at most the hidden size) of each GPU's tokens, in forward, its recomputation and backward
    all_to_all = (3 * 4 * costs.layers * tokens * costs.hidden * WEIGHT_BYTES * (world - 1) / world
                  / costs.interconnect)
    return {"forward": forward + attention, "elementwise": COST["elementwise_forward"] * forward,
            "MLP forward": 2 * costs.mlp_parameters * tokens / COST["gpu_flops"],
            "activations over PCIe": 2 * costs.layers * tokens * costs.hidden * 2 / pcie,
            "4-bit step": parameters / world * COST["adamw_4bit_bytes_per_parameter"]
            / COST["gpu_bytes_per_s"],
            "GaLore's projections": parameters * costs.hidden * (
                1 / COST["gpu_flops"] + 26 / COST["galore_gap"] / COST["svd_flops"]),
            "optimizer on the host": 4 * parameters / pcie + host_step,
            "offload": (4 * micro_batches + 2) * parameters / world / pcie + host_step,
            "all-gather": collective, "reduce-scatter": collective, "all-to-all": all_to_all}


def step_seconds(link, parameters, tokens, layers, hidden, vocabulary, micro_batches=1):
    """The seconds the link adds to an optimizer step of `tokens` tokens, by COST."""
    return link_seconds(link, Costs(parameters, tokens, layers, hidden, vocabulary), micro_batches)


def link_seconds(link, costs, micro_batches=1):
    """The seconds the link adds to an optimizer step of `costs`' tokens, by COST."""
    terms = rates(costs, 1, micro_batches)
    return {"bf16": 0.0, "8-bit AdamW": 0.0, "optimizer in backward": 0.0, "fused loss": 0.0,
            "tiled MLP": terms["MLP forward"],
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
    backward) or once (ZeRO-2: --reshard-after-forward false), the gradients reduce-scattered,
    and under --sequence-parallel each block's all-to-alls; `costs.tokens` are the step's over all
    GPUs (a text split across them counts once)."""
    chosen, terms = dict(switches), rates(costs, world, micro_batches)
    checkpointing = chosen.get("--checkpointing")
    parts = {"compute": 3 * terms["forward"]}
    again = {"selective": "elementwise", "full": "forward", "offloaded": "forward"}
    if checkpointing in again:
        parts["recompute"] = terms[again[checkpointing]]
    if checkpointing == "offloaded":
        parts["activations over PCIe"] = terms["activations over PCIe"]
    if chosen.get("--mlp-tiles"):
        parts["MLP tiles"] = terms["MLP forward"]
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
        if chosen.get("--sequence-parallel"):
            parts["interconnect"] += terms["all-to-all"]
    return parts


def parts_text(parts, costs=None):
    """A step's seconds by part, the interconnect's with its rate where `costs` are given."""
    return ", ".join(f"{what} {seconds:.3g} s" + (f" at {costs.interconnect / 1e9:.3g} GB/s"
                                                    if costs and what == "interconnect" else "")
                     for what, seconds in parts.items())


def sharded_links(costs=None, world_size=2):
    """SHARDED_CHAIN in GROUPS' order, and within a group by the seconds of its step at one
    micro-batch a GPU (its least: step_time) for `costs`; SHARDED_CHAIN's own order without."""
    def least(link):
        return sum(step_time(costs, link.sets, world_size).values()) if costs else 0
    return sorted(SHARDED_CHAIN, key=lambda link: (link.group, least(link)))


def least(costs, switches, world):
    """A step's seconds at one micro-batch a GPU: the least its switches can take."""
    return sum(step_time(costs, switches, world).values())


def chain_seconds(parameters, tokens, shape):
    """{link name: seconds it adds to a step of `tokens` tokens} by COST, for a model of
    `parameters` and shape (layers, hidden, vocabulary)."""
    return {link.name: step_seconds(link, parameters, tokens, *shape) for link in CHAIN}


