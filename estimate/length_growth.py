"""Tensors that grow with the length squared, found by comparing runs at two lengths.

A decoder given a padded batch builds an attention mask of length x length (common/data.py pads
each text; --pack does not); attention written in a model's own code (BLOOM's) makes scores of
that size, and so does scaled_dot_product_attention's math path (gpu_choices.py): at 500K tokens
one such tensor of one byte an element is 250 GB. A fake run of the script at the --seq-len
asked and one at about half of it are watched (a TorchFunctionMode) for tensors that a function
makes with two dimensions equal to the run's length, neither broadcast (a stride of 0 holds no
memory); made by the same function at the same dimensions in both runs, such a tensor grows with
the length squared, and is reported with its size at the length asked. Each run is of one period
of the model's blocks (shortcuts/blocks.py) where the model can be cut so, else of the whole model: the
tensors are the same in every period. A script's --estimate with --seq-len reports them.
"""
import argparse
from dataclasses import dataclass
from functools import partial

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from estimate.fake.run import run_on_fake_tensors
from estimate.gpu_choices import DEFAULT_GPU
from estimate.records import size_text
from estimate.shortcuts.blocks import cut_for_probe
from estimate.shortcuts.synthesis import NotByBlocks


@dataclass(frozen=True)
class Square:
    """A tensor with two dimensions that grow with the length: the function that made it, the
    positions of those dimensions, and at the length asked its shape, dtype and bytes."""
    function: str
    dims: tuple
    shape: tuple
    dtype: str
    bytes: int

    def words(self, length):
        return (f"{self.function}: {self.dtype} {tuple(self.shape)}, {size_text(self.bytes)} at "
                f"{length:,} tokens")


class LengthWatch(TorchFunctionMode):
    """While inside: every tensor a torch function makes (not a view of another, not one of its
    inputs given back) with two or more dimensions of `length` elements, not broadcast, by
    (function, dimensions): the largest seen."""

    def __init__(self, length):
        super().__init__()
        self.length, self.found = length, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(arg) for arg in tree_leaves((args, kwargs)) if isinstance(arg, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in given and tensor._base is None:
                self.note(getattr(func, "__name__", repr(func)), tensor)
        return out

    def note(self, name, tensor):
        try:
            strides = tensor.stride()
        except RuntimeError:  # (a layout without strides)
            return
        dims = tuple(index for index, (size, stride) in enumerate(zip(tensor.shape, strides))
                     if size == self.length and stride != 0)
        if len(dims) < 2:
            return
        size = tensor.untyped_storage().nbytes()
        if size > self.found.get((name, dims), (None, None, -1))[2]:
            self.found[name, dims] = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                                      size)


def asked_length(argv):
    """The run's --seq-len, or None."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--seq-len", type=int)
    return parser.parse_known_args(argv)[0].seq_len


def at_length(argv, length):
    """`argv` with its --seq-len (every one given) set to `length`."""
    flags = [arg for arg in argv if not arg.startswith("--seq-len=")]
    return [str(length) if index and flags[index - 1] == "--seq-len" else arg
            for index, arg in enumerate(flags)] + ([] if "--seq-len" in flags
                                                   else ["--seq-len", str(length)])


def watched(script, argv, length, world_size, gpu):
    """{(function, dimensions): (shape, dtype, bytes)} of a run at `length`: one period of the
    model's blocks where it can be cut so, else the whole model."""
    watch = LengthWatch(length)
    try:
        with watch:
            run_on_fake_tensors(script, at_length(argv, length), world_size, gpu,
                                cut=partial(cut_for_probe, periods_kept=1))
    except NotByBlocks:  # too few blocks to cut, or an architecture not cut: the whole model
        watch = LengthWatch(length)
        with watch:
            run_on_fake_tensors(script, at_length(argv, length), world_size, gpu)
    return watch.found


def squares(script, argv, world_size=1, gpu=DEFAULT_GPU):
    """[Square] of the run `argv` asks for (its --seq-len, of 4 tokens or more): the tensors with
    two dimensions of the length, seen at about half the length too (one more than half: an odd
    number where the length is even, which no width of a model is, so that two dimensions of a
    model's own widths are not taken for the length's in both runs; under --sequence-parallel
    the next multiple of the processes past half, as each takes an equal slice); largest first."""
    length = asked_length(argv)
    if not length or length < 4:
        return []
    slices = world_size if "--sequence-parallel" in argv else 1
    asked, half = (watched(script, argv, size, world_size, gpu)
                   for size in (length, (length // 2 // slices + 1) * slices))
    return sorted((Square(name, dims, *asked[name, dims]) for name, dims in asked
                   if (name, dims) in half), key=lambda square: -square.bytes)


def report(script, argv, world_size=1, gpu=DEFAULT_GPU):
    """The lines a script's --estimate prints of squares()."""
    try:
        found = squares(script, argv, world_size, gpu)
    except Exception as error:  # noqa: BLE001 - the estimate stands without the check
        return [f"length x length         not checked ({type(error).__name__}: {error})"]
    if not found:
        return ["length x length         none (no tensor with two dimensions of the length)"]
    length = asked_length(argv)
    return ["length x length         tensors with two dimensions of the length, each growing as "
            "its square (seen at about\n                        half the length too):",
            *(f"  {square.words(length)}" for square in found),
            "  a long run packs its texts (--pack: no attention mask) and runs flash attention "
            "(half types, 8.0 on)"]
