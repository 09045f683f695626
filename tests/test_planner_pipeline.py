"""The memory planner's pipeline rows: each process's parameters, gradients, AdamW states, activations in flight
(GPipe all M, 1F1B S - k), logits and bubble against a hand computation on a tiny Llama's meta-device build;
pipeline + data parallel recommended where every data-parallel strategy is over budget, with a torchrun command
that parses (one node and two), and not where DDP fits; every row's mesh is the one its trainer builds."""

import shlex

import pytest
import torch
from test_planner import (
    decoder_dirs_fixture,  # noqa: F401  (the decoder_dirs fixture)
    plan_args,
    setup,
)
from test_planner_recommendations import emitted_config
from transformers import AutoModelForCausalLM, LlamaConfig

from cloudtrain import planning
from cloudtrain.config import Config
from cloudtrain.planning import GIB, STRATEGIES, Candidate


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
