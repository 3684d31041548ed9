"""The Vision Transformer: built from a ViTConfig (tiny) or loaded pretrained (article)."""
import torch
from transformers import ViTConfig, ViTForImageClassification

from common.hub import from_cache_when_offline, require_hub


def vit_config(preset):
    return ViTConfig(**preset.vit, num_labels=preset.num_classes)


def create_model(preset, dtype=torch.float32):
    """A ViT classifier whose parameters are created in `dtype` on the default device.

    The default device is the CPU unless the caller sets another, as step 06 does with
    `with torch.device(device):`; pretrained weights are then loaded straight onto it.
    """
    if preset.model is None:  # train from scratch
        return ViTForImageClassification._from_config(vit_config(preset), dtype=dtype)
    require_hub(f"the pretrained model {preset.model}")
    with from_cache_when_offline(f"the pretrained model {preset.model}"):
        return ViTForImageClassification.from_pretrained(
            preset.model, num_labels=preset.num_classes, ignore_mismatched_sizes=True,  # new head
            dtype=dtype, device_map=torch.get_default_device())  # with its index: cuda:N, not "cuda"


def transformer_blocks(model):
    """The list of transformer blocks (its attribute moved between transformers versions)."""
    vit = model.vit
    return vit.layers if hasattr(vit, "layers") else vit.encoder.layer
