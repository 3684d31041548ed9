"""What particular models and libraries need from a technique's code that is not the technique:
kept here, so that a script's diff shows its technique and nothing else. Each says who uses it."""
import torch

# what some decoders do after their output layer (Gemma 2 caps the logits, Cohere and Granite
# scale them, mixture-of-experts models add a router loss), which a loss computed from the
# output layer's logits alone would leave out
AFTER_THE_OUTPUT_LAYER = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                          "output_router_logits")


class BlockWrapper(torch.nn.Module):
    """A module around a transformer block, `self.block`, that answers for the block what the
    model reads of its blocks (ModernBERT reads each block's `attention_type`). The checkpointed
    blocks of 05c-05e and 09 are such wrappers."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "block":  # not wrapped yet (a copy being made): nothing to read through
                raise
            return getattr(self.block, name)


def check_plain_output_layer(config, instead):
    """Stop with a message if the model's loss is more than cross-entropy over its output layer's
    logits (its config sets one of AFTER_THE_OUTPUT_LAYER), which is all 05g's chunked loss
    computes; `instead` says what to train it with."""
    changed = [name for name in AFTER_THE_OUTPUT_LAYER
               if getattr(config, name, None) not in (None, False, 1, 1.0)]
    if changed:
        raise SystemExit(f"error: this model's config sets {', '.join(changed)}: its loss is more "
                         "than cross-entropy over its output layer, which the chunked loss "
                         f"computes. {instead}")


def check_output_layer_without_bias(model, instead):
    """Stop with a message if the model's output layer adds a bias (Phi's, GPT-J's and CodeGen's
    do), which 05h's fused loss, its logits hidden @ weight.T, leaves out; `instead` says what
    to train it with."""
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise SystemExit("error: this model's output layer adds a bias, which the fused loss "
                         f"leaves out. {instead}")


def check_block_mlp(blocks, instead):
    """Stop with a message unless every block calls an `mlp` module (Llama's, Mistral's, Qwen2's,
    GPT-2's, BLOOM's ...), which 05l's tiled MLP runs on pieces of the sequence; blocks that
    compute their feed-forward layers themselves (OPT's fc1 and fc2) have none. `instead` says
    what to train the model with."""
    if not all(isinstance(getattr(block, "mlp", None), torch.nn.Module) for block in blocks):
        raise SystemExit("error: this model's blocks have no `mlp` module (their feed-forward "
                         f"layers are the block's own), which the tiled MLP runs in pieces. {instead}")


def keep_training_layout(four_bit):
    """Keep a bitsandbytes Linear4bit (07b) in the layout its training path reads: on CPUs with
    AVX512-BF16, bitsandbytes 0.50 repacks the weight for inference at the first evaluation, for
    good, into a layout its backward cannot read (and that small layers cannot take)."""
    four_bit.support_avx512bf16_for_cpu = False
    return four_bit
