"""The memory planner on adapters: the LoRA/DoRA parameter count equals PEFT's on the app's own
`adapters.attach` (Llama, GPT-2's Conv1D, BERT; all-linear and named targets; a classifier's head); quantized
weights are every linear layer but the head; after one real LoRA AdamW step the bytes of weights, gradients and
optimizer states are within 15% of the estimate, and autograd's saved activations within 15%; LoRA rows hold
the base in 16 bits."""

import pytest
import torch
from test_planner import (
    decoder_dirs_fixture,  # noqa: F401  (the decoder_dirs fixture)
    plan_args,
    saved_activation_bytes,
    setup,
    tensor_bytes,
)
from test_planner_causal_lm import small_llama
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    LlamaConfig,
)

from cloudtrain import planning
from cloudtrain.config import Config, ModelConfig
from cloudtrain.models import adapters
from cloudtrain.planning import LoraSpec


def attached(model, peft: str, spec: LoraSpec, task_type: str):
    """The model as training wraps it: cloudtrain.models.adapters.attach, trainable parameters in fp32."""
    cfg = Config(
        model=ModelConfig(
            peft=peft, lora_r=spec.r, lora_dropout=spec.dropout, lora_target_modules=list(spec.target_modules)
        )
    )
    heads = planning.task_for("causal_lm" if task_type == "CAUSAL_LM" else "classification").train_in_full(model)
    return adapters.attach(model, cfg, task_type, heads)


@pytest.mark.parametrize(
    "which,task,peft,targets",
    [
        ("llama", "causal_lm", "lora", ("all-linear",)),
        ("llama", "classification", "dora", ("all-linear",)),  # the score head trains in full, DoRA's magnitudes
        ("llama", "causal_lm", "lora", ("q_proj", "v_proj")),
        ("gpt2", "causal_lm", "lora", ("all-linear",)),  # GPT-2's Conv1D layers
        ("bert", "classification", "lora", ("all-linear",)),
    ],
)
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False")  # PEFT's note on GPT-2's Conv1D
def test_adapter_count_equals_peft_on_the_application_s_attach(which, task, peft, targets, tmp_path, tiny_model_dir):
    model_dir = {"llama": small_llama(tmp_path, 1000), "bert": tiny_model_dir}.get(which)
    if which == "gpt2":
        model_dir = str(tmp_path / "gpt2")
        GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0).save_pretrained(
            model_dir
        )
    spec = LoraSpec(8, targets)
    facts = planning.model_facts(model_dir, num_labels=3, task=task, lora=spec)
    auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    model = attached(
        auto.from_config(AutoConfig.from_pretrained(model_dir, num_labels=3)),
        peft,
        spec,
        "CAUSAL_LM" if task == "causal_lm" else "SEQ_CLS",
    )
    trainable, _ = model.get_nb_trainable_parameters()
    assert facts.adapters.trainable(peft) == trainable
    # the frozen base is kept whole: a head trained in full is held twice, frozen and as a trainable copy
    assert sum(p.numel() for p in model.parameters()) == facts.num_params + trainable
    assert (facts.adapters.head_params > 0) is (task == "classification")


def test_quantized_weights_are_every_linear_layer_but_the_head(tmp_path):
    model_dir = small_llama(tmp_path, 1000)
    for task in ("causal_lm", "classification"):
        facts = planning.model_facts(model_dir, task=task)
        with torch.device("meta"):
            auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
            model = auto.from_config(LlamaConfig.from_pretrained(model_dir))
        in_layers = [m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert facts.adapters.quantized_params == sum(in_layers)  # not the LM head nor the score head
        assert facts.adapters.largest_quantized == 64 * 256
    a, P = facts.adapters, facts.num_params
    params, _, _ = planning.adapter_state_bytes(facts, "qlora", setup(precision="bf16"))
    assert params == round(
        a.quantized_params * (0.5 + 1 / 64 + 4 / 16384) + 4 * (P - a.quantized_params) + 2 * a.largest_quantized
    ) + 4 * a.trainable("qlora")


def lora_step(model_dir: str, precision: str):
    """One forward/backward/AdamW step of a LoRA small Llama as training runs it (16-bit base under bf16)."""
    from cloudtrain.data.packing import causal_lm_forward, shifted_loss

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = attached(
        AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(model_dir), dtype=dtype),
        "lora",
        LoraSpec(),
        "CAUSAL_LM",
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 1000, (2, 32))
    batch = {"input_ids": ids, "position_ids": torch.arange(32).expand(2, 32), "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, _ = shifted_loss(causal_lm_forward(model, batch), batch["labels"])
    loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_measured_lora_model_states_after_one_step_match_the_estimate(precision, tmp_path):
    model_dir = small_llama(tmp_path, 1000)
    model, optimizer = lora_step(model_dir, precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    measured = {
        "parameters": tensor_bytes(model.parameters()),
        "gradients": tensor_bytes(p.grad for p in trainable),
        "optimizer_states": tensor_bytes(t for state in optimizer.state.values() for t in state.values()),
    }
    facts = planning.model_facts(model_dir, task="causal_lm")
    T, P = facts.adapters.trainable("lora"), facts.num_params
    estimated = dict(
        zip(measured, planning.adapter_state_bytes(facts, "lora", setup(precision=precision)), strict=True)
    )
    print(f"LoRA {precision}: measured vs estimated bytes", {k: (measured[k], estimated[k]) for k in measured})
    assert sum(measured.values()) == pytest.approx(sum(estimated.values()), rel=0.15)
    # the frozen base in the compute dtype, then 16 bytes per trainable parameter: fp32 weight 4, gradient 4 and
    # AdamW's two moments 8 (the estimate adds autocast's bf16 copies of the adapters to the gradients)
    assert measured["parameters"] == estimated["parameters"] == (2 if precision == "bf16" else 4) * P + 4 * T
    assert measured["gradients"] == 4 * T and estimated["gradients"] == 4 * T + (2 * T if precision == "bf16" else 0)
    assert estimated["optimizer_states"] == 8 * T
    assert measured["optimizer_states"] == pytest.approx(8 * T, rel=0.01)  # and AdamW's step counters


@pytest.mark.parametrize("peft", ["lora", "dora"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.05, 0.0])  # without dropout (the default), q, k and v keep one input
def test_adapter_activation_estimate_matches_what_autograd_saves(peft, checkpointing, dropout, tmp_path):
    model_dir = small_llama(tmp_path, 1000)
    spec = LoraSpec(dropout=dropout)
    facts = planning.model_facts(model_dir, task="causal_lm", lora=spec)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(model_dir), dtype=torch.float32)
    b, s = 4, 128
    batch = {
        "input_ids": torch.randint(0, 1000, (b, s)),
        "position_ids": torch.arange(s).expand(b, s),
        "use_cache": False,
    }
    measured = saved_activation_bytes(attached(base, peft, spec, "CAUSAL_LM"), batch, checkpointing)
    estimated, _ = planning.adapter_activation_bytes(facts, peft, b, s, half=False, checkpointing=checkpointing)
    if dropout and not checkpointing:  # the CPU's dropout keeps a 4-byte mask per input where CUDA keeps 1 byte
        estimated += 3 * b * s * facts.adapters.layer_inputs * facts.num_layers
    print(f"{peft} checkpointing={checkpointing}: saved activations measured {measured} vs estimated {estimated}")
    assert measured == pytest.approx(estimated, rel=0.1)


def test_lora_rows_hold_the_base_in_16_bits_and_16_bytes_per_adapter_parameter(decoder_dirs, tmp_path):
    plan = planning.make_plan(
        plan_args(
            decoder_dirs["8b"],
            tmp_path,
            task="causal_lm",
            gpu_memory_gb=80,
            mixed_precision="bf16",
            max_length=1024,
            per_device_train_batch_size=1,
        )
    )
    a, P = plan["model"]["adapters"], plan["model"]["num_params"]
    T = a["lora_params"]
    assert T == 16 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)) == 41_943_040  # r*(in+out)
    rows = {r["label"]: r for r in plan["strategies"]}
    full, lora, qlora = rows["DDP"]["estimate"], rows["LoRA + DDP"]["estimate"], rows["QLoRA + DDP"]["estimate"]
    assert (lora["parameters"], lora["gradients"], lora["optimizer_states"]) == (2 * P + 4 * T, 6 * T, 8 * T)
    assert qlora["optimizer_states"] == 8 * T and qlora["parameters"] < 0.6 * lora["parameters"]
    states = ("parameters", "gradients", "optimizer_states")
    assert sum(lora[k] for k in states) < 0.12 * 18 * P  # 2P + 18T against full fine-tuning's 18P
    # a step of one micro-batch: the fp32 gradients do not coexist with the activations (set to None after a step)
    released = 4 * P - full["gradients"] + 2 * P
    assert full["gradients"] >= 2 * P and 0 < released <= full["activations"] + full["logits"]
    assert lora["logits"] == full["logits"]
    assert rows["LoRA + DDP"]["fits"] and rows["LoRA + DDP"]["relative_step_time"] < 1
    assert plan["recommendation"]["peft"] == "none"  # full fine-tuning fits (with offload): adapters are no speed-up


def test_the_adapters_shared_inputs_are_found_on_the_meta_device_and_the_model_is_left_as_it_was():
    """q, k and v read one tensor, as do gate and up; BART's decoder needed eager attention for the probe (SDPA's
    mask reads values, which meta tensors have not: found in review)."""
    from transformers import BartConfig

    from cloudtrain.planning.facts import _adapted_shapes, _read_once

    h, inter = 64, 128
    llama = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=100)  # fmt: skip
    sizes = dict(encoder_ffn_dim=inter, decoder_ffn_dim=inter, vocab_size=100)
    bart = BartConfig(d_model=h, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, **sizes)  # fmt: skip
    cases = ((llama, AutoModelForCausalLM, lambda m: m.model.layers[0]),
             (bart, AutoModelForSeq2SeqLM, lambda m: m.model.decoder.layers[0]))  # fmt: skip
    for config, auto, layer_of in cases:
        with torch.device("meta"):
            model = auto.from_config(config)
        layer = layer_of(model)
        prefix = next(n for n, m in model.named_modules() if m is layer) + "."
        inputs = {n: s[0] for n, s in _adapted_shapes(model, ("all-linear",), []).items() if n.startswith(prefix)}
        # llama: q/k/v's input, o's, gate/up's and down's; BART's decoder: self q/k/v, out, cross q, cross k/v
        # (the encoder's output), cross out, fc1, fc2
        expected = 3 * h + inter if isinstance(config, LlamaConfig) else 6 * h + inter
        assert _read_once(model, layer, inputs) == expected < sum(inputs.values())
        assert model.config._attn_implementation == "sdpa"
