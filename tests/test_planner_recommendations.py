"""The memory planner's choice: the fastest strategy that fits is recommended, a smaller micro-batch with more
accumulation when the requested one fits nothing, LoRA then QLoRA only when no full fine-tuning fits, --peft
restricts the choice, nothing-fits says what would, and the emitted configs load in accelerate and DeepSpeed."""

import argparse
import shlex
from pathlib import Path

import pytest
from conftest import REPO
from test_planner import (
    decoder_dirs_fixture,  # noqa: F401  (the decoder_dirs fixture)
    plan_args,
)

from cloudtrain import planning
from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.planning import GIB, STRATEGIES


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
    # 2 rows or more of 2,048 tokens keep each GPU busy: the fastest such row is compared with none asked
    assert any("no option fits the micro-batch asked" in reason for reason in rec["reasons"])


def emitted_config(command: str) -> Config:
    """The training configuration the printed launch command builds (its flags from --training_type on)."""
    from cloudtrain.config import add_config_arguments, build_config

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = shlex.split(command)
    return build_config(vars(parser.parse_args(argv[argv.index("--training_type") :])))


@pytest.mark.parametrize(
    "model,options",
    [(None, {"task": "causal_lm", "model_config": "llama-8m"}), ("tiny", {})],
    ids=["decoder", "classifier"],
)
def test_the_launch_command_carries_the_tokenizer_and_trust_remote_code_given(model, options, tiny_model_dir, tmp_path):
    """The printed command dropped --trust_remote_code true (the run then refused a checkpoint with its own code)
    and a classifier's --tokenizer_name_or_path (the run then looked for a tokenizer in the model's folder): both
    go on to the run whenever they were given (found in audit)."""
    tokenizer = str(REPO / "data" / "grimm" / "tokenizer")
    args = plan_args(
        tiny_model_dir if model else None,
        tmp_path,
        gpu_memory_gb=24,
        tokenizer_name_or_path=tokenizer,
        trust_remote_code="true",
        **options,
    )
    cfg = emitted_config(planning.make_plan(args)["recommendation"]["command"])
    assert (cfg.model.tokenizer_name_or_path, cfg.model.trust_remote_code) == (tokenizer, True)
    args.trust_remote_code = False  # not given: not added
    assert not emitted_config(planning.make_plan(args)["recommendation"]["command"]).model.trust_remote_code


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
    # hybrid is full shard on one node, and no_shard DDP
    one_node = [s for s in STRATEGIES if s.fsdp_sharding not in ("hybrid_shard", "no_shard")]
    under = len(planning.ADAPTER_STRATEGIES)  # adapters under DDP, ZeRO 1-3 and FSDP2 (QLoRA: not ZeRO-3)
    assert [r["peft"] for r in auto["strategies"]] == ["none"] * 2 * len(one_node) + ["lora"] * 2 * under + [
        "qlora"
    ] * 2 * (under - 1)
    lines = planning.render(auto).splitlines()
    full, adapters_title = (
        lines.index("full fine-tuning (every weight trains):"),
        next(i for i, line in enumerate(lines) if line.startswith("adapters under DDP, ZeRO and FSDP2 (recommended")),
    )
    assert lines[full + 1].split()[:2] == ["DDP", "1.00"] and full < adapters_title
    labels = [line.strip().split("  ")[0] for line in lines[adapters_title + 1 : adapters_title + 4 * under - 1]]
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
        if strategy.fsdp_sharding == "no_shard":  # the run trains it as DDP: no row of its own (found in audit)
            with pytest.raises(UserError, match="which the run trains as DDP: plan with --strategy ddp"):
                planning.make_plan(plan_args(tiny_model_dir, out, num_gpus=4, num_nodes=2, strategy=strategy.key))
            continue
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


def test_micro_batch_options_are_the_divisors_up_to_the_request():
    """A global batch of 10^8 counted down every number from 12.5 million for each row: minutes (found in audit)."""
    from cloudtrain.planning.search import micro_batch_options

    for requested, per_gpu in ((8, 64), (5, 60), (100, 36), (7, 1), (3, 0), (16, 97)):
        brute = [b for b in range(min(requested, per_gpu), 0, -1) if per_gpu % b == 0]
        assert micro_batch_options(requested, per_gpu) == brute, (requested, per_gpu)
    assert micro_batch_options(12_500_000, 12_500_000)[:3] == [12_500_000, 6_250_000, 3_125_000]


def test_faster_rows_passed_over_for_a_small_micro_batch_are_not_said_to_be_over_budget(decoder_dirs, tmp_path):
    """7B on 8 x 40 GiB at 16 rows of 1,024 tokens: ZeRO-2 fits 1 row (1,024 tokens per GPU, too few to keep the
    GPUs busy), so a slower row fitting 8 is chosen; the reason said ZeRO-2 needed "more than 40 GiB per GPU at
    micro-batch 1" while the table showed 38.5 (found in audit). Rows over budget and rows fitting only a small
    micro-batch are named apart."""
    plan = planning.make_plan(
        plan_args(
            decoder_dirs["7b"],
            tmp_path,
            task="causal_lm",
            num_gpus=8,
            gpu_memory_gb=40,
            max_length=1024,
            per_device_train_batch_size=16,
            mixed_precision="bf16",
        )
    )
    rec = plan["recommendation"]
    largest = {r["label"]: r["max_micro_batch"] for r in plan["strategies"]}

    def named(prefix: str) -> dict[str, str]:
        line = next(reason for reason in rec["reasons"] if reason.startswith(prefix))
        listed = line.split(": ", 1)[1].split(" GiB")[0].split(" tokens")[0]
        return dict(item.rsplit(" ", 1) for item in listed.split(", "))

    assert rec["micro_batch"] < 16
    over = named("Faster options need more than 40 GiB per GPU at micro-batch 1")
    small = named("Faster options fit only micro-batches of fewer than 4,096 tokens per GPU per micro-step")
    assert over and small and not set(over) & set(small)
    assert all(largest[name] == 0 and float(gib) > 40 for name, gib in over.items()), over
    assert small["ZeRO-2"] == "1,024" and all(largest[name] >= 1 for name in small), small
