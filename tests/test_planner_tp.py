"""The planner's tensor- and context-parallel rows: their memory per process computed by hand for a small Llama
shape (TP groups replicated, TP x FSDP2, CP's split of the sequence), their communication, the launch command,
why a model gets no TP rows, and the recommendations for Llama-3-8B at 8k and 32k tokens on 8 x 80 GiB."""

import argparse
import shlex
from dataclasses import replace

import pytest
from transformers import GPT2Config, LlamaConfig

from cloudtrain import planning
from cloudtrain.config import add_config_arguments, build_config
from cloudtrain.errors import UserError
from cloudtrain.planning import GIB, Candidate, Setup
from cloudtrain.planning.communication import all_reduce, step_traffic
from cloudtrain.planning.memory import activation_bytes, logits_bytes
from cloudtrain.planning.strategies import CONTEXT_FSDP, STRATEGIES, TENSOR_FSDP, TENSOR_PARALLEL

H, L, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 8, 4, 512, 1000
BY_KEY = {s.key: s for s in STRATEGIES}


def plan_args(model: str, output_dir, **options) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    planning.add_arguments(parser)
    argv = ["--model_name_or_path", model, "--output_dir", str(output_dir), "--task", "causal_lm"]
    for name, value in options.items():
        argv += [f"--{name}", str(value)]
    return parser.parse_args(argv)


def emitted_config(command: str):
    """The training configuration the printed launch command builds (its flags from --training_type on)."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = shlex.split(command)
    return build_config(vars(parser.parse_args(argv[argv.index("--training_type") :])))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("small-llama")
    LlamaConfig(
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTER,
        vocab_size=VOCAB,
    ).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def facts(small):
    return planning.model_facts(small, task="causal_lm")


def local_params(t: int) -> tuple[int, int, int]:
    """(held, one layer, outside the layers) per process at TP degree t, by hand: q, o are h x h, k, v h x h_kv, the
    gated MLP 3 x h x I, all split; the two norms (h each) whole; the untied LM head (V x h) split by vocabulary
    columns; the embeddings (V x h) and the final norm whole."""
    kv = H * KV_HEADS // HEADS
    split = 2 * H * H + 2 * H * kv + 3 * H * INTER
    layer = split // t + 2 * H
    root = VOCAB * H + H + VOCAB * H // t
    return L * layer + root, layer, root


def test_the_plan_splits_what_transformers_splits(facts):
    kv = H * KV_HEADS // HEADS
    assert facts.tensor_plan is not None
    assert facts.tensor_plan.layer_split_params == 2 * H * H + 2 * H * kv + 3 * H * INTER
    assert facts.tensor_plan.head_split_params == VOCAB * H  # lm_head: colwise_gather_output, not tied
    for t in (1, 2, 4):
        local = planning.memory.tensor_local(facts, t)
        assert (local.num_params, local.layer_params, local.root_params) == local_params(t)
    assert local_params(1)[0] == facts.num_params


@pytest.mark.parametrize("t", [2, 4])
def test_tp_row_states_by_hand(facts, t):
    """Replicated TP groups: fp32 weights, gradients, AdamW moments of the process's share, and autocast's 16-bit
    copies of every weight a matmul reads (all but the embeddings), held while accumulating."""
    setup = Setup(8, 1, 80 * GIB, None, 512, "bf16", step_rows=4)
    held = local_params(t)[0]
    est = planning.estimate(facts, Candidate(TENSOR_PARALLEL, False, tensor_parallel=t), setup, 1)  # accumulates
    assert est.parameters == 4 * held
    assert est.gradients == 4 * held + 2 * (held - VOCAB * H)
    assert est.optimizer_states == 8 * held


def test_tp_x_fsdp2_states_by_hand(facts):
    """TP=2 x FSDP2 on 8 processes: the share sharded over the 4 data-parallel processes, the gathered units in fp32
    (transformers' FSDP2 has no mixed-precision policy here): the root and two layers, one layer's gradients."""
    t, setup = 2, Setup(8, 1, 80 * GIB, None, 512, "bf16", step_rows=4)
    held, layer, root = local_params(t)
    S = 8 // t
    est = planning.estimate(facts, Candidate(TENSOR_FSDP, False, tensor_parallel=t), setup, 1)
    assert est.parameters == 4 * held // S + 4 * (root + 2 * layer)
    assert est.gradients == 4 * held // S + 4 * layer + 2 * (held - VOCAB * H)
    assert est.optimizer_states == 8 * held // S
    mesh = Candidate(TENSOR_FSDP, False, tensor_parallel=t).mesh(setup)
    assert mesh.degrees() == {"world": 8, "dp_shard": 4, "tp": 2}


@pytest.mark.parametrize("dense", [False, True])
def test_tp_divides_attention_and_the_mlp_not_the_residual_stream(facts, dense):
    """Per token and layer TP saves c x (2h + 2h_kv') x (1 - 1/t) of q, k, v and the output, c x I x (k_act + 1 + 2g)
    x (1 - 1/t) of the MLP, 4H(1 - 1/t) of the log-sum-exp, and c x I(1 - 1/t) of the working space; the norms, the
    projections' inputs, the mask and the logits stay."""
    facts = replace(facts, attn_implementation="sdpa")
    b, s, c, t = 2, 256, 2, 2
    setup = Setup(8, 1, 80 * GIB, None, s, "bf16", step_rows=b * t, dense_mask=dense)
    kv = H if dense else H * KV_HEADS // HEADS  # sdpa with a mask repeats the grouped heads
    whole = activation_bytes(facts, b, s, True, False, 4, autocast32=True, dense_mask=dense)
    tp = planning.estimate(facts, Candidate(TENSOR_PARALLEL, False, tensor_parallel=t), setup, b)
    per_token = c * (2 * H + 2 * kv) + c * INTER * (facts.activation_saved + 1 + 2) + 4 * HEADS
    saved_less = L * s * b * per_token * (1 - 1 / t)
    working_less = c * s * b * INTER * (1 - 1 / t)
    assert tp.activations == pytest.approx(sum(whole) - saved_less - working_less, abs=2)
    assert tp.logits == logits_bytes(facts, b, s, True)  # the LM head gathers its output: whole


def test_context_parallel_divides_the_sequence_and_adds_the_all_to_all_buffers(facts):
    """CP=c: every per-token term at s/c tokens (no dense mask: the varlen kernels take the lengths), the logits of
    s/c tokens, and one layer's all-to-all buffers: q, k, v and the output of its s/c tokens, sent and received
    (2 x c x b x s/c x (2h + 2h_kv))."""
    facts = replace(facts, attn_implementation="sdpa")
    b, s, c = 1, 1024, 2
    kv = H * KV_HEADS // HEADS
    for cp in (2, 4):
        setup = Setup(8, 1, 80 * GIB, None, s, "bf16", step_rows=cp)
        est = planning.estimate(facts, Candidate(CONTEXT_FSDP, False, context_parallel=cp), setup, b)
        own = activation_bytes(facts, b, s // cp, True, False, c, autocast32=False, dense_mask=False)
        assert est.activations == sum(own) + 2 * c * b * (s // cp) * (2 * H + 2 * kv)
        assert est.logits == logits_bytes(facts, b, s // cp, True) == logits_bytes(facts, b, s, True) // cp
        fsdp = planning.estimate(facts, Candidate(BY_KEY["fsdp"], False), setup, b)
        assert (est.parameters, est.optimizer_states) == (fsdp.parameters, fsdp.optimizer_states)


def test_context_parallel_counts_the_rows_as_the_run_pads_them(facts):
    """--max_length 1023 under CP=2: the run pads each row to 1024 (parallel.context.widen), so each process holds
    512 tokens, as at 1024; the estimate counted 511."""
    cand = Candidate(CONTEXT_FSDP, False, context_parallel=2)
    odd, even = (planning.estimate(facts, cand, Setup(8, 1, 80 * GIB, None, s, "bf16", step_rows=2), 1)
                 for s in (1023, 1024))  # fmt: skip
    assert (odd.activations, odd.logits) == (even.activations, even.logits)


def test_context_parallel_traffic_counts_the_rows_as_the_run_pads_them(facts):
    """The all-to-alls carry each process's share of the widened rows: 1023 tokens under CP=2 send what 1024 do
    (the estimate rounded the share down)."""
    cand = Candidate(CONTEXT_FSDP, False, context_parallel=2)
    odd, even = (
        step_traffic(facts, cand, Setup(8, 1, 80 * GIB, None, s, "bf16"), 3, 2)["context"] for s in (1023, 1024)
    )
    assert odd == even > 0


def test_tensor_parallel_traffic_by_hand(facts):
    """Per micro-batch: 4 all-reduces of b x s x h x c per layer (6 with checkpointing) and the LM head's gather;
    the replicated groups all-reduce their fp32 share every micro-batch."""
    setup = Setup(8, 1, 80 * GIB, None, 512, "bf16")
    b, t, k, c = 2, 2, 3, 2
    tokens = b * 512
    for gc, passes in ((False, 4), (True, 6)):
        sent = step_traffic(facts, Candidate(TENSOR_PARALLEL, gc, tensor_parallel=t), setup, b, k)
        layers = L * passes * 2 * (t - 1) / t * c * tokens * H
        head = (t - 1) / t * c * tokens * VOCAB
        assert sent["tensor"] == round(k * (layers + head))
        assert sent["data"] == round(k * all_reduce(4 * local_params(t)[0], 8 // t))


def test_tensor_parallel_launch_command_and_mesh(small, tmp_path):
    """--strategy tp_fsdp pins TP x FSDP2: torchrun, the application's own flags, no config files."""
    plan = planning.make_plan(
        plan_args(
            small, tmp_path / "plan", strategy="tp_fsdp", num_gpus=8, gpu_memory_gb=80, max_length=512,
            mixed_precision="bf16", per_device_train_batch_size=1, global_batch_size=16,
        )
    )  # fmt: skip
    rec = plan["recommendation"]
    assert rec["tensor_parallel_size"] > 1 and rec["files"] == {} and not (tmp_path / "plan").exists()
    cfg = emitted_config(rec["command"])
    t = rec["tensor_parallel_size"]
    assert shlex.split(rec["command"])[:3] == ["torchrun", "--nproc_per_node", "8"]
    assert (cfg.distributed.tensor_parallel_size, cfg.distributed.fsdp) == (t, True)
    groups = 8 // t  # a group's processes take the same rows
    micro, steps = cfg.training.per_device_train_batch_size, cfg.training.gradient_accumulation_steps
    assert micro * groups * steps == 16
    assert "--context_parallel_size" not in rec["command"]


def test_no_tensor_parallel_rows_without_a_plan_or_a_divisor(tmp_path):
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_embd=256, n_layer=2, n_head=8).save_pretrained(gpt2)
    plan = planning.make_plan(plan_args(str(gpt2), tmp_path / "a", num_gpus=4, gpu_memory_gb=24, max_length=256))
    assert not any(r["tensor_parallel_size"] > 1 for r in plan["strategies"])
    assert any(n.startswith("no tensor-parallel rows: the GPT2LMHeadModel family has no") for n in plan["notes"])
    twelve = tmp_path / "twelve"  # 12 heads and 4 KV heads: 2 and 4 divide them, 8 does not
    LlamaConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=500).save_pretrained(twelve)  # fmt: skip
    plan = planning.make_plan(plan_args(str(twelve), tmp_path / "b", num_gpus=8, gpu_memory_gb=24, max_length=256))
    assert {r["tensor_parallel_size"] for r in plan["strategies"]} == {1, 2, 4}
    assert "no TP=8 rows: 8 does not divide the model's attention heads (12), KV heads (4)" in plan["notes"]
    with pytest.raises(UserError, match="family has no tensor-parallel plan"):
        planning.make_plan(
            plan_args(str(gpt2), tmp_path / "c", num_gpus=4, gpu_memory_gb=24, max_length=256, strategy="tp")
        )


def test_context_parallel_rows_at_a_length_the_degree_does_not_divide(tmp_path):
    """The run pads each row's end to a multiple of the degree, so CP trains at --max_length 63 (found in audit:
    the plan refused it, and `auto` never offered CP for such lengths)."""
    twelve = tmp_path / "twelve"
    LlamaConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=500).save_pretrained(twelve)  # fmt: skip
    plan = planning.make_plan(plan_args(str(twelve), tmp_path / "a", num_gpus=2, gpu_memory_gb=24, max_length=63))
    assert {r["context_parallel_size"] for r in plan["strategies"]} >= {1, 2}


def test_no_context_parallel_rows_where_the_run_refuses_it(small, tmp_path):
    """CP computes attention over the varlen kernels: a sliding-window model, or --attn_implementation sdpa, is
    refused by the run, and the plan recommended it (found in audit)."""
    from transformers import MistralConfig

    windowed = tmp_path / "windowed"
    MistralConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  intermediate_size=INTER, vocab_size=VOCAB, sliding_window=64).save_pretrained(windowed)  # fmt: skip
    options = dict(num_gpus=2, gpu_memory_gb=24, max_length=128)

    def degrees(model: str, name: str, **more) -> set[int]:
        plan = planning.make_plan(plan_args(model, tmp_path / name, **options, **more))
        return {r["context_parallel_size"] for r in plan["strategies"]}

    assert 2 in degrees(small, "plain")
    assert degrees(small, "sdpa", attn_implementation="sdpa") == {1}
    assert degrees(str(windowed), "windowed") == {1}
    # pinned, the run's reason (found in review: "no degree divides the model's heads")
    for model, more, says in ((small, {"attn_implementation": "sdpa"}, "leave --attn_implementation out"),
                              (str(windowed), {}, "the model uses sliding-window attention")):  # fmt: skip
        with pytest.raises(UserError, match=f"--strategy cp_fsdp: context parallelism .*{says}"):
            planning.make_plan(plan_args(model, tmp_path / "pinned", **options, **more, strategy="cp_fsdp"))


def test_a_pinned_split_does_not_claim_data_parallelism_fits_nothing(tmp_path):
    """--strategy tp leaves no data-parallel row among those compared: the reasons said "Data parallelism alone ...
    fits no micro-batch here" under a table where DDP fits (found in audit)."""
    twelve = tmp_path / "twelve"
    LlamaConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=500).save_pretrained(twelve)  # fmt: skip
    args = plan_args(str(twelve), tmp_path / "a", num_gpus=2, gpu_memory_gb=24, max_length=256, strategy="tp")
    reasons = " ".join(planning.make_plan(args)["recommendation"]["reasons"])
    assert "Tensor parallel 2:" in reasons and "fits no micro-batch" not in reasons
    auto = planning.make_plan(plan_args(str(twelve), tmp_path / "b", num_gpus=2, gpu_memory_gb=24, max_length=256))
    assert any(r["fits"] and r["tensor_parallel_size"] == 1 for r in auto["strategies"])  # DDP does fit


@pytest.mark.parametrize(
    "strategy, peft, why",
    [
        ("tp", "lora", "tensor parallelism does not combine with --peft"),
        ("cp_fsdp", "qlora", "the planner estimates adapters under --strategy ddp, zero1, zero2, zero3, fsdp only"),
        ("zero2_offload", "lora", "under --strategy ddp, zero1"),
    ],
)
def test_a_pinned_strategy_without_rows_for_the_pinned_adapter_says_why(small, tmp_path, strategy, peft, why):
    """Such a pin said "The requested strategy does not fit" under a table where every row fits, and advised more
    GPU memory (found in audit): the rows are not there at all, which the plan now says in one line."""
    args = plan_args(small, tmp_path, num_gpus=2, gpu_memory_gb=24, max_length=256, strategy=strategy, peft=peft)
    with pytest.raises(UserError, match=f"^--strategy {strategy} --peft {peft}: .*{why}"):
        planning.make_plan(args)
    fits = planning.make_plan(plan_args(small, tmp_path / "none", num_gpus=2, gpu_memory_gb=24, strategy=strategy))
    assert fits["recommendation"] is not None  # the strategy itself is planned here


# ---------------------------------------------------------------- Llama-3-8B on 8 x 80 GiB


def llama3(tmp_path, max_length: int, **options) -> dict:
    plan = planning.make_plan(
        plan_args(
            "llama-3-8b", tmp_path, gpu="h100", num_gpus=8, max_length=max_length, mixed_precision="bf16",
            per_device_train_batch_size=1, global_batch_size=32, **options,
        )
    )  # fmt: skip
    print(planning.render(plan))
    return plan


def by_label(plan: dict) -> dict[str, dict]:
    return {r["label"]: r for r in plan["strategies"]}


def test_llama3_8b_at_8k(tmp_path):
    """At 8k tokens no data-parallel row fits without checkpointing (the 32 layers' activations: FSDP full shard
    needs 91.8 GiB at one row per GPU); tensor parallelism divides the activations inside the layers, so a TP row
    fits where its data-parallel counterpart does not. The choice is CP=2 x FSDP2 without checkpointing: one row per
    group of 2 (half the micro-batch asked) is still 4,096 tokens per GPU, so it is compared at the same global batch
    by its step time (1.14 with its all-to-alls) and beats ZeRO-1 with checkpointing (1.36), the fastest that fits
    one row per GPU: context parallelism instead of recomputation."""
    plan = llama3(tmp_path, 8192)
    rows, rec = by_label(plan), plan["recommendation"]
    plain = [r for r in plan["strategies"] if r["peft"] == "none" and r["pipeline"] is None]
    data_parallel = [r for r in plain if r["tensor_parallel_size"] == r["context_parallel_size"] == 1]
    assert not any(r["fits"] for r in data_parallel if not r["gradient_checkpointing"] and "offload" not in r["label"])
    assert rec["label"] == "CP=2 x FSDP2" and (rec["micro_batch"], rec["gradient_accumulation_steps"]) == (1, 8)
    assert "--context_parallel_size 2" in rec["command"] and "--gradient_checkpointing" not in rec["command"]
    # the fastest that fits the micro-batch asked (1 row per GPU: t or c rows per TP or CP group) is slower
    full = [r for r in plan["strategies"] if r["peft"] == "none"]
    asked = [r for r in full if r["max_micro_batch"] >= r["tensor_parallel_size"] * r["context_parallel_size"]]
    fastest_asked = min(asked, key=lambda r: r["relative_step_time"])
    assert fastest_asked["label"] == "ZeRO-1 + checkpointing"
    assert rows[rec["label"]]["relative_step_time"] < fastest_asked["relative_step_time"]
    assert any("4,096 tokens per GPU" in line and "ZeRO-1 + checkpointing" in line for line in rec["reasons"])
    # TP=8 without checkpointing fits 1 row per group of 8 GPUs (1,024 tokens per GPU): too few to keep them busy,
    # so it is not compared with the rows that fit the micro-batch asked although its step time is lower
    tp8, ddp = rows["TP=8"], rows["DDP"]
    assert 1 <= tp8["max_micro_batch"] < 8 and tp8["relative_step_time"] < fastest_asked["relative_step_time"]
    assert tp8["estimate"]["activations"] < 8 * ddp["estimate"]["activations"]  # 8 rows, each split 8 ways
    for t in (2, 4, 8):  # activations shrink with t; the logits (gathered) and the residual stream do not
        assert rows[f"TP={t}"]["estimate"]["logits"] == t * rows["DDP"]["estimate"]["logits"]  # t x the rows
    assert rows["TP=2"]["estimate"]["activations"] > rows["TP=4"]["estimate"]["activations"] / 2
    # asked for 1 row per GPU at 2k tokens, a CP group's single row would leave 1,024 tokens per GPU: data parallel
    short = llama3(tmp_path / "short", 2048)["recommendation"]
    assert short["context_parallel_size"] == short["tensor_parallel_size"] == 1


def test_llama3_8b_at_32k(tmp_path):
    """At 32k tokens FSDP2 with checkpointing at micro-batch 1 does not fit (the logits of 32k tokens and the
    residual stream of every layer); tensor parallelism does not help (the gathered logits), context parallelism
    does (every per-token term / c): CP=8 x FSDP2 fits one row per group without checkpointing (not the 8 asked),
    4,096 tokens per GPU, and at the same global batch its step time (1.14) beats the fastest row that fits one
    row per GPU, ZeRO-3 with the optimizer offloaded and checkpointing (2.39): it is the choice, not offloading."""
    plan = llama3(tmp_path, 32768)
    rows, rec = by_label(plan), plan["recommendation"]
    fsdp = rows["FSDP full shard + checkpointing"]
    assert not fsdp["fits"] and fsdp["max_micro_batch"] == 0
    assert not any(r["max_micro_batch"] for r in plan["strategies"] if r["tensor_parallel_size"] > 1)
    cp8 = rows["CP=8 x FSDP2"]
    # at the micro-batch asked (8 rows of 4k tokens per group of 8) each GPU holds as many tokens as FSDP2's one row
    assert cp8["estimate"]["logits"] == fsdp["estimate"]["logits"] and not cp8["fits"]
    assert cp8["max_micro_batch"] >= 1  # 1 row per group (4k tokens per GPU) fits, without checkpointing
    assert rec["label"] == cp8["label"] and (rec["micro_batch"], rec["gradient_accumulation_steps"]) == (1, 32)
    assert "--context_parallel_size 8" in rec["command"] and "--fsdp true" in rec["command"]
    offload = rows["ZeRO-3 + optimizer offload + checkpointing"]
    assert offload["fits"] and offload["relative_step_time"] > 2 * cp8["relative_step_time"]
    assert any("ZeRO-3 + optimizer offload + checkpointing" in line for line in rec["reasons"])
    assert not any("would fit" in line for line in rec["reasons"])  # the CP hint is for a choice that is not CP
    # on 40 GiB GPUs nothing that runs fits (offloading, adapters: the logits of 32k tokens alone are 47 GiB); the
    # context-parallel row does, and is the recommendation
    tight = llama3(tmp_path / "tight", 32768, gpu_memory_gb=40)
    chosen = tight["recommendation"]
    assert chosen["context_parallel_size"] > 1
    assert "--context_parallel_size" in chosen["command"] and "--fsdp true" in chosen["command"]
    assert "not runnable" not in planning.render(tight)
    cfg = emitted_config(chosen["command"])
    assert (cfg.distributed.context_parallel_size, cfg.distributed.fsdp) == (chosen["context_parallel_size"], True)
