"""The planner's reach (issue 33): well-known models by name with no Hub config, GPUs by name (AMD included,
other accelerators refused plainly), the next-best strategies in its answer, and a forced strategy's advice."""

import json
import re

import pytest
from test_planner import plan_args

from cloudtrain import planning
from cloudtrain.cli import main
from cloudtrain.errors import UserError
from cloudtrain.planning.known_models import KNOWN_MODELS, hub_id, known_name

# the parameter counts of the published checkpoints (their model cards and config.json, as causal LMs)
PUBLISHED_PARAMS = {
    "llama-7b": 6_738_415_616,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "opt-1.3b": 1_315_758_080,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_well_known_models_plan_offline_with_their_published_sizes(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub: the shapes come from the shipped table
    plan = planning.make_plan(plan_args(name, tmp_path, task="causal_lm", gpu="a100-80gb", num_gpus=8))
    assert plan["model"]["num_params"] == PUBLISHED_PARAMS[name]
    assert plan["setup"]["gpu_memory_bytes"] == 80 * 2**30
    assert plan["model"]["name"] == name
    assert f"{name}: shapes from cloudtrain's table of well-known models" in " ".join(plan["notes"])
    if plan["recommendation"]:  # the launch command loads the checkpoint by its Hub id
        assert f"--model_name_or_path {KNOWN_MODELS[name][0]} " in plan["recommendation"]["command"]


def test_a_hub_id_finds_the_table_and_a_local_folder_wins(tmp_path, monkeypatch):
    assert known_name("meta-llama/Llama-2-13b-hf") == "llama-2-13b" and known_name("Mistral-7B") == "mistral-7b"
    assert known_name("mistral-8b") is None
    assert hub_id("opt-1.3b") == "facebook/opt-1.3b" and hub_id("my/model") == "my/model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-2-7b").mkdir()  # a folder of that name is the user's own model, not the table's
    assert known_name("llama-2-7b") is None


def test_a_well_known_model_s_refusal_names_it_as_typed(tmp_path, monkeypatch):
    """`--task causal_lm --model_name_or_path flan-t5-small` was refused naming the cache folder its shipped config
    is read from (found in audit)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for typed in ("flan-t5-small", "google/flan-t5-small"):
        with pytest.raises(UserError, match="^" + re.escape(f"{typed} is not a causal language model (t5)")):
            planning.make_plan(plan_args(typed, tmp_path, task="causal_lm", gpu="h100"))


def test_amd_gpus_plan_with_their_memory_and_a_note(tmp_path):
    plan = planning.make_plan(plan_args("opt-1.3b", tmp_path, task="causal_lm", gpu="MI250", num_gpus=8))
    assert plan["setup"]["gpu_memory_bytes"] == 64 * 2**30  # one of the card's two dies
    assert any(note.startswith("mi250: AMD Instinct runs the same code on a ROCm build") for note in plan["notes"])
    big = planning.make_plan(plan_args("llama-2-70b", tmp_path, task="causal_lm", gpu="mi300x", num_gpus=8))
    assert big["setup"]["gpu_memory_bytes"] == 192 * 2**30


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ("tpu-v5e", "--gpu tpu-v5e: Google TPUs (XLA) are not supported: cloudtrain trains on NVIDIA GPUs (CUDA) and "),
        ("gaudi2", "--gpu gaudi2: Intel Gaudi (HPU) are not supported"),
        ("trn1", "--gpu trn1: AWS Trainium (Neuron SDK) are not supported"),
        ("inf2", "--gpu inf2: AWS Inferentia (inference only) are not supported"),  # was "not a GPU it knows"
        ("rtx-9999", "--gpu rtx-9999 is not a GPU the planner knows (t4, "),
    ],
)
def test_unsupported_or_unknown_accelerators_are_said_plainly(gpu, message, tmp_path):
    with pytest.raises(UserError, match="^" + re.escape(message)):
        planning.make_plan(plan_args("opt-1.3b", tmp_path, gpu=gpu))


def test_the_answer_lists_the_next_best_strategies_that_fit(tmp_path):
    plan = planning.make_plan(
        plan_args("llama-2-7b", tmp_path, task="causal_lm", gpu="a100-80gb", num_gpus=8, mixed_precision="bf16")
    )
    chosen, fallbacks = plan["recommendation"], plan["fallbacks"]
    assert 1 <= len(fallbacks) <= 3 and chosen["label"] not in [f["label"] for f in fallbacks]
    rows = {r["label"]: r for r in plan["strategies"]}
    for f in fallbacks:  # each fits, at a micro-batch its row allows, and is no faster than the choice
        assert f["micro_batch"] <= rows[f["label"]]["max_micro_batch"]
        assert f["estimate"]["total"] <= 80 * 2**30
        assert rows[f["label"]]["relative_step_time"] >= rows[chosen["label"]]["relative_step_time"]
    assert [f["relative_step_time"] for f in map(rows.get, [f["label"] for f in fallbacks])] == sorted(
        rows[f["label"]]["relative_step_time"] for f in fallbacks
    )
    text = planning.render(plan)
    assert f"  - {fallbacks[0]['label']}: micro-batch {fallbacks[0]['micro_batch']}, " in text


def test_a_forced_strategy_that_fits_nothing_gets_its_own_advice(tmp_path):
    """--strategy zero2 on 4 x 24 GiB: the advice quotes ZeRO-2's leanest row, not the leanest of all rows."""
    args = dict(task="causal_lm", num_gpus=4, gpu_memory_gb=24, mixed_precision="bf16", strategy="zero2", peft="none")
    plan = planning.make_plan(plan_args("llama-2-7b", tmp_path, **args))
    assert plan["recommendation"] is None
    zero2 = [r for r in plan["strategies"] if r["strategy"] == "zero2" and r["peft"] == "none"]
    leanest = min(zero2, key=lambda r: r["estimate"]["total"])  # at the requested micro-batch, ordered as at 1
    needs = re.search(r"the leanest option, (.+), needs ([\d.]+) GiB", plan["suggestions"][0])
    assert needs and needs.group(1) == leanest["label"] and leanest["label"].startswith("ZeRO-2")
    smallest_of_all = min(r["estimate"]["total"] for r in plan["strategies"]) / 2**30
    assert float(needs.group(2)) > 24 > smallest_of_all  # the old advice quoted a row that fits already


def test_plan_command_by_names_and_json(tmp_path, capsys):
    """Through the command line, in this process (the plan command's own process is tests/test_cli_startup.py's)."""
    code = main([
        "plan", "--model_name_or_path", "llama-2-13b", "--task", "causal_lm", "--gpu", "h100", "--num_gpus", "8",
        "--json", "--output_dir", str(tmp_path),
    ])  # fmt: skip
    said = capsys.readouterr()
    assert code == 0, said.err
    plan = json.loads(said.out)
    assert plan["model"]["num_params"] == PUBLISHED_PARAMS["llama-2-13b"] and plan["fallbacks"]
    assert main(["plan", "--model_name_or_path", "llama-2-13b", "--task", "causal_lm"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: give --gpu NAME (one of t4, ") and said.endswith(", mi300x) or --gpu_memory_gb")


# ---------------------------------------------------------------- ZeRO-Infinity


def test_nvme_rows_hold_deepspeeds_gpu_figure_and_move_the_offload_to_disk(tmp_path, monkeypatch):
    """The NVMe row's GPU model states are DeepSpeed's estimate with everything offloaded; the states' bytes move
    from CPU memory to the disk; without --nvme_gb no NVMe row fits and the advice names the disk it needs."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from test_planner import BY_KEY, setup

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from cloudtrain.planning.known_models import config_folder

    facts = planning.model_facts(config_folder("llama-2-70b"), task="causal_lm")
    s = setup(8, 1, precision="bf16")
    kw = dict(num_gpus_per_node=8, num_nodes=1, additional_buffer_factor=1.0)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        facts.num_params, facts.largest_module_params, cpu_offload=True, cpu_offload_params=True, **kw
    )
    nvme, cpu_all = BY_KEY["zero3_nvme"], BY_KEY["zero3_offload_all"]
    assert sum(planning.model_state_bytes(facts, nvme, s)) == pytest.approx(gpu, abs=16)
    assert planning.nvme_bytes(facts, nvme, s) == planning.cpu_bytes(facts, cpu_all, s)[0]  # the same 18 B/param
    assert planning.cpu_bytes(facts, nvme, s)[0] < planning.cpu_bytes(facts, cpu_all, s)[0] / 20  # buffers only

    args = dict(task="causal_lm", num_gpus=8, gpu_memory_gb=80, cpu_memory_gb=512, max_length=4096)
    args["mixed_precision"] = "bf16"  # not auto: the figures must not depend on this CPU
    without = planning.make_plan(plan_args("llama-2-70b", tmp_path / "a", **args))
    assert "zero3_nvme" not in json.dumps(without["recommendation"] or {})
    reasons = " ".join(without["recommendation"]["reasons"])
    assert re.search(
        r"Full fine-tuning does not fit: .* CPU memory per node .* would with 115\d GiB of NVMe disk", reasons
    )
    with_disk = planning.make_plan(plan_args("llama-2-70b", tmp_path / "b", nvme_gb=2000, **args))
    assert with_disk["recommendation"]["label"].startswith("ZeRO-3 + NVMe offload (ZeRO-Infinity)")
    ds = json.loads((tmp_path / "b" / "ds_config.json").read_text())["zero_optimization"]
    assert ds["offload_param"]["device"] == ds["offload_optimizer"]["device"] == "nvme"


# ---------------------------------------------------------------- a task's frozen copy (DPO's reference)


def test_a_dpo_reference_copy_is_counted_and_the_cheaper_ways_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(task="dpo", num_gpus=8, gpu_memory_gb=80, max_length=1024, mixed_precision="bf16")
    live = planning.make_plan(plan_args("llama-2-7b", tmp_path / "live", **args))
    pre = planning.make_plan(plan_args("llama-2-7b", tmp_path / "pre", precompute_reference="true", **args))
    P = live["model"]["num_params"]
    assert live["model"]["model_copy"] and not pre["model"]["model_copy"]
    by_key = {(r["strategy"], r["peft"], r["gradient_checkpointing"]): r for r in live["strategies"]}
    by_key_pre = {(r["strategy"], r["peft"], r["gradient_checkpointing"]): r for r in pre["strategies"]}
    ddp, lora = ("ddp", "none", True), ("ddp", "lora", True)
    assert by_key[ddp]["estimate"]["parameters"] - by_key_pre[ddp]["estimate"]["parameters"] == 4 * P
    assert by_key[lora]["estimate"] == by_key_pre[lora]["estimate"]  # adapters: the base is the reference
    # the run refuses the copy under ZeRO-3 (FSDP2 shards it: tests/test_planner_dpo.py); DPO runs in no pipeline
    assert not {k for k in by_key if k[1] == "none" and k[0].startswith("zero3")} and ("fsdp", "none", True) in by_key
    assert ("zero3", "lora", True) in by_key  # LoRA's reference is the base, which ZeRO-3 shards
    assert not any(r["pipeline"] for r in live["strategies"] + pre["strategies"])
    assert not any(k[0] in ("zero3", "fsdp") for k in by_key_pre)  # the one pass before training needs whole weights
    simpo = planning.make_plan(plan_args("llama-2-7b", tmp_path / "simpo", preference_loss="simpo", **args))
    assert not simpo["model"]["model_copy"] and any(r["strategy"] == "zero3" for r in simpo["strategies"])
    # the choice is FSDP2 shard grad-op (4 rows of 1,024 tokens per GPU, the fastest at the same global batch): only
    # LoRA frees the copy there; under ZeRO-2 --precompute_reference would too
    assert "--peft lora would free it (--precompute_reference true runs under DDP or ZeRO-1/2 only)" in " ".join(
        live["recommendation"]["reasons"]
    )
    zero2 = planning.make_plan(plan_args("llama-2-7b", tmp_path / "zero2", strategy="zero2", **args))
    assert "--precompute_reference true or --peft lora would free it" in " ".join(zero2["recommendation"]["reasons"])
    assert " --precompute_reference true " in pre["recommendation"]["command"] + " "
    small = planning.make_plan(plan_args("llama-2-7b", tmp_path / "small", **{**args, "gpu_memory_gb": 40}))
    assert any("--precompute_reference true" in s for s in small["suggestions"] + small["recommendation"]["reasons"])


# ---------------------------------------------------------------- what limits: the GPU, the CPU memory, the disk


def test_where_the_cpu_memory_or_the_disk_limits_the_advice_names_it_not_the_gpu(tmp_path, monkeypatch):
    """8 x H100 with 1 GiB of CPU memory, and --strategy zero3_nvme without --nvme_gb: the advice said "GPUs with
    at least 2 GiB" (found in audit). It names the CPU memory per node that would fit (and that does fit), or the
    disk; and a faster row within the GPU's memory but not the CPU's is not said to need more GPU memory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(task="causal_lm", gpu="h100", num_gpus=8, mixed_precision="bf16")
    tight = planning.make_plan(plan_args("llama-2-7b", tmp_path / "a", cpu_memory_gb=1, **args))
    assert tight["recommendation"] is None and not any("GPUs with at least" in s for s in tight["suggestions"])
    advice = next(s for s in tight["suggestions"] if "of CPU memory per node" in s)
    need = re.search(r"--cpu_memory_gb (\d+)", advice)
    assert need and int(need.group(1)) > 1, advice
    enough = planning.make_plan(plan_args("llama-2-7b", tmp_path / "b", cpu_memory_gb=need.group(1), **args))
    reasons = enough["recommendation"]["reasons"]
    over_gpu = next((r for r in reasons if r.startswith("Faster options need more than 80 GiB")), "")
    assert "ZeRO-1 " not in over_gpu and any(r.startswith("Faster options fit the GPU") and "ZeRO-1 " in r
                                             for r in reasons), reasons  # fmt: skip
    nvme = dict(task="causal_lm", gpu="a10g", num_gpus=4, mixed_precision="bf16", strategy="zero3_nvme")
    disk = planning.make_plan(plan_args("llama-2-7b", tmp_path / "c", **nvme))
    assert disk["recommendation"] is None and not any("GPUs with at least" in s for s in disk["suggestions"])
    assert any("--nvme_gb" in s for s in disk["suggestions"]), disk["suggestions"]


def test_the_offload_reason_names_what_is_offloaded_apart_from_loading(tmp_path, monkeypatch):
    """FSDP2 CPU offload of a 7B on 2 nodes of 4: "Offloading needs 100.4 GiB of CPU memory per node" quoted the
    peak of loading the model, twice the 50.2 GiB the offloaded states take (found in audit)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(task="causal_lm", gpu="a10g", num_gpus=4, num_nodes=2, strategy="fsdp_offload", mixed_precision="bf16")
    rec = planning.make_plan(plan_args("llama-2-7b", tmp_path, **args))["recommendation"]
    offloaded, loading = rec["estimate"]["cpu_offloaded"] / 2**30, rec["estimate"]["cpu_load"] / 2**30
    assert loading > offloaded
    line = next(r for r in rec["reasons"] if r.startswith("Offloading"))
    assert line == (
        f"Offloading keeps {offloaded:.1f} GiB per node in CPU memory and runs the AdamW step on the CPU; loading "
        f"the model needs more, {loading:.1f} GiB per node, before training."
    )
