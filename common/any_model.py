"""--model NAME_OR_DIR: any Hugging Face image or sequence classifier, or under --task causal-lm
any decoder, in place of a preset's model.

The model's config.json (in a local directory, in the Hugging Face cache, or on the Hub) names
its architecture, and so its task: an image classifier trains on the images of the preset, a
sequence classifier or a decoder on its texts (`tiny` and `tiny-text` unless --preset says
otherwise). The estimate needs only the config; training loads the pretrained weights where the
model has them (a Hub id, or a directory holding weights), and otherwise draws new ones, as
`tiny` does. Only --model imports this module (and transformers' tables of every architecture).
"""
import dataclasses
import functools
import json
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from common.hub import from_cache_when_offline, require_hub

# the files from_pretrained reads weights from, whole or in shards
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# what a config.json holds besides the architecture's arguments (the classes come from the data)
NOT_ARGUMENTS = ("_name_or_path", "transformers_version", "architectures", "model_type",
                 "id2label", "label2id", "num_labels", "problem_type", "torch_dtype", "dtype",
                 "auto_map")


# the attention code a config.json may ask for: what the GPU estimate knows how a GPU runs
# (sdpa: PyTorch's fused kernels, estimate/gpu_choices.py; eager: plain operators)
ATTENTION_EMULATED = ("sdpa", "eager")


class ModelProblem(ValueError):
    """What is wrong with the model a user named, in words that say what to do instead."""


def task_of(model_type):
    """"images" or "text": which classifier transformers has for this architecture (None if
    neither). Perceiver, the one architecture with both, is taken as text."""
    if model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return "text"
    if model_type in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "images"
    return None


def model_class_name(model_type, task="classification"):
    """The name of the transformers class that trains this architecture for `task`: the one that
    classifies (for example BertForSequenceClassification), or for causal-lm the one that
    predicts the next token (LlamaForCausalLM)."""
    if task == "causal-lm":
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
            or MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[model_type])


def decoder_problem(name_or_dir, config):
    """Why --task causal-lm cannot train this model (in words that say what to do), or None: it
    needs a decoder, an architecture transformers has a causal-LM class for that is not an encoder
    (BERT's and RoBERTa's causal-LM classes serve as the decoder half of an encoder-decoder)."""
    model_type = config.model_type
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
            model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(config, "is_decoder", False)):
        return None
    return (f"--model {name_or_dir}: --task causal-lm trains a decoder to predict each next token, "
            f"and a {model_type!r} model is not one (transformers has no causal language model of "
            "it that stands alone). Name a decoder (GPT-2, Llama, Mistral, Qwen2, BLOOM, ...), or "
            "leave --task out to train it as a classifier")


@functools.cache
def read_config(name_or_dir):
    """(config, has_weights) of a local model directory or a Hub id; a ModelProblem when there
    is none. A Hub id is looked up in the Hugging Face cache first, then on the Hub."""
    path = Path(name_or_dir).expanduser()
    if path.is_file() and path.name == "config.json":  # the file itself named: its folder
        path = path.parent
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelProblem(
                    f"--model {name_or_dir}: the directory has no config.json. Name a directory "
                    "that holds a Hugging Face model's config.json (its weights are optional), "
                    "or a Hub id such as google-bert/bert-base-uncased")
            try:
                json.loads((path / "config.json").read_text())
            except ValueError as error:  # (transformers would blame the Hub, not the file)
                raise ModelProblem(f"--model {name_or_dir}: its config.json is not valid JSON "
                                   f"({error}): fix or replace the file") from None
            config = AutoConfig.from_pretrained(path)
            return config, any((path / name).is_file() for name in WEIGHT_FILES)
        if path.exists() or name_or_dir.startswith((".", "/", "~")) or name_or_dir.count("/") > 1:
            raise ModelProblem(f"--model {name_or_dir}: no such directory. Name a directory that "
                               "holds a Hugging Face model's config.json, or a Hub id")
        try:
            return AutoConfig.from_pretrained(name_or_dir, local_files_only=True), True
        except OSError:  # not in the cache: ask the Hub
            pass
        what = f"the config of {name_or_dir}"
        require_hub(what)
        with from_cache_when_offline(what):
            return AutoConfig.from_pretrained(name_or_dir), True
    except StrictDataclassError as error:  # a config its own class refuses (heads, sizes)
        reason = str(error).strip().splitlines()[-1].strip().removeprefix("ValueError: ")
        raise ModelProblem(f"--model {name_or_dir}: its config.json is not one transformers can "
                           f"build a model of ({reason}): fix its config.json") from None
    except ValueError as error:  # an unknown model_type, or one that needs trust_remote_code
        if isinstance(error, ModelProblem):
            raise
        reason = str(error).splitlines()[0]
        raise ModelProblem(f"--model {name_or_dir}: transformers cannot build this architecture "
                           f"({reason}). The scripts train architectures that transformers "
                           "itself implements") from None
    except OSError as error:  # the Hub answered: no such repository, or no config in it
        reason = str(error).splitlines()[0]
        raise ModelProblem(f"--model {name_or_dir}: not a local directory, and the Hub has no "
                           f"config for it ({reason})") from None


def longest_sequence(config):
    """The most tokens the model has positions for (None when its positions are not bounded:
    rotary or ALiBi positions, as in BLOOM)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value - (2 if config.model_type in ("roberta", "xlm-roberta", "camembert")
                            else 0)  # RoBERTa's positions start after the padding index + 1
    return None


def extended_positions(name_or_dir, config, arguments, positions):
    """--max-positions: the config's `arguments` changed to give a model of rotary positions
    (Llama, Mistral, Qwen2) positions for `positions` tokens: max_position_embeddings raised and
    the rotary frequencies stretched by the same ratio (linear position interpolation, or the
    factor of the scaling a config has already multiplied, as for Llama 3.1's); returns the new
    maximum. A ModelProblem for learned or unbounded positions, and for a maximum not above the
    config's own."""
    longest, rope = longest_sequence(config), getattr(config, "rope_parameters", None)
    if longest is None or not isinstance(rope, dict):
        kind = "not bounded (ALiBi)" if longest is None else "a table of learned positions"
        raise ModelProblem(f"--max-positions {positions}: {name_or_dir}'s positions are {kind}, "
                           "and the flag stretches rotary positions only: leave it out")
    if positions <= longest:
        raise ModelProblem(f"--max-positions {positions}: {name_or_dir} has positions for "
                           f"{longest} tokens already: leave it out")
    rope = dict(rope)
    if rope.get("rope_type", "default") == "default":
        rope.update(rope_type="linear", factor=positions / longest)
    elif isinstance(rope.get("factor"), (int, float)):
        rope["factor"] *= positions / longest
    else:
        raise ModelProblem(f"--max-positions {positions}: {name_or_dir} scales its rotary "
                           f"positions by {rope['rope_type']!r}, which has no factor to stretch")
    arguments.update(max_position_embeddings=positions, rope_parameters=rope)
    return positions


def with_model(preset, name_or_dir, seq_len=None, image_size=None, num_labels=None,
               max_positions=None):
    """`preset` (its data, task, batch, epochs and learning rates) with the model `name_or_dir`,
    given `seq_len` tokens (text) or `image_size` pixels square (images) and `num_labels`
    classes; `max_positions`: positions extended to that many tokens (extended_positions)."""
    config, has_weights = read_config(name_or_dir)
    task = task_of(config.model_type)
    if preset.task == "causal-lm" and num_labels:
        raise ModelProblem(f"--num-labels {num_labels}: --task causal-lm predicts each next token "
                           "over the model's vocabulary, not classes: leave --num-labels out")
    if preset.task == "causal-lm":
        problem = decoder_problem(name_or_dir, config)
        if problem:
            raise ModelProblem(problem)
        task = "text"  # a decoder, with or without a classifier
    if task is None:
        raise ModelProblem(
            f"--model {name_or_dir}: a {config.model_type!r} model, for which transformers has "
            "no sequence or image classifier. The scripts train classifiers: architectures that "
            "AutoModelForSequenceClassification or AutoModelForImageClassification can build")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelProblem(
            f"--model {name_or_dir}: a {config.model_type!r} model is an encoder-decoder, whose "
            "classifier reads each text's last end-of-text token through its decoder; the "
            "scripts train encoders and decoders: name one (BERT, RoBERTa, GPT-2, Llama, ...)")
    heads, groups = (getattr(config, name, None) for name in ("num_attention_heads",
                                                               "num_key_value_heads"))
    if isinstance(heads, int) and isinstance(groups, int) and groups and heads % groups:
        raise ModelProblem(
            f"--model {name_or_dir}: its config has {heads} attention heads and {groups} "
            "key-value heads, and each key-value head serves an equal group of attention heads: "
            f"give it a num_key_value_heads that divides {heads}")
    arguments = {key: value for key, value in config.to_diff_dict().items()
                 if key not in NOT_ARGUMENTS}
    asked = getattr(config, "_attn_implementation_internal", None)  # "attn_implementation"
    if asked is not None:  # in config.json: the attention code it asks for (else transformers'
        if asked not in ATTENTION_EMULATED:  # default: sdpa where the architecture has it)
            raise ModelProblem(
                f"--model {name_or_dir}: its config asks for attn_implementation {asked!r}; the "
                f"scripts and their GPU estimate take {' or '.join(ATTENTION_EMULATED)} (remove "
                "the key for transformers' default)")
        arguments["attn_implementation"] = asked
    changes = dict(model=name_or_dir if has_weights else None,
                   tokenizer=name_or_dir if task == "text" else None,
                   architecture=config.model_type, config=arguments,
                   num_classes=num_labels or preset.num_classes)
    if task == "text":
        longest = longest_sequence(config)
        if max_positions:
            longest = extended_positions(name_or_dir, config, arguments, max_positions)
        if seq_len and longest and seq_len > longest:
            stretch = (f", or add --max-positions {seq_len} to stretch its rotary positions"
                       if isinstance(getattr(config, "rope_parameters", None), dict) else "")
            raise ModelProblem(f"--seq-len {seq_len}: {name_or_dir} has positions for "
                               f"{longest} tokens at most; ask for {longest} or fewer{stretch}")
        changes["max_length"] = seq_len or min(preset.max_length, longest or preset.max_length)
        if getattr(config, "pad_token_id", None) is None:  # GPT-2, Llama: no padding token, and
            eos = getattr(config, "eos_token_id", None)  # batches need one: end-of-text
            if eos is None:
                raise ModelProblem(
                    f"--model {name_or_dir}: its config names neither a padding token nor an "
                    "end-of-text token, and a classifier of padded text needs one to find each "
                    "sequence's end: add pad_token_id to its config.json")
            arguments["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    elif max_positions:
        raise ModelProblem(f"--max-positions {max_positions}: {name_or_dir} classifies images, "
                           "which have no sequence of positions: leave it out")
    else:
        vision = getattr(config, "vision_config", None) or config  # CLIP, SigLIP: the image tower's
        changes["image_size"] = image_size or getattr(vision, "image_size", None) or preset.image_size
        patch = getattr(vision, "patch_size", None)
        if isinstance(patch, int) and changes["image_size"] % patch:  # a remainder is dropped
            size, fits = changes["image_size"], max(patch, changes["image_size"] // patch * patch)
            raise ModelProblem(f"--image-size {size}: {name_or_dir} cuts each image into patches "
                               f"of {patch} x {patch} pixels, so its size must be a multiple of "
                               f"{patch}: ask for --image-size {fits}")
        if image_size and "image_size" in arguments:  # ViT's position embeddings follow it (new
            arguments["image_size"] = image_size       # ones, when pretrained ones do not fit)
        if image_size and isinstance(arguments.get("vision_config"), dict):  # CLIP's likewise
            arguments["vision_config"] = {**arguments["vision_config"], "image_size": image_size}
    return dataclasses.replace(preset, **changes)
