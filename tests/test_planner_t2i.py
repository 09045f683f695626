"""The planner for a diffusers text-to-image pipeline (issue 35, item 3): `cloudtrain plan` on a pipeline folder.

Against the real run's pieces on CPU, on the tiny Stable-Diffusion-shaped pipeline of tests/t2i_fixtures.py:
- the parameter bytes the run holds (cloudtrain.models.diffusion as the task loads it: full fine-tuning and LoRA,
  fp32 and bf16) equal the planner's parameters term exactly, the frozen text encoder and VAE its frozen term;
- the adapters' trainable parameters equal the planner's count, and a real AdamW step's states are 8 bytes each;
- what autograd saves in a real fp32 forward of the denoiser, for 3 rows, is the planner's meta-device trace;
- the command prints the rows and recommends what fits.
"""

import json

import pytest
import torch
from t2i_fixtures import build_tiny_pipeline
from test_planner import plan_args

from cloudtrain import planning
from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.models import diffusion
from cloudtrain.planning.diffusion import estimate, pipeline_facts

RESOLUTION = 16  # the tiny pipeline's: 8x8 latents


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i-plan") / "pipe"))


def run_model(path: str, peft: str, precision: str) -> diffusion.TextToImageModel:
    """The model as the task builds it (load_text_to_image_model, then the adapters)."""
    cfg = build_config(
        {"task": "text_to_image", "model_name_or_path": path, "peft": peft, "lora_r": 4, "mixed_precision": precision}
    )
    model = diffusion.load_text_to_image_model(cfg, path)
    return model.attach_lora(cfg) if peft != "none" else model


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("peft", ["none", "lora"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_parameter_bytes_and_trainable_counts_equal_the_run_s(pipe, peft, precision):
    facts = pipeline_facts(pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    model = run_model(pipe, peft, precision)
    e = estimate(facts, peft, precision != "no", 1)
    assert e.parameters == nbytes(model.parameters())
    assert e.frozen == nbytes(model.vae.parameters()) + nbytes(model.text_encoder.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == (facts.denoiser_params if peft == "none" else facts.adapter_params)
    assert all(p.dtype == torch.float32 for p in trainable)  # what the optimizer updates
    # AdamW's two fp32 moments per trainable parameter, after a real step
    optimizer = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.ones_like(p)
    optimizer.step()
    moments = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    assert e.optimizer_states == nbytes(moments)
    assert e.gradients == nbytes(trainable) + (2 * sum(p.numel() for p in trainable) if precision != "no" else 0)


def test_the_traced_activations_equal_what_a_real_forward_saves(pipe):
    facts = pipeline_facts(pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    unet = run_model(pipe, "none", "no").unet.train()
    weights = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    b, side = 3, facts.latent_side
    sample = torch.randn(b, 4, side, side, requires_grad=True)
    states = torch.randn(b, facts.text_tokens, unet.config.cross_attention_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unet(sample, torch.randint(0, 1000, (b,)), states)
    assert sum(saved.values()) == pytest.approx(b * facts.saved_fp32_per_row, rel=0.05)
    assert facts.saved_half_per_row == pytest.approx(facts.saved_fp32_per_row / 2, rel=0.05)
    assert estimate(facts, "none", False, b).activations == b * facts.saved_fp32_per_row


def test_plan_on_a_pipeline_folder_prints_its_rows_and_recommends_what_fits(pipe, tmp_path, capsys):
    args = ["plan", "--task", "text_to_image", "--model_name_or_path", pipe, "--resolution", str(RESOLUTION)]
    args += ["--mixed_precision", "bf16", "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "p")]
    facts = pipeline_facts(pipe, RESOLUTION, 8, diffusion.LORA_TARGETS)  # plan's default --lora_r
    full, lora = estimate(facts, "none", True, 2).total, estimate(facts, "lora", True, 2).total
    assert lora < full
    between = (full + lora) / 2 / 2**30  # room for LoRA at micro-batch 2, not for full fine-tuning
    assert main([*args, "--gpu_memory_gb", f"{between:.6f}"]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning + DDP" in out and "LoRA + DDP" in out and "Recommended: --peft lora" in out
    options = dict(task="text_to_image", resolution=RESOLUTION, mixed_precision="bf16", per_device_train_batch_size=2)
    plan = planning.make_plan(plan_args(pipe, tmp_path / "j", gpu_memory_gb=f"{between:.6f}", **options))
    assert plan["recommendation"]["peft"] == "lora" and plan["model"]["frozen_params"]["vae"] > 0
    assert [r["max_micro_batch"] >= 2 for r in plan["strategies"]] == [False, True, True]
    assert json.loads(json.dumps(plan)) == plan


def test_a_folder_that_is_no_pipeline_is_refused_with_the_run_s_line(tiny_llama_dir, tmp_path, monkeypatch):
    from cloudtrain.errors import UserError
    from cloudtrain.registry import TASKS

    # the task's Task.plans_pipeline (set here as text_to_image.py sets it once wired; a no-op after)
    monkeypatch.setattr(TASKS["text_to_image"], "plans_pipeline", True)
    args = plan_args(tiny_llama_dir, tmp_path / "p", task="text_to_image", gpu_memory_gb=24)
    with pytest.raises(UserError, match=r"is not a diffusers pipeline \(no model_index.json\)"):
        planning.make_plan(args)
