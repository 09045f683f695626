"""The planner's kernel options (cloudtrain.planning.kernels): which loss and modules a run takes, chosen as the run
chooses them; Liger's fused loss by hand; where a fused loss or Liger's modules count, and where they do not (rows
that shard or split the LM head, adapters, tensor-parallel rows); `plan` passing --liger_kernels on. The terms
against GPU measurements: tests/test_planner_fsdp.py."""

from dataclasses import replace

import pytest
from test_planner import (
    decoder_dirs_fixture,  # noqa: F401  (the decoder_dirs fixture)
    plan_args,
)
from test_planner_fsdp import BY_KEY, measured_config

from cloudtrain import planning
from cloudtrain.errors import UserError
from cloudtrain.planning import GIB, Candidate, Setup, kernels
from cloudtrain.planning.kernels import loss_kernel, planned_kernels
from cloudtrain.planning.memory import rank_estimates
from cloudtrain.planning.search import no_tensor_parallel
from cloudtrain.planning.strategies import TENSOR_PARALLEL

B, S = 8, 2048


@pytest.mark.parametrize(
    "choice, liger, kernel",
    [
        ("auto", True, "liger"),
        ("auto", False, None),  # auto fuses only where Liger Kernel runs, as the run does
        ("true", True, "liger"),
        ("true", False, "chunked"),
        ("false", True, None),
    ],
)
def test_the_loss_kernel_is_chosen_as_the_run_chooses_it(choice, liger, kernel):
    assert loss_kernel(choice, liger) == kernel


def test_the_plan_takes_ligers_kernels_where_it_is_installed_and_the_task_can_use_them(monkeypatch):
    causal, dpo = (planning.task_for(name) for name in ("causal_lm", "dpo"))
    assert planned_kernels("auto", "auto", "llama", causal) == (None, False)  # not installed (conftest)
    assert planned_kernels("true", True, "llama", causal) == ("chunked", False)
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    monkeypatch.setattr(kernels, "liger_knows", lambda model_type: model_type == "llama")
    assert planned_kernels("auto", "auto", "llama", causal) == ("liger", True)
    assert planned_kernels("auto", "auto", "gpt2", causal) == ("liger", False)  # a family Liger has no modules for
    assert planned_kernels("auto", False, "llama", causal) == ("liger", False)
    assert planned_kernels("auto", "auto", "llama", dpo) == (None, True)  # DPO's loss is its own
    # in a run (batch size auto): where Liger runs there, and the run's own reason for auto to leave them off
    assert planned_kernels("auto", "auto", "llama", causal, liger=False) == (None, False)
    assert planned_kernels("auto", "auto", "llama", causal, auto_off="adapters: ...") == ("liger", False)
    assert planned_kernels("auto", True, "llama", causal, auto_off="adapters: ...") == ("liger", True)
    seq2seq = planning.task_for("seq2seq")
    assert planned_kernels("true", "auto", "t5", seq2seq) == (None, False)


@pytest.fixture(name="facts")
def facts_fixture(tmp_path):
    return planning.model_facts(measured_config(tmp_path, "llama-1.04b"), task="causal_lm", from_config=True)


def estimate(facts, key: str, peft: str = "none", gpus: int = 1, **kernels) -> planning.Estimate:
    setup = Setup(gpus, 1, 80 * GIB, None, S, "bf16", step_rows=B, dense_mask=False, **kernels)
    return planning.estimate(facts, Candidate(BY_KEY[key], False, peft), setup, B)


def test_ligers_loss_by_hand(facts):
    """bf16: the hidden states and the head cast to it, their gradients, one chunk of logits: 32000 / 2048 makes 16
    chunks, 1024 rows each."""
    h, V = 2048, 32000
    assert facts.model_type == "llama"
    assert estimate(facts, "ddp", fused_loss="liger").logits == 2 * 2 * (B * S + V) * h + 2 * 1024 * V
    assert estimate(facts, "ddp").logits == B * S * V * 12


@pytest.mark.parametrize("key", ["zero3", "fsdp", "fsdp_grad_op"])
def test_rows_that_shard_the_head_count_the_full_logits(facts, key):
    assert estimate(facts, key, gpus=2, fused_loss="liger").logits == estimate(facts, key, gpus=2).logits
    assert estimate(facts, "zero2", gpus=2, fused_loss="liger").logits < estimate(facts, "zero2", gpus=2).logits


def test_a_pipelines_last_stage_takes_the_fused_loss_and_the_others_hold_no_logits(decoder_dirs):
    """PipelineTrainer hands the fused loss its last stage's hidden states (fp32 under autocast: the residual
    stream of fp32 weights); without one the last stage holds the full logits, of each micro-batch under GPipe."""
    facts = planning.model_facts(decoder_dirs["8b"], task="causal_lm")
    for schedule, kept in (("1f1b", 1), ("gpipe", 4)):
        pipe = Candidate(planning.PIPELINE, False, pipeline=planning.Pipeline(2, schedule, 4, rows=4))
        setups = [Setup(2, 1, 80 * GIB, None, S, "bf16", step_rows=B, fused_loss=loss) for loss in ("liger", None)]
        fused, full = (rank_estimates(facts, pipe, setup, 2) for setup in setups)
        assert fused[0].logits == full[0].logits == 0  # the first stage has no head
        assert full[-1].logits == kept * planning.logits_bytes(facts, 2, S, True)
        assert fused[-1].logits == kept * planning.logits_bytes(facts, 2, S, True, "liger", 4) < full[-1].logits


def test_ligers_modules_count_in_full_fine_tuning_only(decoder_dirs):
    facts = planning.model_facts(decoder_dirs["8b"], task="causal_lm")  # a checkpoint: adapter rows too
    full = estimate(facts, "ddp", fused_modules=True).activations
    assert full < estimate(facts, "ddp").activations
    lora = estimate(facts, "ddp", peft="lora", fused_modules=True).activations
    assert lora == estimate(facts, "ddp", peft="lora").activations  # auto leaves adapters to the model's modules
    tensor = Candidate(TENSOR_PARALLEL, False, tensor_parallel=2)
    setups = [Setup(2, 1, 80 * GIB, None, S, "bf16", step_rows=B, fused_modules=on) for on in (True, False)]
    split = [planning.estimate(facts, tensor, setup, B).activations for setup in setups]
    assert split[0] == split[1]  # nor with the weights split (DTensors)


def test_an_auto_fused_loss_keeps_the_tensor_parallel_rows(facts):
    facts = replace(facts, from_config=False)  # a saved model: the run loads it sharded (not one built from a config)
    setup = Setup(2, 1, 80 * GIB, None, S, "bf16", step_rows=B, fused_loss="liger")
    assert no_tensor_parallel(facts, setup) is None
    asked = Setup(2, 1, 80 * GIB, None, S, "bf16", step_rows=B, fused_loss="liger", fused_loss_asked=True)
    assert "refuses --fused_cross_entropy true" in no_tensor_parallel(facts, asked)


def test_plan_passes_liger_kernels_on_to_the_launch_command(tmp_path):
    options = dict(task="causal_lm", model_config=measured_config(tmp_path, "llama-600m"), max_length=512)
    options |= dict(num_gpus=1, gpu_memory_gb=80)
    plan = planning.make_plan(plan_args(None, tmp_path / "plan", liger_kernels="false", **options))
    assert "--liger_kernels false" in plan["recommendation"]["command"]
    assert plan["setup"]["fused_modules"] is False
    plan = planning.make_plan(plan_args(None, tmp_path / "auto", **options))
    assert "--liger_kernels" not in plan["recommendation"]["command"]  # auto: the run's own default


def test_a_fused_loss_asked_for_drops_the_rows_the_run_refuses(tmp_path):
    options = dict(task="causal_lm", model_config=measured_config(tmp_path, "llama-600m"), max_length=512)
    options |= dict(num_gpus=2, gpu_memory_gb=80, fused_cross_entropy="true")
    plan = planning.make_plan(plan_args(None, tmp_path / "plan", **options))
    keys = {r["strategy"] for r in plan["strategies"]}
    assert {"ddp", "zero1", "zero2"} <= keys and not keys & {"zero3", "fsdp", "fsdp_grad_op", "cp_fsdp"}
    assert "no ZeRO-3 or FSDP rows: --fused_cross_entropy true refuses them" in plan["notes"]
    with pytest.raises(UserError, match="--strategy fsdp: the run refuses it: --fused_cross_entropy true reads"):
        planning.make_plan(plan_args(None, tmp_path / "fsdp", strategy="fsdp", **options))


def test_kernel_options_the_run_refuses_are_refused_by_the_plan(tmp_path, tiny_model_dir, facts):
    """The plan dropped them and recommended a launch the run then refused (found in audit)."""
    with pytest.raises(UserError, match="--fused_cross_entropy true: --task classification has no language-model"):
        planning.make_plan(plan_args(tiny_model_dir, tmp_path / "a", task="classification", gpu_memory_gb=80,
                                     fused_cross_entropy="true"))  # fmt: skip
    options = dict(task="causal_lm", model_config=measured_config(tmp_path, "llama-600m"), max_length=512)
    options |= dict(num_gpus=2, gpu_memory_gb=80)
    with pytest.raises(UserError, match="--strategy tp: --tensor_parallel_size loads a saved model sharded, not one"):
        planning.make_plan(plan_args(None, tmp_path / "b", strategy="tp", **options))
    liger = Setup(2, 1, 80 * GIB, None, S, "bf16", step_rows=B, liger_asked=True)
    assert "refuses --liger_kernels true" in no_tensor_parallel(facts, liger)
