"""What a peak of memory holds: MemTracker's categories folded into the five this project reports,
and the model's state in bytes per parameter. Plain Python, so that reading a record needs no
tracker (the estimate answers a question it kept without importing one)."""

# MemTracker's categories, folded into the five this project reports
CATEGORIES = {
    "Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
    "Optstate": "optimizer_state", "Activation": "activations",
    "Temp": "temporaries", "Other": "temporaries",
    # FSDPMemTracker's (steps 07-09): shards and gathered copies, and the collectives' buffers
    "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "OptState": "optimizer_state",
    "Inputs": "activations", "All Gather": "temporaries", "Reduce Scatter": "temporaries",
}
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
MODEL_STATE_KEYS = BREAKDOWN_KEYS[:3]  # the model's state, what "bytes per parameter" counts


def model_state_bytes_per_parameter(breakdown, parameters_held):
    """Parameters (with the model's buffers), gradients and optimizer state at the peak, in bytes
    per parameter a process holds: all of the model's, or its 1/N share when N processes shard
    it. So float32 Adam holds 16 once all its gradients exist (4 + 4 + 8), whatever N; gathered
    copies of sharded weights add to it. None without parameters."""
    if not parameters_held:
        return None
    return sum(breakdown[key] for key in MODEL_STATE_KEYS) / parameters_held


def fold_breakdown(stats):
    """{category: bytes} of MemTracker's categories, as the five BREAKDOWN_KEYS."""
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for name, nbytes in stats.items():
        if name in CATEGORIES:
            breakdown[CATEGORIES[name]] += nbytes
    return breakdown
