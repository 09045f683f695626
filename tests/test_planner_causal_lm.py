"""The memory planner on causal language models: the LM head is counted (tied or not); the logits term is
b*s*V*12 bytes, and on CPU it brings the estimate within 10% of the peak bytes of a real forward + loss + backward
of a small Llama (which the layers' activations alone miss by far); `plan --task causal_lm --model_config
llama-600m` end to end; a classifier is refused."""

import math
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_planner import (
    BY_KEY,
    plan_args,
    setup,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from cloudtrain import planning
from cloudtrain.errors import UserError
from cloudtrain.planning import GIB, Candidate, Setup


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
    assert planning.max_micro_batch(replace(facts, vocab_size=0), chosen, s) >= 1.5 * planning.max_micro_batch(
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


def test_the_pre_training_check_plans_the_run_s_attention_as_plan_does(tmp_path, lm_tokenizer_dir):
    """--attn_implementation eager keeps every layer's scores: `plan` counted them, the pre-training check (and
    --per_device_train_batch_size auto where no probe runs) kept the meta model's sdpa (found in audit)."""
    from cloudtrain.config import build_config
    from cloudtrain.planning.search import run_micro_batch

    options = dict(task="causal_lm", model_config="llama-8m", max_length=1024, mixed_precision="bf16")

    def check(attention: str) -> int:
        cfg = build_config({**options, "tokenizer_name_or_path": lm_tokenizer_dir, "attn_implementation": attention})
        return run_micro_batch(cfg, 2, 1, 1, 24 * GIB, 1024)

    plan = planning.make_plan(
        plan_args(
            None,
            tmp_path,
            **options,
            tokenizer_name_or_path=lm_tokenizer_dir,
            attn_implementation="eager",
            gpu_memory_gb=24,
            strategy="ddp",
            peft="none",
            gradient_checkpointing="false",
        )
    )
    ddp = next(r for r in plan["strategies"] if r["strategy"] == "ddp" and not r["gradient_checkpointing"])
    assert check("eager") == ddp["max_micro_batch"] < check("sdpa")
