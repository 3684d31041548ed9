"""Data sets as `datasets.Dataset`s and the loaders that batch them.

A batch is the model's inputs (a dict: `pixel_values`, or `input_ids` and `attention_mask`) and the
labels: one class per sample, or under --task causal-lm one token per position. tiny:
scikit-learn's handwritten digits (1,797 8x8 grey images, shipped inside the package), resized to
32x32 RGB. article: CIFAR-10 from the Hub at 224x224, split 45k/5k/10k as in the study. tiny-text:
10,568 Rotten Tomatoes snippets rated positive or negative by people (from a package on PyPI),
tokenized to the preset's length. imdb: the 50,000 IMDb movie reviews from the Hub, split
35k/5k/10k as in the LLM study. --data synthetic: random inputs and labels of the preset's shapes
(images, or token ids at the full --seq-len, the last one padding), for measuring memory where
the data cannot be fetched; what a model learns from them means nothing. --pack (causal-lm): the
texts end to end, cut into sequences of the full length, with no padding and no attention mask.
"""
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from common.hub import from_cache_when_offline, require_hub
from common.packaged import Packaged, fetch
from common.presets import MOVIE_SNIPPETS, SYNTHETIC
from common.progress import is_main_process

SPLIT_SEED = 0  # the train/validation/test split never depends on --seed
IGNORED = -100  # a label the loss leaves out (padding, under --task causal-lm): transformers' own
# train, validation and test samples of each preset's data set
DIGITS_SPLITS = (1257, 180, 360)  # scikit-learn's 1,797 digits
CIFAR10_SPLITS = (45000, 5000, 10000)  # the study's: 5,000 of CIFAR-10's training images validate
SNIPPET_SPLITS = (1600, 500, 2000)  # 6,468 snippets unused
IMDB_SPLITS = (35000, 5000, 10000)  # the LLM study's: IMDb's train and test halves, joined
SYNTHETIC_SPLITS = (256, 64, 64)  # --data synthetic: drawn when read, none held
# a tokenizer's vocabulary, in one of the forms transformers saves it
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")


@dataclass
class Data:
    train: DataLoader
    val: DataLoader
    test: DataLoader


def load_digits():
    """scikit-learn's 1,797 digits, (8x8 grey levels from 0 to 16, their labels), read from the
    file its package ships as its own load_digits() reads it, without importing scikit-learn
    (1.4 s on 2 cores)."""
    package = importlib.util.find_spec("sklearn")
    if package is None:
        raise SystemExit("error: the tiny preset's digits ship inside scikit-learn, which is not "
                         "installed: pip install -r requirements.txt")
    table = np.loadtxt(Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz",
                       delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def digits_datasets(image_size=32):
    """Train/validation/test splits (DIGITS_SPLITS) of scikit-learn's digits."""
    import datasets

    grey, labels = load_digits()
    images = torch.tensor(grey, dtype=torch.float32).unsqueeze(1) / 16.0  # [0, 1]
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                           align_corners=False)
    images = (images * 2 - 1).expand(-1, 3, -1, -1)  # RGB in [-1, 1], as ViT expects
    # fixed-shape Array3D features make batched reads fast (nested lists are ~10x slower)
    features = datasets.Features({
        "pixel_values": datasets.Array3D((3, image_size, image_size), "float32"),
        "label": datasets.Value("int64")})
    full = datasets.Dataset.from_dict(
        {"pixel_values": images.numpy(), "label": labels}, features=features)
    full = full.with_format("torch")
    rest_test = full.train_test_split(test_size=DIGITS_SPLITS[2], seed=SPLIT_SEED)
    train_val = rest_test["train"].train_test_split(test_size=DIGITS_SPLITS[1], seed=SPLIT_SEED)
    return train_val["train"], train_val["test"], rest_test["test"]


def cifar10_datasets(name, image_size=224):
    """Train/validation/test splits (CIFAR10_SPLITS) of CIFAR-10, resized on the fly."""
    import datasets

    require_hub(f"the data set {name}")
    with from_cache_when_offline(f"the data set {name}"):
        cifar = datasets.load_dataset(name)
    train_val = cifar["train"].train_test_split(test_size=CIFAR10_SPLITS[1], seed=SPLIT_SEED)

    def to_tensors(batch):
        arrays = [np.asarray(img.convert("RGB").resize((image_size, image_size)), dtype=np.float32)
                  for img in batch["img"]]
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0
        return {"pixel_values": pixels, "label": torch.tensor(batch["label"])}

    splits = train_val["train"], train_val["test"], cifar["test"]
    for split in splits:
        split.set_transform(to_tensors)
    return splits


def tokenizer_for(preset):
    """The model's own tokenizer: from its package, its directory (--model DIR) or the Hub,
    padding with the token the model's config names (else, as GPT-2's, its end-of-text)."""
    from transformers import AutoTokenizer

    source = preset.tokenizer or preset.model
    if isinstance(source, Packaged):
        # every file of the package but the weights
        needed = [name for name in source.members.values() if not name.endswith(".safetensors")]
        tokenizer = AutoTokenizer.from_pretrained(fetch(source, needed))
    elif Path(source).is_dir():
        # without its vocabulary files transformers would build an empty tokenizer, silently
        if not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
            raise SystemExit(f"--model {source}: the directory holds no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}). Training on text needs the model's "
                             "tokenizer files beside its config.json; --estimate needs only the "
                             "config")
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        require_hub(f"the tokenizer of {source}")
        with from_cache_when_offline(f"the tokenizer of {source}"):
            tokenizer = AutoTokenizer.from_pretrained(source)
    # the classifier reads each sequence's last token as the one before its first padding token
    # (config.pad_token_id): the tokenizer must pad with that very token (Llama-3's config lists
    # several end-of-text ids, Qwen2.5's tokenizer pads with another token than the config's)
    pad_id = preset.config.get("pad_token_id")
    if pad_id is not None and tokenizer.pad_token_id != pad_id:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad_id)
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def say_truncated(texts, tokenizer, max_length):
    """Say, once, how many texts are longer than the model is given (they are truncated)."""
    longer = sum(len(ids) > max_length for ids in tokenizer(texts)["input_ids"])
    if longer and is_main_process():
        print(f"{longer} of {len(texts)} texts are longer than {max_length} tokens: truncated "
              f"to {max_length}")


def tokenized(texts, labels, tokenizer, max_length, task="classification"):
    """A Dataset of token ids, attention masks (1 for a token, 0 for padding) and labels, every
    sequence padded or truncated to `max_length`. For causal-lm the labels are the tokens
    themselves, IGNORED where padding is: the model shifts them by one (each position predicts
    the next token) and leaves IGNORED out of its loss, as supervised finetuning does."""
    import datasets

    # causal-lm: padded on the right (as a tokenizer that pads left, BLOOM's, would not), so each
    # text starts at position 0 and no token comes after padding (08a's attention has no mask)
    side = "right" if task == "causal-lm" else None
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length,
                        padding_side=side)
    sequence = datasets.Sequence(datasets.Value("int64"), length=max_length)
    if task == "causal-lm":
        labels = [[token if real else IGNORED for token, real in zip(ids, mask)]
                  for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
    features = datasets.Features({"input_ids": sequence, "attention_mask": sequence,
                                  "label": sequence if task == "causal-lm"
                                  else datasets.Value("int64")})
    return datasets.Dataset.from_dict(
        {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
         "label": labels}, features=features).with_format("torch")


def packed(texts, tokenizer, max_length):
    """--pack: a Dataset of token ids, the texts end to end (each as the tokenizer encodes it
    alone, with its own start and end tokens) cut into sequences of `max_length`, the rest
    dropped; the labels are the tokens. No padding, so no attention mask: transformers then asks
    scaled_dot_product_attention for causal attention (is_causal) and builds no mask, and each
    token attends to every earlier token of its sequence, across the texts' ends."""
    import datasets

    tokens = [token for ids in tokenizer(texts)["input_ids"] for token in ids]
    ids = [tokens[start:start + max_length]
           for start in range(0, len(tokens) - max_length + 1, max_length)]
    sequence = datasets.Sequence(datasets.Value("int64"), length=max_length)
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "label": ids},
        features=datasets.Features({"input_ids": sequence, "label": sequence})).with_format("torch")


def movie_snippet_datasets(preset):
    """Train/validation/test splits (SNIPPET_SPLITS) of the Rotten Tomatoes snippets: label 1
    where people rated a snippet above 0 on average (-4 to 4), 0 below; unrated (0) dropped.
    Only the snippets of the three splits are tokenized."""
    folder = fetch(MOVIE_SNIPPETS)
    (name,) = MOVIE_SNIPPETS.members.values()
    snippets = []
    for line in (folder / name).read_text(encoding="utf-8").splitlines():
        if line.strip():
            _, score, text = line.split("\t", 2)
            if float(score) != 0:
                snippets.append((text.strip(), int(float(score) > 0)))
    return text_splits(snippets, SNIPPET_SPLITS, preset)


def imdb_datasets(preset):
    """Train/validation/test splits (IMDB_SPLITS) of the 50,000 IMDb reviews (Maas et al.,
    2011): the Hub's train and test halves joined and drawn anew, as the LLM study did; label 1
    for a positive review."""
    import datasets

    require_hub(f"the data set {preset.dataset}")
    with from_cache_when_offline(f"the data set {preset.dataset}"):
        imdb = datasets.load_dataset(preset.dataset)
    reviews = [(text, label) for half in ("train", "test")
               for text, label in zip(imdb[half]["text"], imdb[half]["label"])]
    return text_splits(reviews, IMDB_SPLITS, preset)


def text_splits(examples, sizes, preset):
    """Datasets of `sizes` (train, validation, test) examples (text, label), drawn by the fixed
    SPLIT_SEED and tokenized for the preset's model; only the drawn texts are tokenized."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(examples))
    splits, start = [], 0
    for size in sizes:
        chosen = [examples[index] for index in order[start:start + size]]
        splits.append(([text for text, _ in chosen], [label for _, label in chosen]))
        start += size
    texts = [text for split_texts, _ in splits for text in split_texts]
    tokenizer = tokenizer_for(preset)
    if preset.packed:  # --pack: no text is cut short, none padded
        return tuple(packed(split_texts, tokenizer, preset.max_length) for split_texts, _ in splits)
    say_truncated(texts, tokenizer, preset.max_length)
    return tuple(tokenized(split_texts, split_labels, tokenizer, preset.max_length, preset.task)
                 for split_texts, split_labels in splits)


class SyntheticData:
    """`size` samples of the preset's shapes drawn at random when read (each sample the same at
    every read): images in [-1, 1), or token ids over the model's vocabulary at the full length,
    the last one padding (masked out; under --pack none, and no mask); a class label each, or
    under --task causal-lm the ids themselves (the padding IGNORED)."""

    def __init__(self, preset, size, split):
        self.preset, self.size, self.split = preset, size, split
        if preset.max_length:  # text: ids the model's embedding holds
            from common.model import model_config
            self.vocabulary = model_config(preset).vocab_size

    def __len__(self):
        return self.size

    def __getitem__(self, indices):
        preset, samples = self.preset, []
        for index in indices:
            draw = torch.Generator().manual_seed(SPLIT_SEED + 1_000_003 * self.split + index)
            if preset.max_length:  # the last position padding, as in a padded batch of text: a
                ids = torch.randint(self.vocabulary, (preset.max_length,), generator=draw)
                mask = torch.ones_like(ids)  # mask of all ones would let transformers drop it
                mask[-1] = int(preset.packed)  # (--pack: no padding, and no mask given)
                inputs = {"input_ids": ids, **({} if preset.packed else {"attention_mask": mask})}
            else:
                size = preset.image_size
                inputs = {"pixel_values": torch.rand(3, size, size, generator=draw) * 2 - 1}
            label = (ids.masked_fill(mask == 0, IGNORED) if preset.task == "causal-lm"
                     else torch.randint(preset.num_classes, (), generator=draw))
            samples.append({**inputs, "label": label})
        return {name: torch.stack([sample[name] for sample in samples]) for name in samples[0]}


class RankSlice:
    """Each process takes every world_size-th sample of every global batch, starting at its rank."""

    def __init__(self, batch_sampler, rank, world_size):
        self.batch_sampler, self.rank, self.world_size = batch_sampler, rank, world_size

    def __iter__(self):
        for batch in self.batch_sampler:
            yield batch[self.rank::self.world_size]

    def __len__(self):
        return len(self.batch_sampler)


def as_pair(batch):
    """(inputs, labels): the model's inputs by name, and the labels."""
    labels = batch.pop("label")
    return batch, labels


def to_device(inputs, device, dtype=None):
    """The inputs on `device`; `dtype` casts the floating ones (images), not token ids or masks.
    A pinned batch is copied to a GPU without waiting for the copy (the GPU's queue orders it),
    but for a cast: a copy that casts without waiting casts on the GPU, from a float32 copy
    there (the estimate counts the cast on the host)."""
    moved = {}
    for name, tensor in inputs.items():
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        moved[name] = tensor.to(device, cast, non_blocking=cast == tensor.dtype)
    return moved


def split_batch(inputs, labels, micro_size):
    """Equal micro-batches of `micro_size` samples: a list of (inputs, labels). One micro-batch is
    the batch itself, not a view of it: on a CPU, a view made inside a tracked step shows the
    tracker the loader's tensors, which the whole batch's step (03) never touches."""
    if micro_size >= len(labels):
        return [(inputs, labels)]
    parts = {name: tensor.split(micro_size) for name, tensor in inputs.items()}
    return [({name: pieces[index] for name, pieces in parts.items()}, micro_labels)
            for index, micro_labels in enumerate(labels.split(micro_size))]


def make_loader(dataset, batch_size, shuffle, seed=0, rank=0, world_size=1, num_workers=0,
                pin_memory=False):
    """Batches of whole global batches (sliced per process); training drops the last partial batch."""
    if shuffle and batch_size > len(dataset):
        raise SystemExit(f"error: --batch-size {batch_size} is larger than the {len(dataset)} "
                         f"training samples: no optimizer step would run. Use at most "
                         f"{len(dataset)}.")
    last = len(dataset) % batch_size
    if not shuffle and 0 < last < world_size:
        # a process with an empty slice would skip a forward the others wait for (FSDP): a hang
        raise SystemExit(
            f"error: the last evaluation batch holds {last} of {len(dataset)} samples, fewer than "
            f"the {world_size} processes: some would get none. Use a --batch-size for which "
            f"{len(dataset)} % batch size is 0 or at least {world_size}, or fewer processes.")
    if shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(dataset)
    batches = RankSlice(BatchSampler(sampler, batch_size, drop_last=shuffle), rank, world_size)
    # batch_size=None: the sampler yields index lists and the Dataset returns whole batches
    return DataLoader(dataset, sampler=batches, batch_size=None, collate_fn=as_pair,
                      num_workers=num_workers, persistent_workers=num_workers > 0,
                      pin_memory=pin_memory)


def load_data(preset, batch_size, device, seed=0, rank=0, world_size=1, same_train_batches=False):
    """Loaders for one process training on `device`: `batch_size` is the global batch, split
    across `world_size` ranks (`same_train_batches`: every rank reads each training batch whole,
    as sequence parallelism splits its sequences instead; evaluation's stay split). Batches are
    pinned only for a CUDA device (faster copies to it); pinning creates a CUDA context, which a
    CPU run on a GPU machine must not."""
    if preset.dataset == "digits":
        train, val, test = digits_datasets(preset.image_size)
        workers = 0
    elif preset.dataset == SYNTHETIC:
        train, val, test = (SyntheticData(preset, size, split)
                            for split, size in enumerate(SYNTHETIC_SPLITS))
        workers = 0
    elif preset.dataset == "movie-snippets":
        train, val, test = movie_snippet_datasets(preset)
        workers = 0
    elif preset.dataset == "stanfordnlp/imdb":
        train, val, test = imdb_datasets(preset)  # tokenized once, in memory: no workers needed
        workers = 0
    else:
        train, val, test = cifar10_datasets(preset.dataset, preset.image_size)
        workers = 4
    common = dict(rank=rank, world_size=world_size, num_workers=workers,
                  pin_memory=torch.device(device).type == "cuda")
    training = dict(common, rank=0, world_size=1) if same_train_batches else common
    return Data(train=make_loader(train, batch_size, shuffle=True, seed=seed, **training),
                val=make_loader(val, batch_size, shuffle=False, **common),
                test=make_loader(test, batch_size, shuffle=False, **common))
