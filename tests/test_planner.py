"""The memory planner's model-state and activation estimates against the libraries' own estimators and against
bytes measured on CPU, and the helpers every tests/test_planner_*.py file shares (plan_args, setup, the decoder
configs fixture, the byte counters).

- Model states agree with `accelerate estimate-memory` (accelerate.commands.estimate) and with
  DeepSpeed's `estimate_zero2/3_model_states_mem_needs`, called with the same parameter counts.
- After one real AdamW step on CPU, the bytes held by parameters, gradients and optimizer states of
  MiniLM and of a tiny random BERT are within 5% of the estimate; saved activations within 15%.

The rest of the planner's tests, by subject: test_planner_causal_lm.py (the LM head and logits),
test_planner_adapters.py (LoRA, DoRA, QLoRA), test_planner_recommendations.py (the choice),
test_planner_pipeline.py (pipeline rows), test_planner_cli.py (the command line and bad input); and
test_planner_fsdp.py, _tp.py, _dpo.py, _t2i.py, _reach.py.
"""

import argparse
from pathlib import Path

import pytest
import torch
from conftest import topic_rows
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
)

from cloudtrain import planning
from cloudtrain.planning import GIB, STRATEGIES, Setup

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


@pytest.fixture(scope="module", name="decoder_dirs")  # imported by the other test_planner_*.py files
def decoder_dirs_fixture(tmp_path_factory) -> dict[str, str]:
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
