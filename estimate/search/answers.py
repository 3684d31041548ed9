"""The searches' answers in words: the table of what fits in --gpu-memory, the chain with its
seconds, and the stack's answer with the command that runs it."""
from estimate.output import size_text
from estimate.search.costs import Costs, chain_seconds, least, parts_text, sharded_links, step_time
from estimate.search.fit import accumulation_for
from estimate.stack import CHAIN, COST, GROUPS, REMOVE, SHARDED_MARGIN, argv_of, ordered, prefixes


def command(model_argv, batch_size, switches, fit, world_size):
    """The command that runs the answer."""
    launch = (f"torchrun --nproc_per_node={world_size} 10_combined.py" if world_size > 1
              else "python 10_combined.py")
    words = [launch, *model_argv, "--batch-size", str(batch_size)]
    steps = (accumulation_for(fit) or batch_size // world_size) if fit.accumulates else 1
    if steps > 1:  # 1: the script's default, left out
        words += ["--accum-steps", str(steps)]
    return " ".join([*words, *argv_of(switches)])


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
    if answer.fit is None and answer.estimated and len(answer.failures) == answer.estimated:
        lines = [f"The stack: no answer for batch {batch_size}: every estimate of the chain failed, "
                 f"the first ({answer.failures[0]})"]
    elif answer.fit is None:
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
    adapters = adapters_text(adapter_answers)
    return "\n".join([*lines, adapters] if adapters else lines)


def adapters_text(adapter_answers):
    """The adapters' line of the stack's answer ("" without them)."""
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
    return "with adapters (they train something else): " + "; ".join(words) if words else ""


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


def fit_words(fit):
    """The table cell for the largest batch that fits."""
    if fit.not_searched:
        return "not searched (see the note)"
    if fit.problem and fit.largest is None:
        return "search failed (see the note)"
    if fit.largest is None:
        return "not even 1 sample"
    more = "+" if fit.capped else ""  # the search stopped at MAX_MICRO_BATCH
    if not fit.accumulates:
        return f"batch {fit.largest * fit.world_size}{more}"
    words = f"micro-batches of {fit.largest}{more}" + (" per GPU" if fit.world_size > 1 else "")
    steps = accumulation_for(fit)
    if steps:
        words += f"; batch {fit.batch_size} as --accum-steps {steps}"
    return words


def fit_table(fits, size):
    """The Markdown table of the search: does the asked batch fit, and what is the most that does."""
    lines = [f"Fits in --gpu-memory {size}: predicted max_memory_reserved at most {size} "
             "(the CUDA context, a few hundred MB that PyTorch does not count, comes on top)",
             "",
             "| script | asked | reserved | fits? | largest that fits | estimates |",
             "|---|---|---:|---|---|---:|"]
    for fit in fits:
        asked = (f"batch {fit.batch_size}" + (f", {fit.world_size} GPUs" if fit.world_size > 1
                                              else "")) if fit.batch_size else ""
        reserved = size_text(fit.asked_reserved) if fit.asked_reserved is not None else ""
        fits_now = ("" if fit.asked_reserved is None else
                    "yes" if fit.asked_reserved <= fit.capacity else "no")
        lines.append(f"| {fit.script} | {asked} | {reserved} | {fits_now} | {fit_words(fit)} "
                     f"| {len(fit.tried)} |")
    return "\n".join(lines)
