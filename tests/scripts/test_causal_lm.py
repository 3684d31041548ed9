"""--task causal-lm: a decoder learns the next token of each text, and the chunked loss (05g)
computes the same loss while holding less.

Every script that trains the task trains the architecture matrix's grouped-query decoder on it,
its estimate to the byte (tests/scripts/test_architectures.py); here the preset's own decoder (tiny-text
under causal-lm: a small Llama drawn from scratch) learns in the README's command, and the
matrix's decoders train on the branch that touches the output layer itself (05g) and on its
parent.
"""
import math
import re

import pytest
import torch

from common.data import split_batch
from conftest import PROBED_TEST_TIMEOUT, QUICK, load_script, run_script
from estimate.predict import predict
from steps import STEPS
from support.architecture_matrix import SEQ_LEN, VOCABULARY, model_flags, write_model
from support.rounding import additions, assert_same_sum

CAUSAL_LM = ["--task", "causal-lm"]
DECODERS = ["GPT-2", "Llama", "Mistral", "Qwen2", "BLOOM"]


def assert_estimate_is_peak(step, flags, real):
    predicted = predict(STEPS[step].path, [*flags, "--device", "cpu"], world_size=1)
    assert predicted["allocated_bytes"] == real["peak_memory_bytes"]
    assert predicted["breakdown_bytes"] == real["breakdown_bytes"]


def test_the_presets_decoder_learns_the_next_token(small_snippets, tmp_path):
    """The README's `python 04_grad_accum.py --task causal-lm`, for two steps."""
    real, _ = run_script("04", [*CAUSAL_LM, "--batch-size", "8", *QUICK], tmp_path)
    assert real["task"] == "causal-lm" and real["preset"] == "tiny-text"
    assert real["test_accuracy"] is None and real["test_tokens"] > 0
    # below the first step's loss at the weights drawn anew (about ln 30,522 = 10.33 nats)
    assert real["test_loss"] < real["losses"][0]


@pytest.mark.parametrize("name", DECODERS)
def test_every_decoder_trains_on_next_tokens_whole_chunked_and_fused(name, small_snippets, tmp_path):
    """05g and 05h hold less than 04 by at least the float32 logits of a micro-batch (04 keeps
    them, and their log-probabilities, from the loss to backward), and start from its loss."""
    folder = write_model(tmp_path / re.sub(r"\W", "", name.lower()), name)
    flags = [*model_flags(folder, name), *CAUSAL_LM, "--accum-steps", "2"]
    parent, _ = run_script("04", [*flags, *QUICK], tmp_path)
    micro_batch = parent["batch_size"] // parent["accum_steps"]
    logits_bytes = micro_batch * SEQ_LEN * VOCABULARY * 4  # float32
    for step in ("05g", "05h"):
        real, _ = run_script(step, [*flags, *QUICK], tmp_path)
        assert parent["peak_memory_bytes"] - real["peak_memory_bytes"] >= logits_bytes, step
        assert real["losses"][0] == pytest.approx(parent["losses"][0], rel=2**-7)  # bfloat16 logits
        assert_estimate_is_peak(step, flags, real)


@pytest.mark.numerical
def test_the_chunked_loss_is_the_models_own_loss_within_rounding():
    """In float32, on a padded batch: the mean over every predicted token, padding left out."""
    from common.cli import parse_args
    from common.model import create_model
    from common.presets import preset_for
    torch.manual_seed(0)
    preset = preset_for(parse_args("", CAUSAL_LM))
    model = create_model(preset)
    ids = torch.randint(1000, preset.config["vocab_size"], (3, 20))
    mask = torch.ones_like(ids)
    mask[0, 12:] = mask[1, 5:] = 0  # padded
    labels = ids.masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask}
    whole = model(**inputs, labels=labels).loss
    chunked = load_script("05g").chunked_loss(model, inputs, labels)
    with torch.no_grad():  # each predicted token's loss, by hand, for the size of the sums
        logits = model(**inputs).logits[:, :-1]
        targets = labels[:, 1:]
        token_losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    tokens = int((targets != -100).sum())
    assert tokens == 11 + 4 + 19  # padding predicts nothing and is never predicted
    assert whole.item() == pytest.approx(token_losses.sum().item() / tokens, rel=1e-5)
    assert_same_sum(chunked.detach(), whole.detach(), token_losses.abs().sum() / tokens,
                    additions(model.config, tokens), what="chunked loss")


@pytest.mark.numerical
def test_the_fused_loss_and_the_gradients_it_makes_in_forward_are_the_plain_losss():
    """In float32, with ignored targets and accumulation's scale: 05h's loss, and the gradients
    with respect to the hidden states and the output layer's weight that its forward makes and
    its backward scales, equal autograd's through the plain loss within the rounding of their
    sums; evaluation's loss (no gradients made) is the same number."""
    from common.data import IGNORED
    fused = load_script("05h").FusedLinearCrossEntropy
    torch.manual_seed(0)
    batch, length, width, vocabulary = 3, 20, 16, 50
    hidden = torch.randn(batch, length, width, requires_grad=True)
    weight = torch.randn(vocabulary, width, requires_grad=True)
    targets = torch.randint(vocabulary, (batch, length))
    targets[0, 12:] = targets[1, 5:] = IGNORED
    loss = fused.apply(hidden, weight, targets, True)
    (loss / 4).backward()  # four micro-batches: backward scales what forward made
    with torch.no_grad():
        assert fused.apply(hidden, weight, targets, False) == loss
    plain_hidden, plain_weight = (hidden.detach().requires_grad_(), weight.detach().requires_grad_())
    logits = plain_hidden @ plain_weight.T
    logits.retain_grad()
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 ignore_index=IGNORED)
    (expected / 4).backward()
    kept = targets != IGNORED
    count = int(kept.sum())
    # the sums' sizes: a logit's terms, the normalizer's, then the product's (tokens or vocabulary)
    n = width + vocabulary + max(count, vocabulary) + 4
    probabilities = logits.detach().softmax(-1)
    one_hot = torch.nn.functional.one_hot(targets.clamp(min=0), vocabulary) * kept.unsqueeze(-1)
    grad_size = (probabilities + one_hot) * kept.unsqueeze(-1) / count / 4  # before cancelling
    token_size = (logits.detach().abs().amax(-1) * 2 + math.log(vocabulary)) * kept  # |lse| + |logit|
    assert_same_sum(loss.detach(), expected.detach(), token_size.sum() / count, n, what="loss")
    assert_same_sum(hidden.grad, plain_hidden.grad, grad_size @ weight.detach().abs(), n,
                    what="hidden states' gradient")
    assert_same_sum(weight.grad, plain_weight.grad,
                    grad_size.flatten(0, 1).T @ hidden.detach().abs().flatten(0, 1), n,
                    what="output layer's gradient")
    assert (hidden.grad[~kept] == 0).all()  # an ignored position's logits get no gradient


def five_texts_and_a_decoder():
    from common.cli import parse_args
    from common.data import tokenized, tokenizer_for
    from common.model import create_model
    from common.presets import preset_for
    torch.manual_seed(0)
    preset = preset_for(parse_args("", CAUSAL_LM))
    texts = ["a film", "a long and winding film about films", "it", "good", "not good at all"]
    data = tokenized(texts, None, tokenizer_for(preset), 12, task="causal-lm")
    return data, create_model(preset)


@pytest.mark.numerical
@pytest.mark.parametrize("pieces, forwards", [(1, [4, 1]), (2, [2, 2, 1]), (4, [1, 1, 1, 1, 1])])
def test_evaluation_runs_a_piece_of_a_batch_at_a_time_with_the_same_tokens_and_loss(pieces,
                                                                                   forwards):
    """evaluate() runs each batch in as many pieces as training's micro-batches (`pieces`), with
    the loss it is given (05g's chunked loss) in place of the model's own: it counts the same
    predicted tokens and gives the same mean loss, within the rounding of its sums, as one text
    at a time."""
    from common.data import make_loader
    from common.evaluate import evaluate, models_own_loss
    data, model = five_texts_and_a_decoder()
    loader = make_loader(data, 4, shuffle=False)
    calls = []

    def counted(model, inputs, labels):
        calls.append(len(labels))
        return models_own_loss(model, inputs, labels)

    in_pieces = evaluate(model, loader, torch.device("cpu"), loss=counted, pieces=pieces)
    assert calls == forwards
    one_by_one = evaluate(model, [(inputs, labels) for batch in loader for inputs, labels in
                                  split_batch(*batch, 1)], torch.device("cpu"))
    assert in_pieces.tokens == one_by_one.tokens == int((data[:]["label"][:, 1:] != -100).sum())
    with torch.no_grad():  # each predicted token's loss, for the size of the sums
        ids, labels = data[:]["input_ids"], data[:]["label"]
        logits = model(input_ids=ids, attention_mask=data[:]["attention_mask"]).logits[:, :-1]
        token_losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="none")
    assert_same_sum(torch.tensor(in_pieces), torch.tensor(one_by_one),
                    token_losses.abs().sum() / in_pieces.tokens,
                    additions(model.config, in_pieces.tokens), what="evaluation's loss")


def test_a_process_with_a_smaller_share_runs_as_many_forwards_and_counts_its_texts_alone():
    """Two processes sharding the model (07-09) evaluate the last batch of 5 texts as 3 and 2,
    in pieces of one text (3 micro-batches): the second runs a third forward (FSDP gathers with
    the first), which counts for nothing."""
    from common.data import IGNORED, make_loader
    from common.evaluate import evaluate, models_own_loss
    data, model = five_texts_and_a_decoder()
    forwards, tokens = [], {}
    for rank in (0, 1):
        loader = make_loader(data, 5, shuffle=False, rank=rank, world_size=2)
        calls = []
        score = evaluate(model, loader, torch.device("cpu"), pieces=3,
                         loss=lambda *args: calls.append(1) or models_own_loss(*args))
        forwards.append(len(calls))
        labels = data[rank::2]["label"]
        tokens[rank] = (score.tokens, int((labels[:, 1:] != IGNORED).sum()))
    assert forwards == [3, 3]
    assert all(counted == expected for counted, expected in tokens.values())


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_text_labels_are_the_tokens_with_padding_left_out_after_them(side):
    """Padding after each text, even where the tokenizer pads on the left (BLOOM's): a text
    starts at position 0, and causal attention without a mask (08a) never reads padding."""
    from common.data import IGNORED, tokenized, tokenizer_for
    from common.presets import PRESETS, for_task
    preset = for_task(PRESETS["tiny-text"], "causal-lm")
    tokenizer = tokenizer_for(preset)
    tokenizer.padding_side = side
    data = tokenized(["a short review", "a review that is a good deal longer than that"],
                     [0, 1], tokenizer, 12, task="causal-lm")
    for sample in data:
        real = sample["attention_mask"] == 1
        assert torch.equal(sample["label"][real], sample["input_ids"][real])
        assert (sample["label"][~real] == IGNORED).all()
        assert torch.equal(real, torch.arange(12) < real.sum())  # the text first, then padding
    assert (data[0]["attention_mask"] == 0).any()  # the short one is padded


@pytest.mark.parametrize("argv, words", [
    (["--task", "causal-lm", "--preset", "tiny"], "holds images, which have no next token"),
    (["--task", "causal-lm", "--model", "{bert}"], "'bert' model is not one"),
])
def test_causal_lm_where_there_is_no_next_token_or_no_decoder_stops_with_a_message(
        argv, words, tmp_path, capsys):
    from common.cli import parse_args
    folder = write_model(tmp_path / "bert", "BERT")
    with pytest.raises(SystemExit):
        parse_args("", [arg.format(bert=folder) for arg in argv])
    assert words in capsys.readouterr().err


def test_the_chunked_loss_refuses_classification_with_a_message(capsys):
    with pytest.raises(SystemExit):
        load_script("05g").main(["--task", "classification"])
    assert "trains --task causal-lm only" in capsys.readouterr().err


def test_the_tour_table_shows_the_loss_of_a_causal_lm_run():
    from tour.records import step_row
    from tour.report import tour_table
    table = tour_table([step_row("05g_chunked_loss", {"peak_memory_bytes": 2**20, "test_loss": 7.5,
                                                      "test_perplexity": 1808.04})])
    assert "test loss" in table and "7.5000" in table and "1,808.0" in table
    assert "test accuracy" not in table


@pytest.mark.timeout(PROBED_TEST_TIMEOUT)
def test_a_decoder_trains_on_next_tokens_in_two_processes(tmp_path, probed_runs):
    """09 (sharded, offloaded, checkpointed) under torchrun, through tests/support/fsdp_probe.py (float32,
    tiny-text's small splits: its bfloat16 evaluation of the whole splits outlasted the launch's
    timeout on a busy 2-core machine): the test loss sums every process's tokens."""
    folder = write_model(tmp_path / "llama", "Llama")
    record = probed_runs("09", [*model_flags(folder, "Llama"), *CAUSAL_LM]).record
    assert record["world_size"] == 2 and record["task"] == "causal-lm"
    assert record["test_loss"] < record["losses"][0] and record["test_tokens"] > 0


def test_asking_for_the_chunked_loss_without_its_task_says_to_add_it(tmp_path, capsys):
    import estimate.command
    from tour import runner
    with pytest.raises(SystemExit) as stop:
        estimate.command.main(["--steps", "05g", "--results-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert "05g_chunked_loss trains --task causal-lm only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.parse_args(["--steps", "05g"])
    assert "add --task causal-lm" in capsys.readouterr().err
