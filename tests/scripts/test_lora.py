"""07a's claims: LoRA leaves the pretrained weights as they were and trains only its adapters and
the classification head, which start from the pretrained model's function; their gradients and
Adam's state are all the model state it adds to the frozen weights; its flags do what they say."""
import contextlib
import io
import re

import pytest
import torch

from conftest import QUICK, TEXT, load_script, run_script, unevaluated


def adapters(model):
    return [module for module in model.modules() if type(module).__name__ == "LoRALinear"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """07a and 07b on tiny, 12 steps each, unevaluated (the claims here are what trains, what it
    holds at the peak of the first steps, and that the loss falls): {name: (record, meter, what
    the run printed to stderr)}, shared by the tests that only read them."""
    runs = {}
    for name in ("07a", "07b"):
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            record, meter = run_script(name, ["--epochs", "1", "--max-steps", "12"],
                                       tmp_path_factory.mktemp(name), unevaluated(name))
        runs[name] = record, meter, printed.getvalue()
    return runs


def test_lora_trains_the_adapters_and_the_head_and_nothing_else(small_snippets, tmp_path):
    module = unevaluated("07a")  # batches of 8, unevaluated: the claim is what trains
    created = {}
    create_model = module.create_model

    def keeping_a_copy(*args, **kwargs):  # the pretrained weights, before any adapter
        model = create_model(*args, **kwargs)
        created.update({name: value.clone() for name, value in model.state_dict().items()})
        return model

    module.create_model = keeping_a_copy
    record, meter = run_script("07a", [*TEXT, "--batch-size", "8", *QUICK], tmp_path, module)
    model = meter.model
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    head = {name for name, _ in model.named_parameters() if name.startswith("classifier.")}
    assert trained == head | {name for name in trained if ".down." in name or ".up." in name}
    assert len(trained - head) == 2 * len(adapters(model)) == 2 * 6 * 6  # 6 linear layers, 6 blocks
    for name, value in model.state_dict().items():  # the pretrained weights are untouched
        original = name.replace(".base.", ".")
        if ".down." not in name and ".up." not in name and not name.startswith("classifier."):
            assert torch.equal(value, created[original]), name
    assert all(adapter.up.weight.abs().sum() > 0 for adapter in adapters(model))  # trained
    assert record["trainable_parameter_count"] == sum(model.get_parameter(name).numel()
                                                      for name in trained)
    assert record["trainable_parameter_count"] < 0.02 * record["parameter_count"]
    state = meter.optimizer.state
    assert {id(parameter) for parameter in state} == {id(model.get_parameter(n)) for n in trained}


def test_adapters_start_from_the_pretrained_models_function():
    """B is zero at first, so the adapted layer computes what the layer computed."""
    module = load_script("07a")
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
    adapted = module.LoRALinear(layer, rank=4, alpha=8)
    inputs = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(adapted(inputs), layer(inputs))
    adapted.up.weight.data.fill_(1)  # and an adapter's update is s * B A x
    update = (adapted.scale * (inputs @ adapted.down.weight.T) @ adapted.up.weight.T)
    assert torch.allclose(adapted(inputs) - layer(inputs), update, rtol=0.05, atol=0.05)


def test_loras_model_state_is_the_frozen_weights_and_the_adapters(quick_records, trained):
    """Against 06, which trains every weight: gradients and optimizer state only for the trainable
    parameters (bfloat16 gradients, Adam's two bfloat16 moments), and a lower peak."""
    record, meter, _ = trained["07a"]
    breakdown, trainable = record["breakdown_bytes"], record["trainable_parameter_count"]
    steps = 4 * len(meter.optimizer.state)  # each tensor's step counter: a float32 number
    assert breakdown["gradients"] <= 2 * trainable
    # Adam's exp_avg and exp_avg_sq, in bfloat16
    assert breakdown["optimizer_state"] == 4 * trainable + steps
    assert record["peak_memory_bytes"] < quick_records["06"]["peak_memory_bytes"]


def test_lora_on_a_model_trained_from_scratch_says_what_it_shows(trained):
    assert "LoRA's frozen weights are random" in trained["07a"][2]


def test_lora_targets_choose_the_adapted_layers(tmp_path, capsys):
    _, meter = run_script("07a", [*QUICK, "--lora-targets", "q_proj", "v_proj", "--lora-rank", "2"],
                          tmp_path)
    names = {name.rsplit(".", 3)[-3] for name, _ in meter.model.named_parameters()
             if ".down." in name}
    assert names == {"q_proj", "v_proj"}
    assert all(adapter.down.weight.shape[0] == 2 for adapter in adapters(meter.model))
    with pytest.raises(SystemExit, match=re.escape("no linear layer in the model's blocks is "
                                                   "named query")):
        run_script("07a", [*QUICK, "--lora-targets", "query"], tmp_path)


@pytest.mark.parametrize("script", ["07a", "07b", "10"])  # 10: with --lora-rank
def test_a_lora_rank_above_a_layers_width_stops_before_training_saying_what_to_use(script, tmp_path):
    """B A, the update of a layer of n inputs and m outputs, has rank min(n, m) at most, and its
    adapters hold more weights than the layer long before: a larger --lora-rank is refused with a
    message naming the layer, before anything trains. A rank of exactly the width is taken
    (tiny's narrowest layers are 128 wide)."""
    from common.presets import PRESETS
    module = load_script(script)
    module.MemoryMeter = lambda *args, **kwargs: pytest.fail("training started")
    with pytest.raises(SystemExit, match=re.escape(
            "--lora-rank 129 is larger than the layer 'attention.q_proj' (a 128 x 128 weight)")) as stop:
        module.main([*QUICK, "--lora-rank", "129", "--results-dir", str(tmp_path)])
    assert "Use a --lora-rank well below 128" in str(stop.value)
    assert "fc1" in module.add_adapters(module.create_model(PRESETS["tiny"]), rank=128, alpha=16)


def quantized_weights(model):
    """How many weights the model holds in 4 bits (07b)."""
    return sum(adapter.base.weight.quant_state.shape.numel() for adapter in adapters(model)
               if hasattr(adapter.base.weight, "quant_state"))


def test_qlora_stores_the_adapted_layers_in_half_a_byte_per_weight(trained):
    """07b's parameters take 1.5 bytes less per quantized weight than 07a's (2 bytes of bfloat16
    against 4 bits), plus the scales bitsandbytes keeps beside them (about 1/64 byte per weight);
    the rest alike; the same parameters, as many trained."""
    from common.model import quantization_tensors
    _, meter, _ = trained["07b"]
    quantized = quantized_weights(meter.model)
    assert quantized == sum(adapter.down.weight.shape[1] * adapter.up.weight.shape[0]
                            for adapter in adapters(meter.model))  # every adapted layer
    scales = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
              for adapter in adapters(meter.model)
              for tensor in quantization_tensors(adapter.base.weight)}
    assert quantized / 64 <= sum(scales.values()) < quantized / 16
    lora, qlora = trained["07a"][0], trained["07b"][0]
    saved = lora["breakdown_bytes"]["parameters"] - qlora["breakdown_bytes"]["parameters"]
    assert saved == 1.5 * quantized - sum(scales.values())
    assert qlora["parameter_count"] == lora["parameter_count"]
    assert qlora["trainable_parameter_count"] == lora["trainable_parameter_count"]
    assert qlora["peak_memory_bytes"] < lora["peak_memory_bytes"]


def test_a_4_bit_weight_is_its_weight_to_within_nf4s_rounding():
    """Each weight becomes the NF4 level nearest to it, times its block's scale (the block's
    largest magnitude, itself stored in 8 bits): off by at most half the widest gap between
    levels, plus the scale's own rounding, times the scale."""
    from bitsandbytes.functional import dequantize_4bit, get_4bit_type
    module = load_script("07b")
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 64, dtype=torch.bfloat16).requires_grad_(False)
    four_bit = module.in_four_bits(layer)
    restored = dequantize_4bit(four_bit.weight.data, four_bit.weight.quant_state).float()
    original = layer.weight.float()
    levels = get_4bit_type("nf4", device="cpu").sort().values
    half_gap = (levels[1:] - levels[:-1]).max().item() / 2
    scale = original.reshape(-1, 64).abs().amax(dim=1, keepdim=True)  # blocks of 64 weights
    error = (restored - original).reshape(-1, 64).abs()
    assert torch.all(error <= (half_gap + 2**-7) * scale * 1.01), (error / scale).max()
    assert restored.shape == original.shape


@pytest.mark.parametrize("name", ["07a", "07b"])
def test_a_few_steps_of_lora_and_qlora_lower_the_loss(name, trained):
    losses = trained[name][0]["losses"]
    assert len(losses) == 12
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, losses
