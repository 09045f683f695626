"""The planner's command line: `--json` parses and recommends, the table shows every strategy and the
nothing-fits advice, bad input is one line, the plan takes the training options with the application's defaults,
and the emitted ZeRO-3 config trains the tiny model in a real 2-process CPU launch."""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENTRY, REPO, child_pythonpath, run_cli
from test_planner import (
    BY_KEY,
    decoder_dirs_fixture,  # noqa: F401  (the decoder_dirs fixture)
    plan_args,
)
from transformers import AutoModelForSequenceClassification

from cloudtrain import planning
from cloudtrain.cli import main
from cloudtrain.config import Config, build_config
from cloudtrain.errors import UserError
from cloudtrain.planning import STRATEGIES


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
    # on one node hybrid sharding is full sharding; no_shard replicates the model, which the run trains as DDP
    one_node = set(BY_KEY) - {"fsdp_hybrid", "fsdp_no_shard"}
    # LoRA and QLoRA, with and without checkpointing; QLoRA in fp32 not under ZeRO-3 or FSDP (the run refuses it)
    adapters = 2 * len(planning.ADAPTER_STRATEGIES) + 2 * (len(planning.ADAPTER_STRATEGIES) - 2)
    assert len(plan["strategies"]) == 2 * len(one_node) + adapters
    assert {r["strategy"] for r in plan["strategies"]} == one_node
    rec = plan["recommendation"]
    assert (rec["strategy"], rec["gradient_checkpointing"]) == ("ddp", False)  # a tiny model needs nothing more
    assert (rec["micro_batch"], rec["gradient_accumulation_steps"]) == (8, 2)
    assert "--per_device_train_batch_size 8 --gradient_accumulation_steps 2 --mixed_precision no" in rec["command"]
    assert f" {ENTRY} --training_type " in rec["command"]  # the script the user ran, as they gave its path
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
    for strategy in STRATEGIES:  # on one node hybrid sharding is full sharding, and no_shard DDP: no rows of their own
        own_row = strategy.fsdp_sharding not in ("hybrid_shard", "no_shard")
        assert (strategy.label in result.stdout) is own_row, strategy.key
    assert "Nothing fits" in result.stdout and "--max_length" in result.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model_name_or_path", "{tmp}/no-model"], "--model_name_or_path .*no-model does not exist"),
        (["--model_name_or_path", "{tmp}"], "could not read a model config from"),
        (  # the suite is offline (HF_HUB_OFFLINE): refused as training refuses it, not in the Hub client's words
            ["--model_name_or_path", "org/no-such-model"],
            "--model_name_or_path org/no-such-model: no cached copy and the Hub cannot be reached",
        ),
        (
            ["--global_batch_size", "100", "--num_gpus", "8"],
            "--global_batch_size 100 must be a positive multiple of the 8",
        ),
        (["--gpu_memory_gb", "0"], "--gpu_memory_gb 0.0 must be a positive number, e.g. 24"),
        (["--gpu_memory_gb", "nan"], "--gpu_memory_gb nan must be a positive number"),
        (["--cpu_memory_gb", "inf"], "--cpu_memory_gb inf must be a positive number"),
        (["--nvme_gb", "1e300"], "--nvme_gb 1e[+]300 must be a positive number"),
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
        # sizes past any machine: the search over their divisors did not end (found in audit)
        (["--num_gpus", "1000000000"], "--num_gpus 1000000000 is GPUs per node: at most 1,024 .give the nodes in"),
        (["--num_gpus", "8", "--num_nodes", "1000000"], "--num_nodes 1000000: at most 100,000"),
        (["--global_batch_size", "100000000000000000000"], "--global_batch_size take at most 1,000,000"),
        (["--per_device_train_batch_size", "2000000"], "--per_device_train_batch_size and --global_batch_size take"),
        # the run refuses these flags: plan lowered the micro-batch to 16 and recommended them (found in audit)
        (
            ["--per_device_train_batch_size", "32", "--global_batch_size", "16"],
            "--global_batch_size 16 gives each of the 1 process.es. 16 examples per step, not a multiple of "
            "--per_device_train_batch_size 32; change one of them",
        ),
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


def test_a_length_beyond_the_models_positions_is_planned_with_a_note_that_the_run_refuses_it(tmp_path):
    """Long-context sizing (context parallelism) plans it; the run would refuse the model's config as given."""
    plan = planning.make_plan(plan_args(None, tmp_path, gpu_memory_gb=24, max_length=4096))
    assert (
        "--max_length 4096 is beyond the model's 512 positions: the run refuses it as given; extend them in a copy of "
        "its config (max_position_embeddings, and rope_scaling for RoPE models)"
    ) in plan["notes"]
    assert not any(
        "positions" in note for note in planning.make_plan(plan_args(None, tmp_path / "b", gpu_memory_gb=24))["notes"]
    )


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
    for gpu, precision in (("t4", "no"), ("h100", "bf16")):  # --gpu named: what auto becomes there (audit)
        plan = planning.make_plan(plan_args(tiny_model_dir, tmp_path / gpu, gpu=gpu, num_gpus=2))
        assert plan["setup"]["mixed_precision"] == precision
        assert f"--mixed_precision {precision}" in plan["recommendation"]["command"]
        assert f"--mixed_precision auto is {precision} on the {gpu}," in " ".join(plan["notes"])
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
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
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


def zero_plan(model: str, out: Path, capsys, **options) -> tuple[dict, str]:
    """`cloudtrain plan --json` for a ZeRO row (it writes ds_config.json and accelerate_config.yaml): the plan and
    what it said on stderr."""
    argv = ["plan", "--model_name_or_path", model, "--num_gpus", "2", "--gpu_memory_gb", "24", "--json"]
    argv += ["--mixed_precision", "no", "--output_dir", str(out)]
    for name, value in {"strategy": "zero2", **options}.items():
        argv += [f"--{name}", str(value)]
    assert main(argv) in (0, None)
    said = capsys.readouterr()
    return json.loads(said.out), said.err


def test_a_rerun_replaces_the_configs_plan_wrote_and_keeps_the_ones_the_user_edited(tiny_model_dir, tmp_path, capsys):
    """docs/planner.md tells users to edit nvme_path in ds_config.json: a re-run never replaces an edit. Files
    plan wrote and nobody touched are replaced in place (the re-run workflow); an edited folder is kept byte for
    byte and the new configs go to <output_dir>-2, which the plan names; later runs reuse that folder."""
    out = tmp_path / "plan"
    zero_plan(tiny_model_dir, out, capsys)
    first = (out / "ds_config.json").read_bytes()
    plan, said = zero_plan(tiny_model_dir, out, capsys, strategy="zero3")  # nobody touched them: replaced quietly
    assert said == "" and "files_moved" not in plan["recommendation"]
    assert (out / "ds_config.json").read_bytes() != first
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    assert plan["recommendation"]["files"]["deepspeed_config"] == str(out / "ds_config.json")
    assert not (tmp_path / "plan-2").exists()

    edited = (out / "ds_config.json").read_text().replace('"stage": 3', '"stage": 3, "nvme_path": "/mnt/mine"')
    (out / "ds_config.json").write_text(edited)
    yaml_before = (out / "accelerate_config.yaml").read_bytes()
    plan, said = zero_plan(tiny_model_dir, out, capsys)
    assert (out / "ds_config.json").read_text() == edited and (
        out / "accelerate_config.yaml"
    ).read_bytes() == yaml_before
    moved = tmp_path / "plan-2"
    assert said.count("\n") == 1 and f"{out / 'ds_config.json'} changed since plan wrote it (kept as is)" in said
    assert f"this plan's configs are in {moved}" in said and plan["recommendation"]["files_moved"] in said
    files = plan["recommendation"]["files"]
    assert files == {
        "deepspeed_config": str(moved / "ds_config.json"),
        "accelerate_config": str(moved / "accelerate_config.yaml"),
    }
    assert json.loads((moved / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    assert f"--config_file {moved / 'accelerate_config.yaml'}" in plan["recommendation"]["command"]
    pointed = __import__("yaml").safe_load((moved / "accelerate_config.yaml").read_text())
    assert pointed["deepspeed_config"]["deepspeed_config_file"] == str((moved / "ds_config.json").resolve())

    zero_plan(tiny_model_dir, out, capsys, strategy="zero3")  # plan-2 is plan's own now: replaced there
    assert json.loads((moved / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    assert (out / "ds_config.json").read_text() == edited and not (tmp_path / "plan-3").exists()


def test_a_config_plan_did_not_write_is_kept(tiny_model_dir, tmp_path, capsys):
    """A folder already holding the user's own accelerate_config.yaml (no record of plan's): kept, configs go beside."""
    out = tmp_path / "plan"
    out.mkdir()
    (out / "accelerate_config.yaml").write_text("compute_environment: LOCAL_MACHINE\n")
    plan, said = zero_plan(tiny_model_dir, out, capsys)
    assert (out / "accelerate_config.yaml").read_text() == "compute_environment: LOCAL_MACHINE\n"
    assert not (out / "ds_config.json").exists()
    assert f"plan did not write {out / 'accelerate_config.yaml'} (kept as is)" in said  # not "changed since"
    assert plan["recommendation"]["files"]["accelerate_config"] == str(tmp_path / "plan-2" / "accelerate_config.yaml")


def test_plan_s_switches_take_values_as_the_training_flags_do():
    """`--json true` and a bare `--gradient_checkpointing` were refused, unlike training's flags (found in audit)."""
    from cloudtrain.config import ConfigParser

    parser = ConfigParser(prog="plan")
    planning.add_arguments(parser)
    parsed = {
        " ".join(argv): (args.json, args.gradient_checkpointing)
        for argv in (["--json"], ["--json", "true"], ["--json", "false"], ["--gradient_checkpointing"], [])
        for args in [parser.parse_args(argv)]
    }
    assert parsed == {
        "--json": (True, "auto"),
        "--json true": (True, "auto"),
        "--json false": (False, "auto"),
        "--gradient_checkpointing": (False, "true"),
        "": (False, "auto"),
    }
    with pytest.raises(UserError, match="argument --json: expected true or false, got 'maybe'"):
        parser.parse_args(["--json", "maybe"])


def test_a_config_that_builds_no_model_and_an_unwritable_cache_are_one_line(tmp_path, monkeypatch, capsys):
    """hidden_size 0 was a ZeroDivisionError traceback, and a CLOUDTRAIN_CACHE under a file a NotADirectoryError
    one (found in audit)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 0}')
    argv = ["plan", "--task", "causal_lm", "--model_name_or_path", str(broken), "--gpu_memory_gb", "24"]
    assert main(argv + ["--tokenizer_name_or_path", str(REPO / "data" / "grimm" / "tokenizer")]) == 2
    assert "error: a CausalLM model cannot be built from this LlamaConfig (ZeroDivisionError" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CLOUDTRAIN_CACHE", str(tmp_path / "a-file" / "cache"))
    assert main(["plan", "--model_name_or_path", "gpt2", "--gpu_memory_gb", "16"]) == 2
    assert "; set CLOUDTRAIN_CACHE to a folder you can write" in capsys.readouterr().err


def test_a_config_transformers_validation_rejects_is_one_line_naming_it(tmp_path, capsys):
    """transformers 5 validates a config's numbers; its StrictDataclassError (no ValueError) was a traceback in
    `plan` and in training with --model_config (found in audit)."""
    from cloudtrain.tasks import build_task

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama", "hidden_size": 100}')
    why = "The hidden size (100) is not a multiple of the number of attention heads (32)"
    tokenizer = str(REPO / "data" / "grimm" / "tokenizer")
    options = {"task": "causal_lm", "model_config": str(bad / "config.json"), "tokenizer_name_or_path": tokenizer}
    said = f"could not load the model config {bad / 'config.json'}: {why}"
    with pytest.raises(UserError, match=__import__("re").escape(said)):
        build_task(build_config(options)).check_options(build_config(options))
    from cloudtrain.models.load import load_config

    with pytest.raises(UserError, match=__import__("re").escape(f"the model config in {bad}: {why}")):  # a folder's
        load_config(bad, trust_remote_code=False)
    argv = ["plan", "--task", "causal_lm", "--model_config", str(bad / "config.json")]
    decoder = ["plan", "--task", "causal_lm", "--model_name_or_path", str(bad), "--tokenizer_name_or_path", tokenizer]
    for plan in (argv + ["--tokenizer_name_or_path", tokenizer], ["plan", "--model_name_or_path", str(bad)], decoder):
        assert main([*plan, "--gpu_memory_gb", "24", "--output_dir", str(tmp_path / "plan")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and why in err and str(bad) in err, err


def test_an_attention_kernel_transformers_does_not_know_is_the_run_s_one_line(capsys, tmp_path):
    """`plan --attn_implementation bogus` planned "bogus attention" and printed a command the run refuses (audit)."""
    argv = ["plan", "--task", "causal_lm", "--model_config", "llama-8m", "--gpu_memory_gb", "24"]
    argv += ["--tokenizer_name_or_path", str(REPO / "data" / "grimm" / "tokenizer"), "--attn_implementation", "bogus"]
    assert main(argv) == 2
    assert "error: --attn_implementation bogus is not an attention kernel transformers knows" in capsys.readouterr().err
    argv[-1] = "kernels-community/flash-attn"  # a Hub kernel: installed where it trains, not where it is planned
    assert main([*argv, "--json", "--output_dir", str(tmp_path / "plan")]) in (0, None)


def test_an_output_dir_plan_cannot_write_is_one_line(tmp_path, capsys):
    """A file as --output_dir got its configs beside it, and a path under a file (or in /proc) was a traceback once
    the plan was computed (found in audit): refused in one line before the estimate; what fails while writing
    anyway (here: the library, which the command's check does not guard) names the folder."""
    (tmp_path / "a-file").write_text("")
    argv = ["plan", "--task", "causal_lm", "--model_config", "llama-8m", "--gpu_memory_gb", "24", "--output_dir"]
    for out, said in (
        ("a-file", "a-file is a file; give a folder for the plan's configs"),
        ("a-file/sub", "a-file/sub cannot be written (Not a directory); choose a folder you can write to"),
    ):
        assert main([*argv, str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: --output_dir ") and said in err, err
    assert not (tmp_path / "a-file-2").exists()
    args = plan_args(None, tmp_path / "a-file" / "sub", task="causal_lm", model_config="llama-8m", gpu_memory_gb=24)
    with pytest.raises(UserError, match=r"cannot write the plan's configs in .*a-file/sub \(Not a directory\); give"):
        planning.make_plan(args)


def test_the_largest_machines_allowed_are_planned(tmp_path):
    """1,024 GPUs on each of 100,000 nodes (the limits): planned, with no pipeline wider than the model's layers."""
    args = plan_args(None, tmp_path, task="causal_lm", model_config="llama-8m", gpu_memory_gb=24)
    args.num_gpus, args.num_nodes = 1024, 100_000
    plan = planning.make_plan(args)
    assert plan["recommendation"] is not None
    layers = plan["model"]["num_layers"]
    assert all(r["pipeline"]["parallel_size"] <= layers + 2 for r in plan["strategies"] if r["pipeline"])


def test_lora_r_is_not_said_to_be_unused_where_plan_plans_adapters(tiny_model_dir, tmp_path):
    """`plan --lora_r 4` noted "--lora_r 4 has no effect without --peft lora" while its --peft auto planned LoRA
    at r=4 (found in audit); with --peft none the note is the run's."""
    for peft, noted in (("auto", False), ("none", True)):
        plan = planning.make_plan(plan_args(tiny_model_dir, tmp_path / peft, gpu_memory_gb=24, lora_r=4, peft=peft))
        assert any(note.startswith("--lora_r 4 has no effect") for note in plan["notes"]) is noted, plan["notes"]
