"""What the numbered scripts import: one job per module, the same in every script.

cli, presets, data, hub, model, memory, distributed, evaluate, progress, summary and
atomic_write are all a copied script needs (README: "Copying a script"). Two larger tools live
in subpackages that no script imports at the top: `common.estimate` (predicts GPU memory on fake
tensors; loaded only for --estimate) and `common.tour` (runs every step and draws the report).
"""
