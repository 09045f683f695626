"""The memory planner against the libraries' own estimators, against bytes measured on CPU, and end to end.

- Model states agree with `accelerate estimate-memory` (accelerate.commands.estimate) and with
  DeepSpeed's `estimate_zero2/3_model_states_mem_needs`, called with the same parameter counts.
- After one real AdamW step on CPU, the bytes held by parameters, gradients and optimizer states of
  MiniLM and of a tiny random BERT are within 5% of the estimate; saved activations within 15%.
- Causal LMs: the LM head is counted (tied or not); the logits term is b*s*V*12 bytes, and on CPU
  it brings the estimate within 10% of the peak bytes of a real forward + loss + backward of a small
  Llama (which the layers' activations alone miss by far); `plan --task causal_lm --model_config
  llama-600m` end to end.
- Adapters: the LoRA/DoRA parameter count equals PEFT's on the app's own `adapters.attach` (Llama, GPT-2's
  Conv1D, BERT; all-linear and named targets; a classifier's head); after one real LoRA AdamW step the
  bytes of weights, gradients and optimizer states are within 15% of the estimate, and autograd's saved
  activations within 15%; LoRA, then QLoRA, is recommended only when no full fine-tuning fits.
- Pipelines: each process's parameters, gradients, AdamW states, activations in flight (GPipe all M, 1F1B
  S - k), logits and bubble against a hand computation on a tiny Llama's meta-device build; pipeline + data
  parallel recommended where every data-parallel strategy is over budget, with a torchrun command that parses
  (one node and two), and not where DDP fits.
- The CLI: `--json` parses and recommends, nothing-fits says what would fit, bad input is one line,
  and the emitted ZeRO-3 config trains the tiny model in a real 2-process CPU launch.
"""

import argparse
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, topic_rows
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
)

from cloudtrain import planning
from cloudtrain.cli import main
from cloudtrain.config import Config, ModelConfig
from cloudtrain.errors import UserError
from cloudtrain.models import adapters
from cloudtrain.planning import GIB, STRATEGIES, Candidate, LoraSpec, Setup

BY_KEY = {s.key: s for s in STRATEGIES}


def setup(num_gpus=1, num_nodes=1, precision="no", gib=80, max_length=128) -> Setup:
    return Setup(num_gpus, num_nodes, gib * GIB, None, max_length, precision)


def plan_args(model: str | None, output_dir: Path, **options) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    planning.add_arguments(parser)
    argv = (["--model_name_or_path", model] if model else []) + ["--output_dir", str(output_dir)]
    for name, value in options.items():
        argv += [f"--{name}", str(value)]
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def decoder_dirs(tmp_path_factory) -> dict[str, str]:
    """Configs only (no weights) of a ~1.3B GPT-2-style, a ~7B Llama-style and an 8B Llama-3-style decoder."""
    root = tmp_path_factory.mktemp("decoders")
    GPT2Config(n_embd=2048, n_layer=24, n_head=16).save_pretrained(root / "gpt2-1.3b")
    LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008, vocab_size=32000
    ).save_pretrained(root / "llama-7b")
    LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ).save_pretrained(root / "llama-8b")
    return {"1.3b": str(root / "gpt2-1.3b"), "7b": str(root / "llama-7b"), "8b": str(root / "llama-8b")}


def states(facts, key: str, s: Setup) -> int:
    return sum(planning.model_state_bytes(facts, BY_KEY[key], s))


# ---------------------------------------------------------------- the libraries' own estimators


@pytest.mark.parametrize("which", ["minilm", "1.3b"])
def test_model_states_agree_with_accelerate_estimate_memory(which, minilm_dir, decoder_dirs):
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig

    path = minilm_dir if which == "minilm" else decoder_dirs[which]
    facts = planning.model_facts(path, num_labels=2)
    with init_empty_weights():  # what estimate-memory does, minus the Hub look-up
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path, num_labels=2))
    total_bytes, _ = calculate_maximum_sizes(model)  # fp32 bytes of parameters and buffers
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert total_bytes - buffers == 4 * facts.num_params
    for accelerate_dtype, precision in (("float32", "no"), ("bfloat16", "bf16")):
        theirs = estimate_training_usage(total_bytes, accelerate_dtype)
        params, grads, optim = planning.model_state_bytes(facts, BY_KEY["ddp"], setup(precision=precision))
        for ours, key in ((params, "model"), (grads, "gradients"), (optim, "optimizer")):
            assert ours == pytest.approx(theirs[key], rel=2e-3), (accelerate_dtype, key)  # buffers: < 0.2%


def ds_params(model_dir: str) -> tuple[int, int]:
    """DeepSpeed's own count (total, largest layer) on the real model: needs real storages, not meta."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    return model_to_params(AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2))


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (2, 1), (8, 1), (8, 2)])
def test_model_states_agree_with_deepspeed_estimators(gpus, nodes, minilm_dir, decoder_dirs):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    minilm = planning.model_facts(minilm_dir, num_labels=2)
    assert ds_params(minilm_dir) == (minilm.num_params, minilm.largest_module_params)
    s = setup(gpus, nodes, precision="bf16")  # DeepSpeed's estimators assume 16-bit weights
    for facts in (minilm, planning.model_facts(decoder_dirs["7b"], num_labels=2)):
        P, L, kw = (
            facts.num_params,
            facts.largest_module_params,
            dict(num_gpus_per_node=gpus, num_nodes=nodes, additional_buffer_factor=1.0),
        )
        for key, offload in (("zero2", False), ("zero2_offload", True)):
            cpu, gpu = estimate_zero2_model_states_mem_needs(P, cpu_offload=offload, **kw)
            assert states(facts, key, s) == pytest.approx(gpu, abs=16), key
            if nodes == 1:  # DeepSpeed's ZeRO-2 CPU figure counts all GPUs of all nodes on each node
                assert max(planning.cpu_bytes(facts, BY_KEY[key], s)) == pytest.approx(cpu, abs=16), key
        for key, offload, offload_params in (
            ("zero3", False, False),
            ("zero3_offload", True, False),
            ("zero3_offload_all", True, True),
        ):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                P, L, cpu_offload=offload, cpu_offload_params=offload_params, **kw
            )
            assert states(facts, key, s) == pytest.approx(gpu, abs=16), key
            # DeepSpeed's ZeRO-3 CPU figure: the offloaded states, or (with no offload) loading layer by layer
            offloaded, load = planning.cpu_bytes(facts, BY_KEY[key], s)
            assert (offloaded if offload else load) == pytest.approx(cpu, abs=16), key


# ---------------------------------------------------------------- measured on CPU


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors: what they really hold."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def one_training_step(model_dir: str):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=3, dtype=torch.float32)
    rows = topic_rows(2)
    batch = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(**batch, labels=torch.tensor([i % 3 for i in range(len(rows))])).loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_measured_model_states_after_one_step_match_the_estimate(which, tiny_model_dir, minilm_dir):
    model_dir = tiny_model_dir if which == "tiny" else minilm_dir
    model, optimizer = one_training_step(model_dir)
    measured = {
        "parameters": tensor_bytes(model.parameters()),
        "gradients": tensor_bytes(p.grad for p in model.parameters()),
        "optimizer_states": tensor_bytes(t for state in optimizer.state.values() for t in state.values()),
    }
    facts = planning.model_facts(model_dir, num_labels=3)
    assert facts.num_params == sum(p.numel() for p in model.parameters())
    estimated = dict(
        zip(measured, planning.model_state_bytes(facts, BY_KEY["ddp"], setup(precision="no")), strict=True)
    )
    print(f"{which}: measured vs estimated bytes", {k: (measured[k], estimated[k]) for k in measured})
    for key in measured:
        assert measured[key] == pytest.approx(estimated[key], rel=0.05), key


def saved_activation_bytes(model, batch: dict, checkpointing: bool) -> int:
    """Bytes autograd keeps for the backward pass at the end of the forward pass (not the weights)."""
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return sum(saved.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_matches_what_autograd_saves(checkpointing, tiny_model_dir):
    facts = planning.model_facts(tiny_model_dir, num_labels=3)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    b, s = 8, 64
    batch = {
        "input_ids": torch.randint(1000, 2000, (b, s)),
        "attention_mask": torch.ones(b, s, dtype=torch.long),
        "labels": torch.zeros(b, dtype=torch.long),
    }
    measured = saved_activation_bytes(model, batch, checkpointing)
    estimated, _ = planning.activation_bytes(facts, b, s, half=False, checkpointing=checkpointing, residual_bytes=4)
    print(f"checkpointing={checkpointing}: saved activations measured {measured} vs estimated {estimated}")
    assert measured == pytest.approx(estimated, rel=0.15)


# ---------------------------------------------------------------- causal language models


def small_llama(root: Path, vocab: int, tied: bool = False) -> str:
    """A config (no weights) of a 2-layer, hidden-64 Llama with GQA."""
    out = root / f"llama-{vocab}-{'tied' if tied else 'untied'}"
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    ).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("tied", [False, True])
def test_causal_lm_counts_the_lm_head(tied, tmp_path):
    model_dir = small_llama(tmp_path, 1000, tied)
    facts = planning.model_facts(model_dir, task="causal_lm")
    real = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(model_dir))
    assert facts.num_params == sum(p.numel() for p in real.parameters())  # a tied head counted once
    classifier = planning.model_facts(model_dir, num_labels=2)
    head = 0 if tied else 1000 * 64  # the LM head replaces the classifier's score (64 x 2)
    assert facts.num_params - classifier.num_params == head - 64 * 2
    assert (facts.architecture, facts.vocab_size, classifier.vocab_size) == ("LlamaForCausalLM", 1000, 0)


def test_logits_term_is_the_formula_and_grows_linearly_with_the_vocabulary(tmp_path, minilm_dir):
    b, s = 4, 128
    per_vocab = {}
    for vocab in (1000, 2000, 8000):
        facts = planning.model_facts(small_llama(tmp_path, vocab), task="causal_lm")
        per_vocab[vocab] = planning.logits_bytes(facts, b, s, half=False)
        # fp32: logits 4 + fp32 copy 4 + cross-entropy's fp32 gradient 4
        assert planning.logits_bytes(facts, b, s, half=False) == b * s * vocab * (4 + 4 + 4)
        # bf16: the forward's 2 + 4 + 4 is less than the cross-entropy backward's three fp32 buffers
        assert planning.logits_bytes(facts, b, s, half=True) == b * s * vocab * 12
        for key in ("ddp", "zero3"):
            for gc in (False, True):  # whatever the strategy, checkpointing does not shrink them
                est = planning.estimate(facts, Candidate(BY_KEY[key], gc), setup(precision="bf16"), b)
                assert est.logits == b * s * vocab * 12
    assert per_vocab[2000] == 2 * per_vocab[1000] and per_vocab[8000] == 8 * per_vocab[1000]
    minilm = planning.model_facts(minilm_dir, num_labels=2)  # classification: no logits term
    assert planning.estimate(minilm, Candidate(BY_KEY["ddp"], False), setup(), 8).logits == 0


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while active (views and in-place results excluded): each storage
    counts from the op that allocates it until it is freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}  # data_ptr -> (bytes, the storage)
        self.at_peak: dict[int, tuple[int, weakref.ref]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() in inputs | self.live.keys():
                continue
            self.live[storage.data_ptr()] = storage.nbytes(), weakref.ref(storage)
            weakref.finalize(storage, self.live.pop, storage.data_ptr(), None)
            if self.bytes(self.live) > self.bytes(self.at_peak):
                self.at_peak = dict(self.live)
        return out

    @staticmethod
    def bytes(storages: dict, leave_out: frozenset = frozenset()) -> int:
        """Bytes of `storages`, less those whose storage (still alive) is one of `leave_out` (ids)."""
        return sum(n for n, ref in storages.values() if id(ref()) not in leave_out)


def measured_step_peak(model, batch: dict, precision: str) -> int:
    """Peak bytes of cloudtrain's forward + loss + backward, less the gradients (model states to the planner)."""
    from cloudtrain.data.packing import causal_lm_forward, shifted_loss

    model.train()
    with PeakBytes() as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = shifted_loss(causal_lm_forward(model, batch), batch["labels"])
        loss.backward()
    grads = frozenset(id(p.grad.untyped_storage()) for p in model.parameters())  # the same storage objects
    return tracker.bytes(tracker.at_peak, leave_out=grads)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_measured_peak_of_a_language_model_step_matches_the_estimate_with_logits(precision, tmp_path):
    b, s, vocab = 4, 128, 8000
    model_dir = small_llama(tmp_path, vocab)
    facts = planning.model_facts(model_dir, task="causal_lm")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(model_dir), dtype=torch.float32)
    ids = torch.randint(0, vocab, (b, s))
    measured = measured_step_peak(
        model, {"input_ids": ids, "position_ids": torch.arange(s).expand(b, s), "labels": ids}, precision
    )
    est = planning.estimate(facts, Candidate(BY_KEY["ddp"], False), setup(precision=precision, max_length=s), b)
    print(
        f"{precision}: peak measured {measured} vs estimated {est.activations + est.logits} "
        f"(layers {est.activations} + logits {est.logits})"
    )
    assert est.activations + est.logits == pytest.approx(measured, rel=0.10)
    assert est.activations < 0.25 * measured  # without the logits term the estimate is far too low


def test_plan_causal_lm_preset_end_to_end(tmp_path, lm_tokenizer_dir):
    args = dict(
        task="causal_lm",
        model_config="llama-600m",
        num_gpus=8,
        gpu_memory_gb=24,
        max_length=2048,
        per_device_train_batch_size=16,
        mixed_precision="bf16",
        global_batch_size=512,
    )
    plan = planning.make_plan(plan_args(None, tmp_path, **args))
    m, rec = plan["model"], plan["recommendation"]
    assert (m["architecture"], m["task"], m["vocab_size"], m["from_config"]) == (
        "LlamaForCausalLM",
        "causal_lm",
        32000,
        True,
    )
    assert rec is not None and rec["estimate"]["total"] <= 24 * GIB
    one = 16 * 2048 * 32000 * 12
    for row in plan["strategies"]:
        pipe = row["pipeline"]  # a pipeline's logits are its last stage's: none where another process needs more
        held = {one} if pipe is None else {0, one * (pipe["microbatches"] if pipe["schedule"] == "gpipe" else 1)}
        if row["tensor_parallel_size"] > 1:  # a group takes t times the rows, and its logits are gathered whole
            held = {one * row["tensor_parallel_size"]}
        if row["context_parallel_size"] > 1:  # c times the rows, 1/c of each one's tokens
            held = {one}
        assert row["estimate"]["logits"] in held
    assert {row["peft"] for row in plan["strategies"]} == {"none"}  # random weights: no base for adapters
    text = planning.render(plan)
    header = next(line for line in text.splitlines() if line.startswith("strategy"))
    assert header.split()[5:7] == ["activ", "logits"]
    assert f"logits {rec['estimate']['logits'] / GIB:.1f} GiB" in text and "--tokenizer_name_or_path" in text
    assert (
        "--task causal_lm --model_config llama-600m --tokenizer_name_or_path '<tokenizer dir or Hub id>'"
        in rec["command"]
    )
    # the logits are what keeps the micro-batch down: without them the same plan fits a larger one
    facts = planning.model_facts("llama-600m", task="causal_lm", from_config=True)
    s = Setup(8, 1, 24 * GIB, None, 2048, "bf16")
    chosen = next(c for c in planning.candidates() if c.name == rec["label"])
    assert planning.max_micro_batch(replace(facts, vocab_size=0), chosen, s) > 1.5 * planning.max_micro_batch(
        facts, chosen, s
    )
    # with the tokenizer, the preset's vocabulary is the one training builds (rounded up to a multiple of 64)
    exact = planning.make_plan(plan_args(None, tmp_path, tokenizer_name_or_path=lm_tokenizer_dir, **args))
    assert exact["model"]["vocab_size"] == math.ceil(len(AutoTokenizer.from_pretrained(lm_tokenizer_dir)) / 64) * 64
    vocab_notes = [
        n for n in exact["notes"] if "vocab" in n
    ]  # the others: tensor/context parallel rows (test_planner_tp)
    assert not vocab_notes and f"--tokenizer_name_or_path {lm_tokenizer_dir}" in exact["recommendation"]["command"]


def test_causal_lm_refuses_a_classifier(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="is not a causal language model"):
        planning.make_plan(plan_args(tiny_model_dir, tmp_path, task="causal_lm", gpu_memory_gb=24))


# ---------------------------------------------------------------- adapters


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
def test_adapter_activation_estimate_matches_what_autograd_saves(peft, checkpointing, tmp_path):
    model_dir = small_llama(tmp_path, 1000)
    spec = LoraSpec(dropout=0.05)
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
    if not checkpointing:  # the CPU's dropout keeps a 4-byte mask per input where CUDA keeps a 1-byte one
        estimated += 3 * b * s * facts.adapters.layer_inputs * facts.num_layers
    print(f"{peft} checkpointing={checkpointing}: saved activations measured {measured} vs estimated {estimated}")
    assert measured == pytest.approx(estimated, rel=0.15)


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


# ---------------------------------------------------------------- choosing


def test_recommendation_is_the_fastest_that_fits(decoder_dirs, tmp_path):
    for model, gib, expect_checkpointing in (("1.3b", 24, False), ("7b", 24, True), ("1.3b", 80, False)):
        plan = planning.make_plan(
            plan_args(
                decoder_dirs[model],
                tmp_path / model,
                num_gpus=8,
                gpu_memory_gb=gib,
                per_device_train_batch_size=8,
                max_length=512,
                mixed_precision="bf16",
                global_batch_size=256,
            )
        )
        rec = plan["recommendation"]
        rows = plan["strategies"]
        chosen = next(r for r in rows if r["label"] == rec["label"])
        assert chosen["fits"] and rec["estimate"]["total"] <= gib * GIB
        assert all(not r["fits"] for r in rows[: rows.index(chosen)])  # every faster one is over budget
        assert rec["gradient_checkpointing"] is expect_checkpointing
        assert rec["micro_batch"] * 8 * rec["gradient_accumulation_steps"] == 256
    assert plan["recommendation"]["strategy"] == "ddp"  # 1.3B on 80 GiB needs no sharding


def test_smaller_micro_batch_and_more_accumulation_when_the_requested_one_fits_nothing(decoder_dirs, tmp_path):
    plan = planning.make_plan(
        plan_args(
            decoder_dirs["7b"],
            tmp_path,
            num_gpus=8,
            gpu_memory_gb=24,
            per_device_train_batch_size=64,
            max_length=2048,
            mixed_precision="bf16",
            global_batch_size=512,
        )
    )
    rec = plan["recommendation"]
    assert not any(r["fits"] for r in plan["strategies"])
    assert 1 <= rec["micro_batch"] < 64 and rec["micro_batch"] * 8 * rec["gradient_accumulation_steps"] == 512
    assert any("fits no strategy" in reason for reason in rec["reasons"])


def emitted_config(command: str) -> Config:
    """The training configuration the printed launch command builds (its flags after the script)."""
    from cloudtrain.config import add_config_arguments, build_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = shlex.split(command)
    return build_config(vars(parser.parse_args(argv[argv.index(planning.TRAINING_APPLICATION) + 1 :])))


@pytest.mark.parametrize("max_length,expect", [(1024, "lora"), (4096, "qlora")])
def test_adapters_only_when_no_full_fine_tuning_fits_lora_before_qlora(max_length, expect, decoder_dirs, tmp_path):
    """8B on one 24 GiB GPU with 64 GiB of CPU memory: offloading needs more, so full fine-tuning fits nowhere;
    at 4096 tokens LoRA's 16-bit base plus the logits are over budget too, and QLoRA's 4-bit base is not."""
    plan = planning.make_plan(
        plan_args(
            decoder_dirs["8b"],
            tmp_path,
            task="causal_lm",
            gpu_memory_gb=24,
            cpu_memory_gb=64,
            mixed_precision="bf16",
            max_length=max_length,
            per_device_train_batch_size=1,
            global_batch_size=8,
        )
    )
    rec, rows = plan["recommendation"], plan["strategies"]
    assert rec["peft"] == expect and rec["gradient_checkpointing"] and rec["estimate"]["total"] <= 24 * GIB
    assert not any(r["max_micro_batch"] for r in rows if r["peft"] == "none")
    assert any("Full fine-tuning does not fit" in reason and "CPU memory" in reason for reason in rec["reasons"])
    if expect == "qlora":
        assert not any(r["max_micro_batch"] for r in rows if r["peft"] == "lora")
        assert any(reason.startswith("LoRA does not fit") for reason in rec["reasons"])
    cfg = emitted_config(rec["command"])
    assert (cfg.model.peft, cfg.model.lora_r, cfg.model.lora_target_modules, cfg.model.gradient_checkpointing) == (
        expect,
        16,
        ["all-linear"],
        True,
    )
    assert rec["strategy"] == "ddp" and not (tmp_path / "ds_config.json").exists()


def test_peft_option_restricts_the_choice_and_the_table_tells_full_fine_tuning_from_adapters(decoder_dirs, tmp_path):
    args = dict(num_gpus=8, gpu_memory_gb=80, per_device_train_batch_size=8, max_length=512, mixed_precision="bf16")
    auto = planning.make_plan(plan_args(decoder_dirs["1.3b"], tmp_path, **args))
    assert auto["recommendation"]["peft"] == "none"
    one_node = [s for s in STRATEGIES if s.fsdp_sharding != "hybrid_shard"]  # hybrid is full shard on one node
    under = len(planning.ADAPTER_STRATEGIES)  # adapters under DDP, ZeRO 1-3 and FSDP2
    assert [r["peft"] for r in auto["strategies"]] == ["none"] * 2 * len(one_node) + ["lora"] * 2 * under + [
        "qlora"
    ] * 2 * under
    lines = planning.render(auto).splitlines()
    full, adapters_title = (
        lines.index("full fine-tuning (every weight trains):"),
        next(i for i, line in enumerate(lines) if line.startswith("adapters under DDP, ZeRO and FSDP2 (recommended")),
    )
    assert lines[full + 1].split()[:2] == ["DDP", "1.00"] and full < adapters_title
    labels = [line.strip().split("  ")[0] for line in lines[adapters_title + 1 : adapters_title + 1 + 4 * under]]
    assert labels[0] == "LoRA + DDP" and labels[2 * under] == "QLoRA + DDP"
    assert {label.split(" + ")[1] for label in labels} == {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full shard"}
    for peft in ("qlora", "dora"):
        forced = planning.make_plan(plan_args(decoder_dirs["1.3b"], tmp_path / peft, peft=peft, **args))
        assert forced["recommendation"]["peft"] == peft and f"--peft {peft}" in forced["recommendation"]["command"]
    assert "dora" in {r["peft"] for r in forced["strategies"]}  # DoRA rows only when asked for
    dora, lora = (
        {r["gradient_checkpointing"]: r["estimate"] for r in forced["strategies"] if r["peft"] == p}
        for p in ("dora", "lora")
    )
    assert dora[False]["optimizer_states"] > lora[False]["optimizer_states"]  # its magnitude vectors
    assert dora[False]["activations"] > lora[False]["activations"]  # two output-sized tensors per module
    full_only = planning.make_plan(
        plan_args(
            decoder_dirs["8b"],
            tmp_path / "none",
            task="causal_lm",
            peft="none",
            gpu_memory_gb=24,
            cpu_memory_gb=64,
            mixed_precision="bf16",
        )
    )
    assert (
        full_only["recommendation"] is None
        and "drop --strategy/--gradient_checkpointing/--peft" in full_only["message"]
    )


def test_nothing_fits_says_what_would(decoder_dirs, tmp_path):
    args = dict(num_gpus=1, gpu_memory_gb=4, per_device_train_batch_size=8, max_length=4096, mixed_precision="no")
    plan = planning.make_plan(plan_args(decoder_dirs["7b"], tmp_path / "out", **args))
    assert plan["recommendation"] is None and not (tmp_path / "out").exists()
    shorter = next(idea for idea in plan["suggestions"] if "--max_length" in idea)
    length = int(shorter.split("--max_length ")[1].split()[0])
    assert length < 4096
    refit = planning.make_plan(plan_args(decoder_dirs["7b"], tmp_path / "out", **{**args, "max_length": length}))
    assert refit["recommendation"] is not None  # the suggestion really fits


def test_emitted_configs_load_in_accelerate_and_deepspeed(tiny_model_dir, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    for strategy in STRATEGIES:
        out = tmp_path / strategy.key
        plan = planning.make_plan(
            plan_args(
                tiny_model_dir,
                out,
                num_gpus=4,
                num_nodes=2,
                gpu_memory_gb=24,
                mixed_precision="bf16",
                strategy=strategy.key,
                gradient_checkpointing="false",
                nvme_gb=100,  # a disk for the ZeRO-Infinity row
            )
        )
        assert plan["recommendation"]["strategy"] == strategy.key
        if strategy.fsdp:  # torchrun with the application's FSDP flags: no config file
            assert plan["recommendation"]["files"] == {} and not out.exists()
            command = plan["recommendation"]["command"]
            assert shlex.split(command)[:5] == ["torchrun", "--nproc_per_node", "4", "--nnodes", "2"]
            d = emitted_config(command).distributed
            assert d.fsdp and d.fsdp_sharding_strategy == strategy.fsdp_sharding
            assert d.fsdp_cpu_offload is strategy.offload_param
            assert d.fsdp_reshard_after_forward in (None, strategy.reshard_after_forward)
            continue
        config = load_config_from_file(str(out / "accelerate_config.yaml"))
        assert (config.num_processes, config.num_machines, config.mixed_precision) == (8, 2, "bf16")
        if strategy.zero_stage is None:
            assert not (out / "ds_config.json").exists()
            assert config.distributed_type == "MULTI_GPU"
            continue
        assert Path(config.deepspeed_config["deepspeed_config_file"]) == (out / "ds_config.json").resolve()
        plugin = DeepSpeedPlugin(hf_ds_config=str(out / "ds_config.json"))
        assert plugin.zero_stage == strategy.zero_stage
        device = "nvme" if strategy.nvme else "cpu"
        assert (plugin.offload_optimizer_device == device) is strategy.offload_optimizer
        assert (plugin.offload_param_device == device) is strategy.offload_param
        for key in (
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "train_batch_size",
        ):
            assert plugin.deepspeed_config[key] == "auto"  # always the application's own flags


# ---------------------------------------------------------------- pipelines


def pipeline(pp: int, schedule: str, microbatches: int, checkpointing: bool = False) -> Candidate:
    pipe = planning.Pipeline(pp, schedule, microbatches, rows=microbatches)
    return Candidate(planning.PIPELINE, checkpointing, pipeline=pipe)


def test_pipeline_rows_hold_each_stage_and_its_micro_batches_in_flight(tmp_path):
    """A tiny Llama (6 layers, untied head) over 2 processes per pipeline, 2 pipelines, bf16: every number from
    the meta-device model's own modules and the formulas, not from the planner."""
    h, kv, inter, V, L, b, s, M = 64, 32, 128, 1000, 6, 2, 32, 8
    config = LlamaConfig(
        hidden_size=h,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=inter,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    layer, embed = count(model.model.layers[0]), count(model.model.embed_tokens)
    head = count(model.model.norm) + count(model.lm_head)
    assert layer == h * (h + 2 * kv + h) + 3 * h * inter + 2 * h  # q, k, v, o, gate/up/down, two norms
    facts = planning.model_facts(str(tmp_path), task="causal_lm")
    assert (facts.stages.embedding_params, facts.stages.head_params) == (embed, head) == (V * h, V * h + h)
    s4 = setup(num_gpus=4, precision="bf16", max_length=s)  # 2 pipelines of 2 processes

    c, H = 2, 4  # bf16 activations; the residual stream and the RMSNorms stay fp32 (fp32 weights under autocast)
    # per layer and token: both norms' fp32 inputs and normalised outputs; q, k, v, gate and up each cast their own
    # bf16 input; q, k and v repeated to 4 heads (a dense mask: no GQA in sdpa) and the output; the gated MLP
    # (silu's input, up, silu's output, down's input); the fp32 log-sum-exp per head; the mask as a bf16 bias
    A = s * b * (2 * 4 * h + 2 * 4 * h + c * 5 * h + c * 4 * h + c * inter * 4 + 4 * H + c * s)
    E, W = s * b * h * (4 + 4 + c), c * s * b * (h + inter)  # the final norm, the head's input; working space
    logits = b * s * V * 12
    hidden = 4 * s * b * h  # one micro-batch's hidden states, as sent between stages
    # 6 layers + 2 ends in 2 stages: 4 units each, one of them the embeddings or the head: 3 layers per stage
    held = [3 * layer + embed, 3 * layer + head]
    in_flight = {"gpipe": [M, M], "1f1b": [2, 1]}  # GPipe: every forward first; 1F1B: S - k warm-up forwards
    for schedule, flights in in_flight.items():
        estimates = planning.rank_estimates(facts, pipeline(2, schedule, M), s4, b)
        for k, est in enumerate(estimates):
            P = held[k]
            assert (est.parameters, est.gradients, est.optimizer_states) == (4 * P, 6 * P, 8 * P)  # + bf16 copies
            assert est.activations == flights[k] * (3 * A + E) + W, (schedule, k)
            kept = M if schedule == "gpipe" else 1  # GPipe keeps every micro-batch's loss for its backward
            assert est.logits == (kept * logits if k == 1 else 0)
            receives = M * hidden  # stage 1 receives activations, stage 0 their gradients
            rest = est.parameters + est.gradients + est.optimizer_states + est.activations + est.logits
            assert est.overhead == round(GIB + receives + 4 * P + 0.05 * rest)  # + the flat gradients all-reduced
        assert planning.estimate(facts, pipeline(2, schedule, M), s4, b) == max(estimates, key=lambda e: e.total)
    gpipe, one_f_one_b = (planning.estimate(facts, pipeline(2, k, M), s4, b) for k in ("gpipe", "1f1b"))
    assert gpipe.activations > one_f_one_b.activations and gpipe.total > one_f_one_b.total  # M > S

    # checkpointing: each in-flight micro-batch keeps the fp32 residual at its layers' inputs, one layer recomputed
    (est,) = planning.rank_estimates(facts, pipeline(2, "1f1b", M, checkpointing=True), s4, b)[:1]
    assert est.activations == 2 * (3 * hidden + E) + A + W
    # 4 processes, 1F1B: 8 units, 2 per stage, so 1, 2, 2, 1 layers; process 1 holds S - 1 = 3 micro-batches of 2
    ranks = planning.rank_estimates(facts, pipeline(4, "1f1b", M), s4, b)
    assert [e.parameters // 4 for e in ranks] == [layer + embed, 2 * layer, 2 * layer, layer + head]
    assert [e.activations for e in ranks] == [4 * (A + E) + W, 3 * 2 * A + W, 2 * 2 * A + W, A + E + W]
    # interleaved, 2 processes x 2 stages of 1, 2, 2, 1 layers: process 0 holds stages 0 and 2, and at its peak
    # (v - 1)pp + 2(pp - 1) + 1 = 5 stage micro-batches (Korthikanti et al.: l(1 + (pp - 1)/(v pp)) layers)
    inter_ranks = planning.rank_estimates(facts, pipeline(2, "interleaved_1f1b", M), s4, b)
    assert inter_ranks[0].parameters == 4 * (3 * layer + embed)
    assert inter_ranks[0].activations == 5 * (2 * A + E) + W
    # bubble: (pp - 1) / (v M) of the compute, in the step time
    assert pipeline(2, "1f1b", M).speed == pytest.approx(1 + 1 / M)
    assert pipeline(4, "interleaved_1f1b", M, checkpointing=True).speed == pytest.approx(1.33 * (1 + 3 / (2 * M)))


def test_pipeline_recommended_where_every_data_parallel_strategy_is_over_budget(decoder_dirs, tmp_path):
    """8B in fp32 on 2 x 70 GiB (one node of 2 GPUs, or two of 1): offloading needs more CPU memory than the node
    has (16 bytes per parameter, shared by its GPUs), ZeRO-3 and FSDP hold all 32 layers' activations and the
    logits on both GPUs; a 2-process pipeline holds half the layers' states per GPU without ZeRO-3's gathered
    embeddings or FSDP's gathered root, and the logits on one (each process loads the fp32 model: 4 bytes)."""
    args = dict(
        task="causal_lm", gpu_memory_gb=70, max_length=1024, per_device_train_batch_size=1, mixed_precision="no"
    )
    commands = []
    for gpus, nodes, cpu_gib in ((2, 1, 100), (1, 2, 50)):
        options = dict(num_gpus=gpus, num_nodes=nodes, cpu_memory_gb=cpu_gib, **args)
        plan = planning.make_plan(plan_args(decoder_dirs["8b"], tmp_path / str(nodes), **options))
        rows, rec = plan["strategies"], plan["recommendation"]
        data_parallel = [r for r in rows if r["peft"] == "none" and r["pipeline"] is None]
        split = [r for r in data_parallel if r["tensor_parallel_size"] > 1 or r["context_parallel_size"] > 1]
        assert not any(r["max_micro_batch"] for r in data_parallel if r not in split)
        if split:  # one node of 2: tensor parallel 2 with checkpointing fits, and beats the pipelines that do
            assert rec["tensor_parallel_size"] == 2 and rec["gradient_checkpointing"]
            tp = next(r for r in rows if r["label"] == rec["label"])
            pipes = [r for r in rows if r["pipeline"] is not None and r["max_micro_batch"]]
            assert pipes and all(r["relative_step_time"] > tp["relative_step_time"] for r in pipes)
            plan = planning.make_plan(plan_args(decoder_dirs["8b"], tmp_path / "pp", strategy="pipeline", **options))
            rows, rec = plan["strategies"], plan["recommendation"]
        assert rec["strategy"] == "pipeline" and rec["estimate"]["total"] <= 70 * GIB
        chosen = next(r for r in rows if r["label"] == rec["label"])
        faster = [r for r in data_parallel if r not in split and r["relative_step_time"] < chosen["relative_step_time"]]
        assert faster and not any(r["fits"] for r in faster)
        pipe = rec["pipeline"]
        cfg = emitted_config(rec["command"])
        assert (cfg.training.training_type, cfg.distributed.pipeline_parallel_size) == ("pipeline", 2)
        assert (cfg.distributed.pipeline_schedule, cfg.distributed.pipeline_microbatches) == (
            pipe["schedule"],
            pipe["microbatches"],
        )
        stages_per_rank = 2 if pipe["schedule"] == "interleaved_1f1b" else 1
        assert cfg.distributed.pipeline_stages_per_rank == stages_per_rank
        rows_per_step = cfg.training.per_device_train_batch_size
        assert rows_per_step == pipe["microbatches"] * rec["micro_batch"]  # B = M micro-batches of b rows
        assert rows_per_step * rec["gradient_accumulation_steps"] == 2  # 1 pipeline takes the global batch
        assert rec["files"] == {} and not (tmp_path / str(nodes)).exists()  # torchrun needs no config file
        assert not (tmp_path / "pp").exists()
        commands.append(shlex.split(rec["command"]))
    assert commands[0][:3] == ["torchrun", "--nproc_per_node", "2"]
    assert commands[1][:5] == ["torchrun", "--nproc_per_node", "1", "--nnodes", "2"] and "--node_rank" in commands[1]


def test_pipeline_not_recommended_where_ddp_fits(decoder_dirs, tmp_path):
    plan = planning.make_plan(
        plan_args(
            decoder_dirs["1.3b"],
            tmp_path,
            task="causal_lm",
            num_gpus=8,
            gpu_memory_gb=80,
            per_device_train_batch_size=4,
            max_length=512,
            mixed_precision="bf16",
        )
    )
    pipes = [r for r in plan["strategies"] if r["pipeline"]]
    assert {r["pipeline"]["parallel_size"] for r in pipes} == {2, 4, 8}  # GPT-2 cuts; pp divides the 8 GPUs
    assert any(r["fits"] for r in pipes) and plan["recommendation"]["strategy"] == "ddp"
    assert "pipeline + data parallel (--training_type pipeline)" in planning.render(plan)


def test_every_row_s_mesh_is_the_one_its_trainer_builds():
    """A row arranges the GPUs as the trainer its launch command names (--training_type) would: DDP replicates,
    ZeRO and FSDP shard, a pipeline of pp processes runs beside world / pp others."""
    from cloudtrain.config import DistributedConfig
    from cloudtrain.registry import TRAINERS

    s = setup(num_gpus=4, num_nodes=2)
    for strategy in STRATEGIES:
        offload = {True: "cpu", False: "none"}
        fsdp = dict(fsdp_sharding_strategy=strategy.fsdp_sharding, fsdp_cpu_offload=strategy.offload_param)
        options = DistributedConfig(
            zero_stage=strategy.zero_stage,
            fsdp=strategy.fsdp,
            offload_optimizer=offload[strategy.offload_optimizer and not strategy.fsdp],
            offload_param=offload[strategy.offload_param and not strategy.fsdp],
            **(fsdp if strategy.fsdp else {}),
        )
        trainer = TRAINERS[strategy.trainer]
        mesh = Candidate(strategy, False).mesh(s)
        if strategy.fsdp_sharding in ("hybrid_shard", "no_shard"):  # the degrees the FSDP2 launch builds
            from cloudtrain.parallel.fsdp import shard_degrees

            assert (mesh.dp_replicate, mesh.dp_shard) == shard_degrees(strategy.fsdp_sharding, 8, 4), strategy.key
            continue
        assert mesh == trainer.mesh(Config(distributed=options), 8), strategy.key
    for pp in (2, 4, 8):
        built = TRAINERS[planning.PIPELINE.trainer].mesh(
            Config(distributed=DistributedConfig(pipeline_parallel_size=pp)), 8
        )
        assert pipeline(pp, "1f1b", 8).mesh(s) == built and built.pp == pp


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_plan_json_parses_and_recommends(tiny_model_dir, tmp_path):
    result = run_cli(
        "plan",
        "--model_name_or_path",
        tiny_model_dir,
        "--num_gpus",
        "8",
        "--gpu_memory_gb",
        "24",
        "--per_device_train_batch_size",
        "8",
        "--global_batch_size",
        "128",
        "--mixed_precision",
        "no",
        "--json",
        "--output_dir",
        str(tmp_path / "plan"),
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    one_node = set(BY_KEY) - {"fsdp_hybrid"}  # on one node hybrid sharding is full sharding
    adapters = 2 * 2 * len(planning.ADAPTER_STRATEGIES)  # LoRA and QLoRA, with and without checkpointing
    assert len(plan["strategies"]) == 2 * len(one_node) + adapters
    assert {r["strategy"] for r in plan["strategies"]} == one_node
    rec = plan["recommendation"]
    assert (rec["strategy"], rec["gradient_checkpointing"]) == ("ddp", False)  # a tiny model needs nothing more
    assert (rec["micro_batch"], rec["gradient_accumulation_steps"]) == (8, 2)
    assert "--per_device_train_batch_size 8 --gradient_accumulation_steps 2 --mixed_precision no" in rec["command"]
    assert Path(rec["files"]["accelerate_config"]).is_file()


@pytest.mark.slow
def test_table_output_shows_every_strategy_and_the_nothing_fits_advice(decoder_dirs, tmp_path):
    result = run_cli(
        "plan",
        "--model_name_or_path",
        decoder_dirs["7b"],
        "--gpu_memory_gb",
        "4",
        "--max_length",
        "4096",
        "--mixed_precision",
        "no",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    for strategy in STRATEGIES:  # on one node hybrid sharding is full sharding: no row of its own
        assert (strategy.label in result.stdout) is (strategy.fsdp_sharding != "hybrid_shard"), strategy.key
    assert "Nothing fits" in result.stdout and "--max_length" in result.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model_name_or_path", "{tmp}/no-model"], "--model_name_or_path .*no-model does not exist"),
        (["--model_name_or_path", "{tmp}"], "could not read a model config from"),
        (
            ["--global_batch_size", "100", "--num_gpus", "8"],
            "--global_batch_size 100 must be a positive multiple of the 8",
        ),
        (["--gpu_memory_gb", "0"], "--gpu_memory_gb must be positive"),
        (["--strategy", "zero4"], "invalid choice: 'zero4'"),
        (["--task", "causal_lm"], "--task causal_lm needs --model_name_or_path <causal LM> or --model_config"),
        (["--model_config", "llama-8m"], "--model_config is for --task causal_lm"),
        (["--task", "causal_lm", "--model_config", "llama-9b"], "neither a config.json file nor a preset"),
        (
            ["--task", "causal_lm", "--model_config", "llama-8m", "--peft", "qlora"],
            "--peft qlora trains adapters on pretrained weights",
        ),
        (
            ["--lora_target_modules", "query,nope"],
            "--lora_target_modules: nope is not a linear layer of the model; its "
            "linear layers are dense, key, query, value",
        ),
        (["--lora_r", "0"], "--lora_r must be at least 1"),
        (
            ["--task", "causal_lm", "--model_config", "llama-8m", "--strategy", "pipeline"],
            "--strategy pipeline: no pipeline can run here: it needs at least 2 GPUs",
        ),
        (["--strategy", "pipeline", "--num_gpus", "2"], "cuts causal LMs of the Llama family and GPT-2 only"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--gpu_memory_gb" not in argv:
        argv += ["--gpu_memory_gb", "24"]
    assert main(["plan", *argv, "--output_dir", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_plan_takes_the_training_options_with_the_application_s_defaults(tiny_model_dir, tmp_path, monkeypatch):
    """One source: the training options `plan` takes default to the application's; auto precision resolves as
    training resolves it; auto micro-batch keeps the global batch and takes the largest micro-batch that fits."""
    from cloudtrain.hardware import resolve_precision

    args = plan_args(None, tmp_path, gpu_memory_gb=24)
    defaults = Config().to_dict()
    assert {name: getattr(args, name) for name in planning.TRAINING_OPTIONS} == {
        name: defaults[name] for name in planning.TRAINING_OPTIONS
    }
    assert args.mixed_precision == "auto"
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    plan = planning.make_plan(plan_args(tiny_model_dir, tmp_path / "auto", gpu_memory_gb=24, num_gpus=2))
    assert plan["setup"]["mixed_precision"] == resolve_precision("auto")
    assert any(note.startswith("--mixed_precision auto is") for note in plan["notes"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # an accelerate launch's precision, as in training
    plan = planning.make_plan(plan_args(tiny_model_dir, tmp_path / "fp16", gpu_memory_gb=24, num_gpus=2))
    assert plan["setup"]["mixed_precision"] == "fp16" and "--mixed_precision fp16" in plan["recommendation"]["command"]
    for global_batch, per_gpu in ((None, 16), (64, 32)):  # training's auto: 16 x processes, or --global_batch_size
        given = {"global_batch_size": global_batch} if global_batch else {}
        plan = planning.make_plan(
            plan_args(
                tiny_model_dir,
                tmp_path / "batch",
                gpu_memory_gb=24,
                num_gpus=2,
                per_device_train_batch_size="auto",
                mixed_precision="no",
                **given,
            )
        )
        rec = plan["recommendation"]
        assert (plan["requested_micro_batch"], plan["global_batch_size"]) == (per_gpu, 2 * per_gpu)
        assert (rec["micro_batch"], rec["gradient_accumulation_steps"]) == (per_gpu, 1)  # a tiny model fits it all


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_emitted_zero3_config_trains_two_processes_on_cpu(tiny_model_dir, topic_csvs, tmp_path):
    """The printed command, run as printed (plus data and a short run), with the written configs."""
    plan = planning.make_plan(
        plan_args(
            tiny_model_dir,
            tmp_path / "plan",
            num_labels=3,
            num_gpus=2,
            gpu_memory_gb=24,
            per_device_train_batch_size=4,
            global_batch_size=16,
            strategy="zero3",
            mixed_precision="no",
        )
    )
    command = shlex.split(plan["recommendation"]["command"])
    assert command[:3] == ["accelerate", "launch", "--config_file"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", free_port()]
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(
        launcher
        + command[2:]
        + [
            "--train_file",
            str(topic_csvs["train"]),
            "--validation_file",
            str(topic_csvs["validation"]),
            "--max_steps",
            "3",
            "--eval_strategy",
            "no",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    assert "2 process(es)" in result.stdout and "ZeRO-3" in result.stdout
    assert "(4 per device x 2 x 2 accumulation)" in result.stdout
    saved = AutoModelForSequenceClassification.from_pretrained(out)  # the gathered full model, not a shard
    assert sum(p.numel() for p in saved.parameters()) == plan["model"]["num_params"]
