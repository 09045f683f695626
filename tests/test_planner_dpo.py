"""The planner's DPO rows (issue 31): the full-fine-tuning reference copy, whole under DDP and ZeRO-1/2, sharded
as the policy's parameters under every FSDP2 variant (no gradients, no optimizer states), in CPU memory with
FSDP2's offload; the rows the run refuses left out, with the run's own line.

- Each strategy's terms against a hand computation on a tiny Llama's meta-device build.
- A 7B plan where only FSDP2 fits full fine-tuning with the copy: its row, its reason, its launch command (which
  the run's own check accepts), and what would free the copy.
- For every strategy, adapters or not, reference live or precomputed: the planner has a row exactly when the
  run's check_options accepts that launch (a real tiny Llama with a tokenizer).
"""

import re
import shlex
from dataclasses import replace

import pytest
import torch
from test_planner import plan_args
from transformers import AutoModelForCausalLM, LlamaConfig

from cloudtrain import planning
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.planning import GIB, STRATEGIES, Candidate, Setup
from cloudtrain.tasks import build_task

BY_KEY = {s.key: s for s in STRATEGIES}


@pytest.fixture(scope="module")
def tiny_facts(tmp_path_factory):
    """A 4-layer Llama config (no weights), its facts for --task dpo and its parameter count on the meta device."""
    root = tmp_path_factory.mktemp("tiny-dpo")
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    config.save_pretrained(root)
    with torch.device("meta"):
        P = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return planning.model_facts(str(root), task="dpo"), P


def test_the_reference_copy_under_each_strategy_against_a_hand_computation(tiny_facts):
    m, P = tiny_facts
    assert m.num_params == P
    with_copy, without = replace(m, model_copy=True), replace(m, model_copy=False)
    setup = Setup(4, 2, 80 * GIB, None, 32, "bf16")  # 2 nodes x 4 GPUs
    # per GPU: whole in fp32 where the policy is replicated or ZeRO-1/2 (DeepSpeed moves the copy whole); under
    # FSDP2 the policy's shard degree (hybrid: a node's 4; no shard: 1); with CPU offload none on the GPU
    on_gpu = {
        "ddp": 4 * P,
        "zero1": 4 * P,
        "zero2": 4 * P,
        "zero2_offload": 4 * P,
        "fsdp": 4 * P // 8,
        "fsdp_grad_op": 4 * P // 8,
        "fsdp_hybrid": 4 * P // 4,
        "fsdp_no_shard": 4 * P,
        "fsdp_offload": 0,
    }
    for key, copy_bytes in on_gpu.items():
        cand = Candidate(BY_KEY[key], False)
        a, b = planning.estimate(with_copy, cand, setup, 2), planning.estimate(without, cand, setup, 2)
        assert a.parameters - b.parameters == copy_bytes, key
        assert (a.gradients, a.optimizer_states, a.activations) == (b.gradients, b.optimizer_states, b.activations)
        # CPU per node: every process holds the copy beside the loaded model (4 processes x 4P); FSDP2's offload
        # keeps its fp32 shards there (4 processes x 4P / 8)
        assert a.cpu_load - b.cpu_load == 4 * 4 * P, key
        assert a.cpu_offloaded - b.cpu_offloaded == (4 * 4 * P // 8 if key == "fsdp_offload" else 0), key
        # adapters: the reference is the base with the adapters disabled, nothing more
        lora = Candidate(BY_KEY[key], False, peft="lora")
        assert planning.estimate(with_copy, lora, setup, 2) == planning.estimate(without, lora, setup, 2)


def test_a_7b_whose_copy_fits_only_sharded_is_planned_under_fsdp2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(task="dpo", num_gpus=8, gpu_memory_gb=40, max_length=1024, mixed_precision="bf16", peft="none")
    plan = planning.make_plan(plan_args("llama-2-7b", tmp_path / "p", **args))
    P = plan["model"]["num_params"]
    rows = {(r["strategy"], r["gradient_checkpointing"]): r for r in plan["strategies"] if r["peft"] == "none"}
    # the run refuses the copy under ZeRO-3; the planner estimates none under TP/CP
    assert not [k for k in rows if k[0].startswith("zero3") or k[0] in ("tp", "tp_fsdp", "cp_fsdp")]
    fsdp = rows[("fsdp", True)]["estimate"]
    P_root_layers = plan["model"]["root_params"] + 2 * plan["model"]["layer_params"]
    # the policy's fp32 shard and its gathered bf16 units, plus the copy's fp32 shard
    assert fsdp["parameters"] == 4 * P // 8 + 2 * P_root_layers + 4 * P // 8
    # against SimPO (reference-free, no copy): the same gradients, optimizer states and activations
    simpo = planning.make_plan(plan_args("llama-2-7b", tmp_path / "s", preference_loss="simpo", **args))
    free = next(r for r in simpo["strategies"] if (r["strategy"], r["peft"], r["gradient_checkpointing"]) == (
        "fsdp", "none", True))["estimate"]  # fmt: skip
    assert fsdp["parameters"] - free["parameters"] == 4 * P // 8
    # reference-free, the run still refuses TP and CP for a pair loss: no such rows either
    assert not [r for r in simpo["strategies"] if r["strategy"] in ("tp", "tp_fsdp", "cp_fsdp")]
    assert [fsdp[k] for k in ("gradients", "optimizer_states", "activations")] == [
        free[k] for k in ("gradients", "optimizer_states", "activations")
    ]
    rec = plan["recommendation"]
    # FSDP2: shard grad-op with checkpointing fits 8 of the 16 rows asked, 8,192 tokens per GPU, and is faster at
    # the same global batch than full shard fitting all 16
    assert rec["strategy"] == "fsdp_grad_op" and rec["gradient_checkpointing"]
    assert any(f["strategy"] == "fsdp" for f in plan["fallbacks"])
    reasons = " ".join(rec["reasons"])
    assert "frozen fp32 copy of the model sharded as the policy's parameters over 8 process(es)" in reasons
    assert "--peft lora would free it (--precompute_reference true runs under DDP or ZeRO-1/2 only)" in reasons
    # nothing without sharding fits with the copy whole: no row of those fits a micro-batch
    assert all(not rows[(k, c)]["max_micro_batch"] for k in ("ddp", "zero1", "zero2") for c in (True, False))
    # the launch command is one the run accepts: --task dpo under FSDP2, full fine-tuning, a live reference
    argv = shlex.split(rec["command"])
    flags = argv[argv.index("--training_type") :]
    assert flags[flags.index("--task") + 1] == "dpo" and flags[flags.index("--fsdp") + 1] == "true"
    assert "--precompute_reference" not in flags and "--peft" not in flags
    # the fallbacks are rows the run takes too
    assert not any(f["label"].startswith(("ZeRO-3", "TP", "CP")) for f in plan["fallbacks"])


def test_a_strategy_the_run_refuses_is_refused_with_the_run_s_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(task="dpo", num_gpus=8, gpu_memory_gb=80, max_length=512, mixed_precision="bf16")
    with pytest.raises(UserError) as zero3:
        planning.make_plan(plan_args("llama-2-7b", tmp_path / "a", strategy="zero3", peft="none", **args))
    assert re.fullmatch(
        r"--strategy zero3: the run refuses it: --task dpo under ZeRO-3 with full fine-tuning: the reference copy "
        r"would be whole in every process; use --fsdp true .*",
        str(zero3.value),
    )
    with pytest.raises(UserError) as fsdp:
        planning.make_plan(
            plan_args("llama-2-7b", tmp_path / "b", strategy="fsdp", precompute_reference="true", **args)
        )
    assert "the run refuses it: --task dpo under FSDP with --precompute_reference true" in str(fsdp.value)
    assert "\n" not in str(zero3.value) + str(fsdp.value)
    # LoRA's live reference is the base, which ZeRO-3 shards: planned
    lora = planning.make_plan(plan_args("llama-2-7b", tmp_path / "c", strategy="zero3", peft="lora", **args))
    assert lora["recommendation"]["label"].startswith("LoRA + ZeRO-3")
    # --peft auto: the adapters are planned, and the note says why full fine-tuning is not (found in audit)
    either = planning.make_plan(plan_args("llama-2-7b", tmp_path / "d", strategy="zero3", **args))
    assert either["recommendation"]["label"].startswith("LoRA + ZeRO-3")
    assert any(n.startswith("--strategy zero3: the run refuses some of its rows (--task dpo under ZeRO-3 with full")
               for n in either["notes"])  # fmt: skip
    # a pipeline does not train a pair's loss: the run's rule, not "does not fit" with advice on GPU size
    with pytest.raises(UserError, match="--strategy pipeline: --training_type pipeline does not train --task dpo"):
        planning.make_plan(plan_args("llama-2-7b", tmp_path / "e", strategy="pipeline", **args))


def _launch_config(base: dict, key: str, peft: str, precompute: bool):
    s = BY_KEY[key]
    options = {**base, "peft": peft, "precompute_reference": precompute}
    if s.zero_stage is not None:
        options["zero_stage"] = s.zero_stage
    if s.fsdp:
        options["fsdp"] = True
    return build_config(options)


def test_the_planner_has_a_row_exactly_where_the_run_accepts_the_launch(tiny_llama_dir, tmp_path):
    """Every row the planner knows (SimPO's: reference-free, nothing refused) x (full, LoRA) x (live, precomputed
    reference): a DPO row iff the run's check_options accepts that launch."""
    base = {"task": "dpo", "model_name_or_path": tiny_llama_dir}
    args = dict(task="dpo", num_gpus=2, num_nodes=2, gpu_memory_gb=80, max_length=64, mixed_precision="bf16")

    def planned(name: str, **options) -> set[tuple[str, str]]:
        plan = planning.make_plan(plan_args(tiny_llama_dir, tmp_path / name, **args, **options))
        return {
            (r["strategy"], r["peft"])
            for r in plan["strategies"]
            if r["peft"] in ("none", "lora") and r["strategy"] in BY_KEY
        }

    every = planned("simpo", preference_loss="simpo")
    assert ("fsdp_no_shard", "none") not in every  # the run trains it as DDP: the DDP row (found in audit)
    assert (
        {(key, "none") for key in BY_KEY if key != "fsdp_no_shard"} <= every
        and ("zero3", "lora") in every
        and ("fsdp", "lora") in every
    )
    for precompute in (False, True):
        rows = planned(str(precompute), precompute_reference=str(precompute).lower())
        for key, peft in every:
            cfg = _launch_config(base, key, peft, precompute)
            try:
                build_task(cfg).check_options(cfg)
                accepted = True
            except UserError:
                accepted = False
            assert ((key, peft) in rows) == accepted, (key, peft, precompute)


def test_a_pair_tasks_rows_are_counted_as_the_two_answers_they_run(tiny_model_dir, tiny_llama_dir):
    """A reward or DPO micro-batch of B pairs runs 2B sequences: the plan sized it as B (found in audit), and
    --per_device_train_batch_size auto took twice the rows that fit where it used the estimate as is."""
    ddp = Candidate(next(s for s in STRATEGIES if s.key == "ddp"), False)
    setup = Setup(1, 1, 24 * GIB, None, 64, "no")
    for model, single, pair in ((tiny_model_dir, "classification", "reward"), (tiny_llama_dir, "sft", "dpo")):
        one, two = (planning.model_facts(model, task=task, num_labels=1) for task in (single, pair))
        assert two.sequences_per_row == 2 and one.sequences_per_row == 1
        a, b = (planning.estimate(m, ddp, setup, 16) for m in (one, two))
        assert b.activations == 2 * a.activations and b.logits == 2 * a.logits


def test_the_pre_training_check_counts_the_reference_copy_as_plan_does(tiny_facts, tmp_path):
    """Full fine-tuning's frozen reference: `plan` counted it, the pre-training check (and
    --per_device_train_batch_size auto where no probe runs) left it out (found in audit)."""
    from cloudtrain.planning.search import run_micro_batch

    root = tiny_facts[0].name
    options = dict(task="dpo", max_length=64, mixed_precision="no", gradient_checkpointing="false")

    def check(precompute: bool) -> int:
        cfg = build_config({**options, "model_name_or_path": root, "precompute_reference": precompute})
        return run_micro_batch(cfg, 2, 1, 1, round(1.1 * GIB), 64)

    # a global batch past the largest micro-batch: accumulating, as the check assumes
    args = plan_args(root, tmp_path, **options, gpu_memory_gb=1.1, strategy="ddp", peft="none", global_batch_size=512)
    ddp = next(r for r in planning.make_plan(args)["strategies"] if r["strategy"] == "ddp")
    assert 0 < check(False) == ddp["max_micro_batch"] < check(True)
