"""The planner for a diffusers text-to-image pipeline (issue 35, item 3): `cloudtrain plan` on a pipeline folder.

Against the real run's pieces on CPU, on the tiny Stable-Diffusion-shaped pipeline of tests/t2i_fixtures.py:
- the parameter bytes the run holds (cloudtrain.models.diffusion as the task loads it: full fine-tuning and LoRA,
  fp32 and bf16, with and without --train_text_encoder) equal the planner's parameters term exactly, the frozen
  text encoder and VAE weights its frozen term;
- the trainable parameters (the denoiser's and the text encoder's, in full or their adapters) equal the planner's
  count, and a real AdamW step's states are 8 bytes each;
- what autograd saves in a real fp32 forward of the denoiser, for 3 rows, is the planner's meta-device trace, and
  so for the text encoder trained in full or with LoRA;
- ZeRO-2's terms by hand; the rows the task refuses (Task.sharding_refusal) are not planned;
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
from cloudtrain.errors import UserError
from cloudtrain.models import diffusion
from cloudtrain.planning.diffusion import PipelineFacts, Training, estimate, pipeline_facts, trained_params

RESOLUTION = 16  # the tiny pipeline's: 8x8 latents


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i-plan") / "pipe"))


def run_model(path: str, peft: str, precision: str, text_encoder: bool = False) -> diffusion.TextToImageModel:
    """The model as the task builds it (load_text_to_image_model, then the adapters)."""
    options = {"task": "text_to_image", "model_name_or_path": path, "peft": peft, "lora_r": 4}
    cfg = build_config({**options, "mixed_precision": precision, "train_text_encoder": text_encoder})
    model = diffusion.load_text_to_image_model(cfg, path)
    return model.attach_lora(cfg) if peft != "none" else model


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("text_encoder", [False, True])
@pytest.mark.parametrize("peft", ["none", "lora"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_parameter_bytes_and_trainable_counts_equal_the_run_s(pipe, peft, precision, text_encoder):
    facts = pipeline_facts(pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    model = run_model(pipe, peft, precision, text_encoder)
    e = estimate(facts, peft, precision != "no", 1, Training(peft, text_encoder))
    assert e.parameters == nbytes(model.parameters())
    frozen = [p for part in (model.vae, model.text_encoder) for p in part.parameters() if not p.requires_grad]
    assert e.frozen == nbytes(frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    unet, text = trained_params(facts, Training(peft, text_encoder))
    assert sum(p.numel() for p in trainable) == unet + text
    assert sum(p.numel() for p in model.text_encoder.parameters() if p.requires_grad) == text
    assert (text > 0) == text_encoder
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


@pytest.fixture(scope="module")
def xl_pipe(tmp_path_factory) -> str:
    from t2i_fixtures import build_tiny_sdxl_pipeline

    return str(build_tiny_sdxl_pipeline(tmp_path_factory.mktemp("t2i-plan-xl") / "xl"))


@pytest.mark.parametrize("peft, text_encoder", [("none", True), ("lora", True), ("lora", False)])
def test_sdxl_bytes_counts_and_activations_equal_the_run_s(xl_pipe, peft, text_encoder):
    """SDXL: both text encoders (trained together with --train_text_encoder), the fp32 VAE its force_upcast asks
    for, and the denoiser traced with its pooled embedding and time ids."""
    facts = pipeline_facts(xl_pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    assert set(facts.frozen_params) == {"text_encoder", "text_encoder_2", "vae"} and facts.vae_fp32
    model = run_model(xl_pipe, peft, "bf16", text_encoder)
    e = estimate(facts, peft, True, 1, Training(peft, text_encoder))
    assert e.parameters == nbytes(model.parameters())
    frozen = [p for part in (model.vae, *model.text_encoders()) for p in part.parameters() if not p.requires_grad]
    assert e.frozen == nbytes(frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(trained_params(facts, Training(peft, text_encoder)))
    assert all(any(p.requires_grad for p in enc.parameters()) == text_encoder for enc in model.text_encoders())
    if peft != "none":
        return  # the denoiser's trace once
    unet = run_model(xl_pipe, "none", "no").unet.train()  # what a real fp32 forward with the added conditions saves
    weights = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    b, side, config = 3, facts.latent_side, unet.config
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    added = {"text_embeds": torch.randn(b, pooled), "time_ids": torch.full((b, 6), 16.0)}
    states = torch.randn(b, facts.text_tokens, config.cross_attention_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unet(
            torch.randn(b, 4, side, side, requires_grad=True),
            torch.randint(0, 1000, (b,)),
            states,
            added_cond_kwargs=added,
        )
    assert sum(saved.values()) == pytest.approx(b * facts.saved_fp32_per_row, rel=0.05)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_the_traced_text_encoder_equals_what_its_real_forward_saves(pipe, peft):
    """--train_text_encoder: its forward keeps activations for the backward (in full, or to reach its adapters)."""
    facts = pipeline_facts(pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    encoder = run_model(pipe, peft, "no", text_encoder=True).text_encoder.train()
    weights = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    b = 3
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        encoder(torch.randint(0, 40, (b, facts.text_tokens)))
    per_row = facts.text_saved_fp32_per_row if peft == "none" else facts.text_lora_saved_fp32_per_row
    assert 0 < facts.text_lora_saved_fp32_per_row < facts.text_saved_fp32_per_row
    assert sum(saved.values()) == pytest.approx(b * per_row, rel=0.05)
    with_text = estimate(facts, peft, False, b, Training(peft, True)).activations
    assert with_text == estimate(facts, peft, False, b).activations + b * per_row


def test_the_checkpointed_trace_equals_a_real_checkpointed_forward_and_backward(pipe):
    """--gradient_checkpointing: the denoiser's blocks go through the checkpointing function diffusers takes. Torch's
    own (reentrant) checkpoint, run for real on CPU, keeps the blocks' inputs and what runs outside them from the
    forward, and each block's saves while it is recomputed in the backward: the peak is the first plus the
    largest of the second, what the planner traces per row."""
    facts = pipeline_facts(pipe, RESOLUTION, 4, diffusion.LORA_TARGETS)
    unet = run_model(pipe, "none", "no").unet.train()
    weights = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    boxes: list[dict[int, int]] = [{}]  # the forward's saves, then each recompute's
    recomputed: list[int] = []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            boxes[-1][storage.data_ptr()] = storage.nbytes()
        return t

    def checkpointed(block, *args):
        def run(*inputs):
            if not torch.is_grad_enabled():  # the forward: the reentrant checkpoint saves only the inputs
                return block(*inputs)
            boxes.append({})
            try:
                return block(*inputs)
            finally:
                recomputed.append(sum(boxes.pop().values()))

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True)

    unet.enable_gradient_checkpointing(checkpointed)
    b, side = 3, facts.latent_side
    sample = torch.randn(b, 4, side, side, requires_grad=True)
    states = torch.randn(b, facts.text_tokens, unet.config.cross_attention_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unet(sample, torch.randint(0, 1000, (b,)), states).sample
        forward = sum(boxes[0].values())
        out.sum().backward()
    assert len(recomputed) > 1
    assert forward + max(recomputed) == pytest.approx(b * facts.checkpointed_fp32_per_row, rel=0.05)
    assert facts.checkpointed_fp32_per_row < facts.saved_fp32_per_row / 2
    checkpointed = estimate(facts, "none", False, b, Training(checkpointing=True)).activations
    assert checkpointed == b * facts.checkpointed_fp32_per_row


def test_zero2_terms_by_hand():
    """ZeRO-2 over n processes: trained weights in 16 bits, 16-bit + fp32 gradient partitions, AdamW's two moments
    and the fp32 master copy partitioned; the frozen parts whole in the compute dtype."""
    f = PipelineFacts(
        name="by-hand",
        denoiser_params=1000,
        adapter_params=40,
        dora_params=44,
        frozen_params={"text_encoder": 100, "vae": 50},
        text_adapter_params=8,
        text_dora_params=10,
        latent_side=8,
        text_tokens=16,
        saved_fp32_per_row=0,
        saved_half_per_row=0,
        checkpointed_fp32_per_row=0,
        checkpointed_half_per_row=0,
        text_saved_fp32_per_row=0,
        text_saved_half_per_row=0,
        text_lora_saved_fp32_per_row=0,
        text_lora_saved_half_per_row=0,
    )
    full = estimate(f, "none", True, 1, Training("none", True, "zero2", 4))
    # 1100 trained (denoiser + text encoder): 2 bytes each; VAE 2 x 50; (2 + 4) x 1100 / 4; 12 x 1100 / 4
    assert (full.parameters, full.frozen, full.gradients, full.optimizer_states) == (2300, 100, 1650, 3300)
    lora = estimate(f, "lora", True, 1, Training("lora", True, "zero2", 4))
    # 48 adapters (40 + 8) in 16 bits over the 16-bit bases (1000 + 100 + 50); 6 x 48 / 4; 12 x 48 / 4
    assert (lora.parameters, lora.frozen, lora.gradients, lora.optimizer_states) == (96 + 2300, 300, 72, 144)
    fp32 = estimate(f, "lora", False, 1, Training("lora", False, "zero2", 2))
    # without mixed precision: 40 fp32 adapters over the fp32 bases; (4 + 4) x 40 / 2; 12 x 40 / 2
    assert (fp32.parameters, fp32.frozen, fp32.gradients, fp32.optimizer_states) == (160 + 4600, 600, 160, 240)
    ddp = estimate(f, "none", True, 1, Training("none", True))  # DDP: fp32 weights, gradients, autocast copies
    assert (ddp.parameters, ddp.gradients, ddp.optimizer_states) == (4400 + 100, 6600, 8800)


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
    rows = [(r["peft"], r["strategy"], r["checkpointing"], r["max_micro_batch"] >= 2) for r in plan["strategies"]]
    # on one GPU ZeRO-2 partitions nothing and keeps the fp32 master copy: more than DDP
    every = [(p, s, c, p != "none") for p in ("none", "lora", "dora") for s in ("ddp", "zero2") for c in (False, True)]
    assert rows == every
    assert json.loads(json.dumps(plan)) == plan


def test_the_text_encoder_and_zero2_over_several_gpus(pipe, tmp_path, capsys):
    """--train_text_encoder true: every row trains it too; ZeRO-2 over 4 GPUs partitions what trains, so full
    fine-tuning fits where DDP's does not, and the recommendation names the options that run it."""
    options = dict(task="text_to_image", resolution=RESOLUTION, mixed_precision="bf16", num_gpus=4)
    options["per_device_train_batch_size"] = 1
    facts = pipeline_facts(pipe, RESOLUTION, 8, diffusion.LORA_TARGETS)
    ddp = estimate(facts, "none", True, 1, Training("none", True)).total
    zero2 = estimate(facts, "none", True, 1, Training("none", True, "zero2", 4)).total
    assert zero2 < ddp and ddp > estimate(facts, "none", True, 1).total  # the text encoder's states count
    budget = f"{(ddp + zero2) / 2 / 2**30:.6f}"
    plan = planning.make_plan(
        plan_args(pipe, tmp_path / "j", gpu_memory_gb=budget, train_text_encoder="true", **options)
    )
    assert all(r["text_encoder"] and r["processes"] == 4 for r in plan["strategies"])
    rec = plan["recommendation"]
    assert (rec["peft"], rec["strategy"], rec["estimate"]["total"]) == ("none", "zero2", zero2)
    args = ["plan", "--model_name_or_path", pipe, "--output_dir", str(tmp_path / "p"), "--gpu_memory_gb", budget]
    args += [f"--{k}={v}" for k, v in options.items()] + ["--train_text_encoder", "true"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning + text encoder + ZeRO-2" in out
    assert "Recommended: full fine-tuning --train_text_encoder true --zero_stage 2" in out


def test_rows_the_task_refuses_are_not_planned(pipe, tmp_path, monkeypatch):
    """The task's own Task.sharding_refusal (with each row's --peft) decides, as for the other tasks."""
    from cloudtrain.registry import TASKS

    asked = []

    def refusal(self, cfg, shards):
        asked.append((cfg.model.peft, cfg.images.train_text_encoder, shards.zero_stage))
        return "--peft lora under ZeRO-2: refused here" if shards.zero_stage == 2 and cfg.model.peft == "lora" else None

    monkeypatch.setattr(TASKS["text_to_image"], "sharding_refusal", refusal)
    options = dict(task="text_to_image", resolution=RESOLUTION, train_text_encoder="true")
    plan = planning.make_plan(plan_args(pipe, tmp_path / "j", gpu_memory_gb=24, **options))
    rows = [(r["peft"], r["strategy"]) for r in plan["strategies"]]
    assert ("lora", "zero2") not in rows and ("lora", "ddp") in rows and ("dora", "zero2") in rows
    assert ("lora", True, 2) in asked and ("none", True, None) in asked


def test_a_folder_that_is_no_pipeline_is_refused_with_the_run_s_line(tiny_llama_dir, tmp_path, monkeypatch):
    from cloudtrain.errors import UserError
    from cloudtrain.registry import TASKS

    # the task's Task.plans_pipeline (set here as text_to_image.py sets it once wired; a no-op after)
    monkeypatch.setattr(TASKS["text_to_image"], "plans_pipeline", True)
    args = plan_args(tiny_llama_dir, tmp_path / "p", task="text_to_image", gpu_memory_gb=24)
    with pytest.raises(UserError, match=r"is not a diffusers pipeline \(no model_index.json\)"):
        planning.make_plan(args)


@pytest.fixture(scope="module")
def sd3_pipe(tmp_path_factory) -> str:
    from t2i_fixtures import build_tiny_sd3_pipeline

    return str(build_tiny_sd3_pipeline(tmp_path_factory.mktemp("t2i-plan-sd3") / "sd3"))


@pytest.mark.parametrize("peft, text_encoder", [("none", True), ("lora", False)])
def test_sd3_bytes_counts_and_activations_equal_the_run_s(sd3_pipe, peft, text_encoder):
    """SD3: the transformer, both CLIP encoders (trained with --train_text_encoder) and T5 (frozen, in the compute
    dtype, always), the fp32 VAE; the transformer traced with CLIP's and T5's tokens and the pooled projections."""
    from cloudtrain.models import sd3

    facts = pipeline_facts(sd3_pipe, RESOLUTION, 4, sd3.LORA_TARGETS)
    assert set(facts.frozen_params) == {"text_encoder", "text_encoder_2", "text_encoder_3", "vae"}
    assert facts.text_tokens == 16 + 77 and facts.vae_fp32  # CLIP's then T5's (--max_sequence_length 77)
    model = run_model(sd3_pipe, peft, "bf16", text_encoder)
    e = estimate(facts, peft, True, 1, Training(peft, text_encoder))
    assert e.parameters == nbytes(model.parameters())
    frozen = [p for part in (model.vae, *model.frozen_encoders()) for p in part.parameters() if not p.requires_grad]
    assert e.frozen == nbytes(frozen)
    assert model.text_encoder_3.dtype == torch.bfloat16
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == sum(trained_params(facts, Training(peft, text_encoder)))
    if peft != "none":
        return
    transformer = run_model(sd3_pipe, "none", "no").transformer.train()  # a real fp32 forward's saves
    weights = {p.untyped_storage().data_ptr() for p in transformer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    b, side, config = 3, facts.latent_side, transformer.config
    states = torch.randn(b, facts.text_tokens, config.joint_attention_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        transformer(
            hidden_states=torch.randn(b, 4, side, side, requires_grad=True),
            encoder_hidden_states=states,
            pooled_projections=torch.randn(b, config.pooled_projection_dim),
            timestep=torch.rand(b) * 1000,
        )
    assert sum(saved.values()) == pytest.approx(b * facts.saved_fp32_per_row, rel=0.05)
    assert facts.checkpointed_fp32_per_row < facts.saved_fp32_per_row


def test_an_sd3_plan_counts_the_run_s_lora_targets(sd3_pipe, tmp_path):
    """`cloudtrain plan` on an SD3 folder takes SD3's default LoRA targets (its text stream's add_q/k/v_proj and
    to_add_out too, as the run does), not the UNet's: the plan's adapter count is the run's trainable count."""
    from cloudtrain.models import sd3

    options = dict(task="text_to_image", resolution=RESOLUTION, mixed_precision="bf16", lora_r=4)
    plan = planning.make_plan(plan_args(sd3_pipe, tmp_path / "j", gpu_memory_gb=24, **options))
    model = run_model(sd3_pipe, "lora", "bf16")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan["model"]["adapter_params"] == trainable
    unet_only = pipeline_facts(sd3_pipe, RESOLUTION, 4, diffusion.LORA_TARGETS).adapter_params
    assert unet_only < trainable and any(t.endswith("add_q_proj") for t in sd3.LORA_TARGETS)


def test_an_sd3_plan_counts_the_run_s_t5_prompt_length(sd3_pipe, tmp_path):
    """`plan --max_sequence_length` is the run's T5 prompt length: a longer one makes every row's activations the
    ones a forward with that many text tokens saves (the same facts as the run's), where the plan assumed 77."""
    options = dict(task="text_to_image", resolution=RESOLUTION, mixed_precision="bf16", lora_r=4, gpu_memory_gb=24)
    rows = {
        tokens: planning.make_plan(plan_args(sd3_pipe, tmp_path / str(tokens), max_sequence_length=tokens, **options))
        for tokens in (77, 512)
    }
    short, long = (rows[n]["strategies"][0]["estimate"]["activations"] for n in (77, 512))
    facts = {n: pipeline_facts(sd3_pipe, RESOLUTION, 4, [], t5_tokens=n) for n in (77, 512)}
    assert facts[512].text_tokens - facts[77].text_tokens == 512 - 77
    assert long / short == pytest.approx(facts[512].saved_half_per_row / facts[77].saved_half_per_row, rel=1e-6)
    assert long > short
    with pytest.raises(UserError, match=r"--max_sequence_length must be in \[1, 512\]"):  # the run's own bound
        planning.make_plan(plan_args(sd3_pipe, tmp_path / "x", max_sequence_length=600, **options))


def test_strategy_and_peft_pin_a_pipeline_s_rows(pipe, tmp_path):
    """--peft lora --strategy zero2 recommended full fine-tuning under DDP, and --peft qlora was taken (audit)."""
    options = dict(task="text_to_image", resolution=RESOLUTION, gpu_memory_gb=24, num_gpus=2)
    plan = planning.make_plan(plan_args(pipe, tmp_path / "j", peft="lora", strategy="zero2", **options))
    assert {(r["peft"], r["strategy"]) for r in plan["strategies"]} == {("lora", "zero2")}
    pins = [(dict(peft="qlora"), "--peft qlora: --task text_to_image trains the full model or lora"),
            (dict(strategy="fsdp"), "--strategy fsdp: --task text_to_image is planned under")]  # fmt: skip
    for pinned, says in pins:
        with pytest.raises(UserError, match=says):
            planning.make_plan(plan_args(pipe, tmp_path / "k", **options, **pinned))


def test_a_pipeline_plan_takes_the_batch_options_and_says_what_it_does_not_use(pipe, tmp_path, capsys):
    """--global_batch_size was ignored (no accumulation), --per_device_train_batch_size auto planned as 1, what
    --mixed_precision auto became went unsaid, and --max_target_length and --packing got no note (found in audit):
    the plan reaches the global batch with accumulation, auto is the largest micro-batch that fits, and the notes
    are the run's own."""
    options = dict(task="text_to_image", resolution=RESOLUTION, global_batch_size=64)
    unused = dict(max_target_length=5, packing="bfd", lora_r=4)  # (--peft auto plans LoRA at --lora_r 4)
    plan = planning.make_plan(plan_args(pipe, tmp_path / "j", gpu="t4", **unused, **options))
    rec = plan["recommendation"]
    assert (rec["micro_batch"], rec["gradient_accumulation_steps"], plan["mixed_precision"]) == (16, 4, "no")
    notes = " | ".join(plan["notes"])
    assert "--max_target_length 5 has no effect on --task text_to_image" in notes and "--packing bfd has no" in notes
    assert "--mixed_precision auto is no on the t4" in notes and "--lora_r" not in notes
    auto = planning.make_plan(plan_args(pipe, tmp_path / "a", gpu_memory_gb=24, per_device_train_batch_size="auto",
                                        mixed_precision="bf16", **options))  # fmt: skip
    assert (auto["recommendation"]["micro_batch"], auto["recommendation"]["gradient_accumulation_steps"]) == (64, 1)
    # room for the leanest row without checkpointing (LoRA under DDP) at 4 rows, for none at 8: 4, 16 times
    facts = pipeline_facts(pipe, RESOLUTION, 8, diffusion.LORA_TARGETS)
    budget = estimate(facts, "lora", True, 4, Training("lora")).total + 1024
    assert estimate(facts, "lora", True, 8, Training("lora")).total > budget
    args = ["plan", "--model_name_or_path", pipe, "--gpu_memory_gb", f"{budget / 2**30:.9f}"]
    args += ["--per_device_train_batch_size", "64", "--mixed_precision", "bf16", "--gradient_checkpointing", "false"]
    args += ["--lora_r", "8"]  # the facts' adapters
    assert main(args + [f"--{k}={v}" for k, v in options.items()]) in (0, None)
    out = capsys.readouterr().out
    assert "per GPU at micro-batch 64, mixed precision bf16," in out
    assert "Recommended: --peft lora under DDP, --per_device_train_batch_size 4 --gradient_accumulation_steps 16" in out
    assert "Micro-batch 64 fits no row; 4 is the largest that one fits" in out


def test_the_checkpointed_trace_does_not_depend_on_the_dtype_the_denoiser_was_in(pipe):
    """The trace took the parameters' storages before casting the denoiser to the dtype traced: after the bf16 trace
    of the same denoiser those were freed, and activations given their addresses went uncounted, so the checkpointed
    rows' activations (and largest micro-batch) changed from one plan to the next (found in audit)."""
    from cloudtrain.planning.diffusion import _build, checkpointed_saved_bytes

    index = diffusion.read_model_index(pipe)
    latent, text = (4, RESOLUTION // diffusion.vae_scale_factor(pipe)), (16, 16)  # 16 tokens of width 16
    fresh = [checkpointed_saved_bytes(_build(pipe, index, "unet"), latent, text, torch.float32) for _ in range(3)]
    after_bf16 = []
    for _ in range(3):
        unet = _build(pipe, index, "unet")
        checkpointed_saved_bytes(unet, latent, text, torch.bfloat16)
        after_bf16.append(checkpointed_saved_bytes(unet, latent, text, torch.float32))
    assert len(set(fresh)) == 1 and after_bf16 == fresh, (fresh, after_bf16)
