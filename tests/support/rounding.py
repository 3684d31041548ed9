"""Tolerances for comparing floating-point results, from what rounding can produce.

Two computations that differ only in the order of their additions (micro-batches against one
batch, one process against two, another CPU's kernels) agree only as far as rounding lets them.
A sum of n terms computed in floating point, in any order, is within gamma(n) * sum(|term|) of
the exact sum, where gamma(n) = n*u / (1 - n*u) and u is the unit roundoff (2**-24 for float32):
Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2. Two such
computations of one sum are therefore within twice that of each other, and the tolerance scales
with the size of the summed terms, not with the result (which cancellation can make small) and
not with the error one machine happened to show.

A network's result is sums of products of earlier sums, so the count n used here is the longest
chain of additions one output element goes through: the samples and tokens a reduction over the
batch adds, plus, for each layer it passes, the widest inner dimension of that layer's products
(each layer's rounding is carried forward relative to its size). That is a bound, not an
estimate: observed differences are far below it, and a real fault (a micro-batch dropped, a loss
scaled twice, a gradient not averaged) is far above it.
"""
import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def gamma(n, dtype=torch.float32):
    """Higham's gamma_n: the relative bound on rounding in a sum of n terms."""
    u = UNIT_ROUNDOFF[dtype]
    if n * u >= 1:
        raise ValueError(f"{n} additions in {dtype} can lose every digit: no bound to test against")
    return n * u / (1 - n * u)


def additions(config, reduced_terms):
    """The longest chain of additions in a forward and backward pass of a transformers model with
    `config`: `reduced_terms` (samples x tokens that a gradient adds over the batch) plus, for
    each block and the embedding and head around them, the widest inner dimension."""
    widths = [getattr(config, name, 0) or 0 for name in
              ("hidden_size", "intermediate_size", "dim", "hidden_dim", "n_embd")]
    layers = next((getattr(config, name) for name in ("num_hidden_layers", "n_layers", "n_layer")
                   if getattr(config, name, None)), 1)
    return reduced_terms + (layers + 2) * max(widths)


def assert_same_sum(actual, expected, magnitude, n, dtype=torch.float32, what=""):
    """`actual` and `expected`, two computations of one sum of terms whose absolute values add up
    to `magnitude` (element by element, or one number), agree within 2 * gamma(n) * magnitude."""
    bound = 2 * gamma(n, dtype) * torch.as_tensor(magnitude, dtype=torch.float64)
    difference = (actual.double() - expected.double()).abs()
    excess = difference - bound
    if (excess > 0).any():
        worst = int(excess.flatten().argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {difference.numel()} elements differ by more "
            f"than rounding can explain; worst {difference.flatten()[worst]:.3g} against a bound "
            f"of {bound.expand_as(difference).flatten()[worst]:.3g} (2 gamma({n}) x the summed "
            f"terms' size {torch.as_tensor(magnitude).expand_as(difference).flatten()[worst]:.3g})")
