"""Benchmark: this repository's estimate beside the memory calculators people reach for, on the
same published measurements.

  python benchmarks/calculators.py [--jobs 2]

For every published peak-memory figure that a script here reproduces, it prints one markdown
table: the measured figure, this repository's prediction (the script's own `--estimate`, GPU
emulated) and three rules computed from the same model config, each as predicted / measured
(1.00 is exact, below 1 too low); then which one came closest in each row (the smallest
|predicted / measured - 1|). Offline: the configs are in common/presets.py and
docs/models/bert-large-uncased-eager/config.json; nothing comes from the Hub. Nine estimates, two
at a time: 44 s on 2 idle cores, 68-75 s shared with other work (the rules take no time).

The published figures, and where they were read:

- The 2023 study "Optimizing Memory Usage for Training LLMs and Vision Transformers in PyTorch"
  (ViT-L/16 finetuned on CIFAR-10 at 224 px, one A100, `torch.cuda.max_memory_reserved`,
  GB = 10^9 bytes): estimate/records.py, STUDY_RESERVED_GB. Five of the six are in the
  study's own log, https://github.com/rasbt/pytorch-memory-optim/blob/main/logs.md ("Memory
  used": 26.84 for its Fabric copy of 01, whose plain-PyTorch run logged 26.79; 18.21, 13.82,
  5.69, 3.91); its SGD step's 2.02 is not in that log (estimate/records.py: the study's
  headline, "about 2 GB").
- BERT-large (`bert-large-uncased` with a sequence-classification head, 512 random tokens, the
  `Trainer`'s defaults, a 16 GB V100, NVML's "used" memory in MiB): "Efficient Training on a
  Single GPU", https://huggingface.co/docs/transformers/v4.27.2/en/perf_train_gpu_one, read
  from its source, https://github.com/huggingface/transformers/blob/98513dfd0db6dab00d26c1ef3a0e5f7410ce2035/docs/source/en/perf_train_gpu_one.mdx
  (the same figures at an earlier commit, 0016acf7ef421c7fe8eff7945de52c71896c3b01):
  1343 MiB with only the CUDA context and kernels loaded, 14949 at batch 4, 8681 at batch 1
  with 4 accumulation steps, 13939 at batch 4 with `fp16=True`. The comparison takes NVML's
  figure less the 1343 MiB, as docs/estimator.md does ("Checked against a published
  measurement").

The rules, each a function below:

- accelerate's `accelerate estimate-memory`, "Training using Adam" column
  (https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator; the rule read from
  accelerate/commands/estimate.py of the installed accelerate).
- DeepSpeed's model-states estimate for ZeRO-2 (https://deepspeed.readthedocs.io/en/latest/memory.html;
  deepspeed/runtime/zero/stage_1_and_2.py, `estimate_zero2_model_states_mem_needs`).
- 16-18 bytes per parameter for mixed-precision Adam: 16 from the ZeRO paper (Rajbhandari et
  al., https://arxiv.org/abs/1910.02054, section 3.1: 2 + 2 + 12 bytes), 18 from the transformers
  page above ("A typical model trained in mixed precision with AdamW requires 18 bytes per model
  parameter plus activation memory").
"""
import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from estimate.records import ESTIMATE_FILE, GB, MIB, STUDY_RESERVED_GB  # noqa: E402 (needs the path above)

BERT_DIR = "docs/models/bert-large-uncased-eager"  # the 2022 attention code path (eager)
BERT_LABELS = 2
BERT_SEQ_LEN = 512
CONTEXT_MIB = 1343  # the transformers page: NVML with a tiny tensor loaded, before the model


@dataclass(frozen=True)
class Row:
    model: str          # "vit" (the article preset) or "bert" (BERT_DIR)
    script: str         # "01_baseline"
    batch_size: int     # samples per optimizer step
    accum_steps: int    # micro-batches per optimizer step
    measured_gb: float  # what the comparison divides by
    published: str      # the published run, in short
    here: str           # the script's run that reproduces it, in short

    def command(self):
        """The script's own estimate of this run (GPU emulated: an A100)."""
        words = [f"{self.script}.py", "--batch-size", str(self.batch_size), "--estimate"]
        if self.accum_steps > 1:
            words += ["--accum-steps", str(self.accum_steps)]
        if self.model == "vit":
            return [*words, "--preset", "article"]
        return [*words, "--model", BERT_DIR, "--seq-len", str(BERT_SEQ_LEN)]


def study_rows():
    """The study's figures, as estimate/records.py holds them."""
    rows = []
    for (script, batch, accum), published in STUDY_RESERVED_GB.items():
        label = f"batch {batch}" + (f" in {accum} micro-batches" if accum > 1 else "")
        rows.append(Row("vit", script, batch, accum, published, f"study: ViT-L/16, {label}", script))
    return rows


# (script, batch size, published NVML MiB, the Trainer's setting, the script's run). Only the
# page's rows that a script reproduces; LEFT_OUT says why the others are not here. Accumulating
# 4 batches of 1 is 01 at batch 1: 04 trains bfloat16 weights, and with the Trainer's gradients
# held between steps (docs/estimator.md) accumulation adds nothing to batch 1's peak.
TRANSFORMERS_PAGE = [
    ("01_baseline", 4, 14949, "batch 4", "01_baseline"),
    ("01_baseline", 1, 8681, "batch 1, 4 accumulation steps", "01_baseline, batch 1"),
    ("02_mixed_precision", 4, 13939, "batch 4, fp16", "02_mixed_precision"),
]
LEFT_OUT = [  # the page's other BERT-large rows (NVML MiB), and why no script here reproduces them
    ("batch 1, 4 accumulation steps, gradient checkpointing", 6775,
     "float32 with checkpointing: 05c, 05d and 09 checkpoint bfloat16 weights"),
    ("the same with fp16=True", 7275, "no script checkpoints under float16 autocast"),
    ("batch 4, Adafactor", 12295, "05b runs Adafactor on bfloat16 weights, with accumulation"),
    ("batch 1, 4 steps, checkpointing, fp16, Adafactor", 4847, "as the two above"),
    ("batch 4, 8-bit Adam", 13085, "05a runs 8-bit AdamW on bfloat16 weights, with accumulation"),
    ("batch 1, 4 steps, checkpointing, fp16, 8-bit Adam", 5363, "as the two above"),
]


def transformers_rows():
    """The transformers page's rows that a script reproduces, less the CUDA context."""
    return [Row("bert", script, batch, 1, (mib - CONTEXT_MIB) * MIB / GB,
                f"transformers: BERT-large, {setting} ({mib} MiB)", here)
            for script, batch, mib, setting, here in TRANSFORMERS_PAGE]


def rows():
    return study_rows() + transformers_rows()


def weight_dtype(script):
    """The dtype a script keeps its weights in: its `DTYPE = torch.X` line (bf16-true, 03 on),
    else float32 (01; 02's autocast leaves the weights float32)."""
    found = re.search(r"^DTYPE = torch\.(\w+)", (ROOT / f"{script}.py").read_text(), re.MULTILINE)
    return found.group(1) if found else "float32"


# -- the models, built from their configs on the meta device (shapes only, no Hub) -----------

def config_of(model):
    """The config the scripts train: the article preset's ViT-L/16, or BERT-large with a
    2-label head."""
    from transformers import AutoConfig

    from common.model import model_config
    from common.presets import PRESETS
    if model == "vit":
        return model_config(PRESETS["article"])
    return AutoConfig.from_pretrained(ROOT / BERT_DIR, num_labels=BERT_LABELS)


def classifier(model):
    """The classifier the scripts train, on the meta device."""
    import torch

    from common.model import model_class
    from common.presets import PRESETS
    with torch.device("meta"):
        if model == "vit":
            return model_class(PRESETS["article"])._from_config(config_of(model))
        from transformers import AutoModelForSequenceClassification
        return AutoModelForSequenceClassification.from_config(config_of(model))


def parameter_count(module):
    """Every parameter once (shared ones once), as DeepSpeed's `model_to_params` counts them
    (it tells them apart by data_ptr, which is 0 for every tensor on the meta device; so here
    by identity, which `parameters()` already does)."""
    return sum(p.numel() for p in module.parameters())


def largest_layer_params(module):
    """The most parameters one module holds itself, as DeepSpeed's ZeRO-3 `model_to_params`."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())


# -- the rules ------------------------------------------------------------------------------

def accelerate_estimate_memory(config, dtype):
    """`accelerate estimate-memory`'s figures for `config`: (the model's size in `dtype`, its
    "Training using Adam"), in bytes.

    As accelerate/commands/estimate.py does (`create_empty_model`, then `gather_data` and
    `estimate_command`), without the Hub lookup: it builds `AutoModel.from_config(config)` (the
    base model: no classification head; ViT and BERT with their pooler) in float32 under
    `init_empty_weights`, takes `calculate_maximum_sizes` (parameters and buffers) and reports
    the largest value of `estimate_training_usage(float32 size, dtype)`: for "float32" the step,
    4 x the float32 size (1 for the weights, 1 gradients, 2 Adam); for "float16" the optimizer
    state, 2 x the float32 size, which is 4 x the float16 size. Its documentation says 4x the
    model's size for each dtype (https://huggingface.co/docs/accelerate/usage_guides/model_size_estimator).
    The command offers float32, float16, int8 and int4 (training: "N/A" for the last two); a
    bfloat16 model reads the float16 row, which the source treats as bfloat16's too.
    """
    import torch
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    row = "float16" if dtype == "bfloat16" else dtype
    if row not in ("float32", "float16"):
        raise ValueError(f"accelerate estimates training for float32 and float16, not {dtype}")
    with init_empty_weights():
        model = AutoModel.from_config(config, dtype=torch.float32)
    total_size, _largest = calculate_maximum_sizes(model)
    training = max(estimate_training_usage(total_size, row).values())
    return (total_size if row == "float32" else total_size / 2), training


def deepspeed_zero2_gpu_bytes(total_params, num_gpus=1):
    """DeepSpeed's ZeRO-2 estimate of the model states per GPU, optimizer not offloaded.

    Documented (https://deepspeed.readthedocs.io/en/latest/memory.html, "ZeRO-2",
    "offload_optimizer": none): 4 * params + 16 * params / total GPUs; the code since
    deepspeedai/DeepSpeed#5099 (`estimate_zero2_model_states_mem_needs`, cpu_offload=False)
    writes it 2 * params + 18 * params / total GPUs, the same on one GPU: 20 bytes per parameter
    (fp16 weights and gradients, fp32 master weights, gradients and Adam's two moments). Model
    states only: no activations, no temporaries, no CUDA context.
    """
    return 4 * total_params + int(16 * total_params / num_gpus)


def deepspeed_zero3_gpu_bytes(total_params, largest_layer, num_gpus=1):
    """DeepSpeed's ZeRO-3 estimate per GPU, nothing offloaded (the same page, "case 1"):
    4 * largest layer's params (its fp16 weights and gradients gathered) + 18 * params / GPUs."""
    return 4 * largest_layer + int(18 * total_params / num_gpus)


def bytes_per_parameter_rule(total_params):
    """The 16-18 bytes per parameter of mixed-precision Adam training: (16 x, 18 x) params.

    16: fp16 weights and gradients (2 + 2) and fp32 master weights, momentum and variance (12),
    the ZeRO paper's count; 18: the transformers page's, with fp32 gradients (4) and both weight
    copies (6) beside AdamW's 8. Model states only; "plus activation memory".
    """
    return 16 * total_params, 18 * total_params


# -- the table -------------------------------------------------------------------------------

COLUMNS = ["this repository", "accelerate", "DeepSpeed ZeRO-2", "16 B/param", "18 B/param"]


def rule_predictions(model_rows):
    """{row: {column: predicted bytes}} for the four rules (this repository's column apart)."""
    models = {row.model for row in model_rows}
    counts = {model: parameter_count(classifier(model)) for model in models}
    configs = {model: config_of(model) for model in models}
    predicted = {}
    for row in model_rows:
        params = counts[row.model]
        _size, adam = accelerate_estimate_memory(configs[row.model], weight_dtype(row.script))
        low, high = bytes_per_parameter_rule(params)
        predicted[row] = {"accelerate": adam, "DeepSpeed ZeRO-2": deepspeed_zero2_gpu_bytes(params),
                          "16 B/param": low, "18 B/param": high}
    return predicted, counts


def run_estimates(model_rows, results_dir, jobs):
    """Each row's own `--estimate`, `jobs` at a time; {row: predicted reserved bytes}."""
    def run(row):
        done = subprocess.run([sys.executable, *row.command(), "--results-dir", str(results_dir)],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
            raise SystemExit(f"{' '.join(row.command())}: exit status {done.returncode}\n{tail}")
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(run, model_rows))
    records = json.loads((Path(results_dir) / ESTIMATE_FILE).read_text())
    found = {}
    for row in model_rows:
        model = None if row.model == "vit" else BERT_DIR
        matches = [r for r in records if r["script"] == row.script and r.get("model") == model
                   and r["batch_size"] == row.batch_size and r["accum_steps"] == row.accum_steps
                   and r["device"] == "cuda" and r["world_size"] == 1]
        if len(matches) != 1:
            raise SystemExit(f"{row.published}: {len(matches)} estimate records, not 1")
        found[row] = matches[0]["reserved_bytes"]
    return found


def closest(ratios):
    """The column whose predicted / measured is nearest 1."""
    return min(ratios, key=lambda column: abs(ratios[column] - 1))


def table(model_rows, estimates, predicted):
    lines = ["| published run | here | measured GB | " + " | ".join(COLUMNS) + " | closest |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in COLUMNS) + " | --- |"]
    winners = {}
    for row in model_rows:
        values = {"this repository": estimates[row], **predicted[row]}
        ratios = {column: values[column] / GB / row.measured_gb for column in COLUMNS}
        winners[row] = closest(ratios)
        cells = [f"{values[column] / GB:.2f} ({ratios[column]:.2f})" for column in COLUMNS]
        lines.append(f"| {row.published} | {row.here} | {row.measured_gb:.2f} | " + " | ".join(cells)
                     + f" | {winners[row]} |")
    return "\n".join(lines), winners


def footnotes(counts):
    """The table's notes: units, which row of each rule is read, and the rows left out."""
    models = {"ViT-L/16": classifier("vit"), "BERT-large": classifier("bert")}
    zero3 = ", ".join(
        f"{name} {deepspeed_zero3_gpu_bytes(parameter_count(m), largest_layer_params(m)) / GB:.2f}"
        for name, m in models.items())
    left_out = "; ".join(f"{setting} ({mib} MiB): {why}" for setting, mib, why in LEFT_OUT)
    return "\n".join([
        "- Each cell: predicted GB (10^9 bytes) and predicted / measured. Measured: the study's "
        "max_memory_reserved; for BERT-large, NVML's figure less the page's 1343 MiB of CUDA context "
        "and kernels. This repository: the script's own `--estimate` (max_memory_reserved, an A100 "
        f"emulated). Parameters: ViT-L/16 {counts.get('vit', 0):,}; BERT-large with a 2-label head "
        f"{counts.get('bert', 0):,}.",
        "- accelerate: `accelerate estimate-memory`'s \"Training using Adam\" (the model it builds: "
        "`AutoModel`, no head), in the row of the dtype the script keeps its weights in: float32 for "
        "01 and 02 (autocast leaves the weights float32), float16 for 03-05 (bfloat16 weights; the "
        "command has no bfloat16 row). Adam at batch size 1: no activations; 05 trains with SGD.",
        "- DeepSpeed: `estimate_zero2_model_states_mem_needs` on 1 GPU, optimizer not offloaded: 20 "
        "bytes per parameter. On one GPU ZeRO has nothing to shard, and ZeRO-1 and 2 both hold "
        "DeepSpeed's whole mixed-precision Adam state, which this formula counts; ZeRO-3's formula on "
        f"one GPU (18 bytes per parameter and 4 per parameter of the largest layer) gives {zero3} GB. "
        "Model states of mixed-precision Adam only.",
        "- 16-18 B/param: meant for mixed-precision Adam (02, BERT-large with fp16); model states only.",
        f"- Left out, the transformers page's other BERT-large rows: {left_out}.",
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="estimates run at once (default: 2)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model_rows = rows()
    with tempfile.TemporaryDirectory() as results_dir:
        estimates = run_estimates(model_rows, results_dir, args.jobs)
    predicted, counts = rule_predictions(model_rows)
    text, winners = table(model_rows, estimates, predicted)
    print(text)
    print()
    print(footnotes(counts))
    tally = {column: [row for row in model_rows if winners[row] == column] for column in COLUMNS}
    others = "; ".join(f"{column}: {', '.join(f'{row.published} ({row.here})' for row in found)}"
                       for column, found in tally.items() if found and column != "this repository")
    print(f"\nclosest per row (smallest |predicted / measured - 1|): this repository in "
          f"{len(tally['this repository'])} of {len(model_rows)}" + (f"; {others}" if others else ""))
    print(f"wall time {time.perf_counter() - start:.1f} s ({len(model_rows)} estimates, "
          f"{args.jobs} at a time)")


if __name__ == "__main__":
    main()
