"""--optim and --lr_scheduler_type (cloudtrain.training.optim): every schedule's learning rate per step against
its formula, written out here from its definition; every optimizer steps real weights under the schedule;
the CUDA-only ones refused on CPU in one line; the option checks; --tf32's note on CPU; a DeepSpeed JSON's own
optimizer and scheduler sections reconciled with the options."""

import copy
import json
import math
import re

import pytest
import torch
from conftest import run_cli, topic_run_args
from transformers import BertConfig, BertForSequenceClassification

from cloudtrain.config import resolve_options
from cloudtrain.config.training import CUDA_OPTIMIZERS, SCHEDULERS
from cloudtrain.errors import UserError
from cloudtrain.parallel.distributed import check_distributed, resolve_deepspeed_config, zero_config
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.training.optim import (
    BITSANDBYTES_CLASSES,
    EngineSchedule,
    MuonWithAdamW,
    build_optimizer,
    build_scheduler,
    hidden_matrices,
    other_schedule,
    schedule_name,
)

PEAK, WARMUP, TOTAL = 1e-3, 4, 20
MIN_RATIO, DECAY_RATIO, POWER = 0.1, 0.25, 2.0


def expected_lr(schedule: str, k: int) -> float:
    """The learning rate of optimizer step k (0-based) by each schedule's definition (docs/training.md)."""
    warm = PEAK * k / WARMUP  # the linear warmup from 0 every schedule but constant and wsd starts with
    progress = (k - WARMUP) / (TOTAL - WARMUP)  # through the decay after warmup, 0 -> 1
    if schedule == "constant":
        return PEAK
    if schedule == "warmup_stable_decay":
        decay_start = TOTAL - round(DECAY_RATIO * TOTAL)
        if k < WARMUP:  # transformers' wsd warms up from the floor, not from 0
            return PEAK * (MIN_RATIO + (1 - MIN_RATIO) * k / WARMUP)
        if k < decay_start:
            return PEAK
        share = (k - decay_start) / (TOTAL - decay_start)
        return PEAK * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * share)))
    if k < WARMUP:
        return warm
    return {
        "linear": PEAK * (1 - progress),
        "cosine": PEAK * 0.5 * (1 + math.cos(math.pi * progress)),
        "constant_with_warmup": PEAK,
        "cosine_with_min_lr": PEAK * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))),
        "polynomial": (PEAK - MIN_RATIO * PEAK) * (1 - progress) ** POWER + MIN_RATIO * PEAK,
        "inverse_sqrt": PEAK * math.sqrt(WARMUP / k),
    }[schedule]


def schedule_options(schedule: str) -> dict:
    """The options of `schedule` as a user would give them (only those that shape it)."""
    options: dict = {"lr_scheduler_type": schedule, "learning_rate": PEAK}
    if schedule != "constant":  # it has no warmup (a warmup given is refused)
        options["warmup_steps"] = WARMUP
    if schedule in ("cosine_with_min_lr", "warmup_stable_decay", "polynomial"):
        options["min_lr_ratio"] = MIN_RATIO
    if schedule == "warmup_stable_decay":
        options["decay_ratio"] = DECAY_RATIO
    if schedule == "polynomial":
        options["polynomial_power"] = POWER
    return options


def tiny_classifier() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3
    )
    return BertForSequenceClassification(config)


def train_steps(model: torch.nn.Module, options: dict, steps: int) -> tuple[list[list[float]], torch.optim.Optimizer]:
    """`steps` real optimizer steps on a fixed batch; the learning rate of every group at each step."""
    cfg = resolve_options(None, options)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, TOTAL)
    batch = {"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))}
    labels = torch.tensor([0, 1, 2, 0])
    lrs = []
    for _ in range(steps):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return lrs, optimizer


@pytest.mark.parametrize("schedule", SCHEDULERS)
def test_each_schedule_follows_its_formula(schedule):
    lrs, _ = train_steps(tiny_classifier(), schedule_options(schedule), TOTAL)
    for k, groups in enumerate(lrs):
        assert groups == pytest.approx([expected_lr(schedule, k)] * len(groups), rel=1e-9, abs=1e-15), k


@pytest.mark.parametrize(
    "schedule, option, value",
    [("cosine_with_min_lr", "min_lr_ratio", 0.3), ("warmup_stable_decay", "decay_ratio", 0.5),
     ("warmup_stable_decay", "min_lr_ratio", 0.3), ("polynomial", "polynomial_power", 3.0)],
)  # fmt: skip
def test_a_schedule_s_own_options_make_it_another_schedule(schedule, option, value):
    """A checkpoint records its schedule's name; a resume with another --min_lr_ratio changed the rate unsaid."""
    base = schedule_options(schedule)
    assert schedule_name(resolve_options(base, {})) != schedule_name(resolve_options(base, {option: value}))
    assert schedule_name(resolve_options(base, {})) == schedule_name(resolve_options(base, {}))
    now = schedule_name(resolve_options(base, {}))
    assert not other_schedule(now.rsplit(", ", 1)[0], now)  # a checkpoint named before the options: the same
    assert other_schedule("constant", now) and not other_schedule(None, now) and not other_schedule(now, now)


def test_warmup_steps_win_over_the_ratio_and_the_ratio_applies_alone():
    by_steps, _ = train_steps(tiny_classifier(), {"learning_rate": PEAK, "warmup_ratio": 0.5, "warmup_steps": 4}, 6)
    by_ratio, _ = train_steps(tiny_classifier(), {"learning_rate": PEAK, "warmup_ratio": 0.5}, 12)
    assert [g[0] for g in by_steps] == pytest.approx([PEAK * k / 4 for k in range(4)] + [PEAK, PEAK * 15 / 16])
    assert [g[0] for g in by_ratio] == pytest.approx([PEAK * k / 10 for k in range(10)] + [PEAK, PEAK * 9 / 10])


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "muon"])
def test_each_cpu_optimizer_steps_every_group_on_the_schedule(optim):
    model = tiny_classifier()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    lrs, optimizer = train_steps(model, {**schedule_options("linear"), "optim": optim, "weight_decay": 0.1}, 6)
    for k, groups in enumerate(lrs):
        assert groups == pytest.approx([expected_lr("linear", k)] * len(groups)), k
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) == len(before)  # every weight trained, the 1-d ones and the head included
    decays = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        assert decays[id(p)] == (0.0 if p.ndim < 2 else 0.1), name


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest_and_resumes_exactly():
    model = tiny_classifier()
    _, optimizer = train_steps(model, {**schedule_options("linear"), "optim": "muon"}, 3)
    assert isinstance(optimizer, MuonWithAdamW)
    muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[i] for i in muon} == {names[id(p)] for p in hidden_matrices(model)}
    assert any("attention.self.query" in names[i] for i in muon)
    assert not any("embeddings" in names[i] or "classifier" in names[i] for i in muon)

    # a restored optimizer takes the same next step as the one it was saved from
    # state_dict() holds the live state tensors: copy it, as saving to a file does
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters()}

    def step_with(opt) -> dict:
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    original = step_with(optimizer)
    model.load_state_dict(saved_weights)
    restored = MuonWithAdamW(model, PEAK, 0.01)
    restored.load_state_dict(saved_state)
    assert restored.param_groups[0]["lr"] == saved_state["param_groups"][0]["lr"]
    again = step_with(restored)
    assert all(torch.equal(original[k], again[k]) for k in original)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
@pytest.mark.parametrize("optim", CUDA_OPTIMIZERS)
def test_cuda_only_optimizers_are_refused_on_cpu(optim):
    with pytest.raises(UserError, match=rf"^--optim {optim} needs a CUDA GPU \(bitsandbytes"):
        check_distributed(resolve_options(None, {"optim": optim}))


@pytest.mark.slow  # a fresh interpreter per case: the full suite runs it
def test_cuda_only_optimizer_is_one_line_from_the_command(tmp_path, tiny_model_dir, topic_csvs):
    result = run_cli(*topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "out"), "--optim", "paged_adamw_8bit")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --optim paged_adamw_8bit needs a CUDA GPU (bitsandbytes' 8-bit and paged optimizers have CUDA "
        "kernels only); use --optim adamw or adafactor on this machine"
    ]
    assert not (tmp_path / "out").exists()


def test_the_logged_learning_rate_is_the_one_each_step_was_taken_at(tmp_path, tiny_model_dir, topic_csvs):
    """It was read after the schedule stepped, so the rate of the next step (found in audit): step 1 of a warmup
    said 5e-4 where it trained at 0, and every run ended on a logged 0."""
    options = ["--max_steps", "4", "--logging_steps", "1", "--warmup_steps", "2", "--learning_rate", "1e-3"]
    result = run_cli(
        *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "out"), *options, "--lr_scheduler_type", "linear",
        "--eval_strategy", "no",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rates = [e["train/learning_rate"] for e in logged if "train/learning_rate" in e]
    assert rates == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])  # warmup over steps 1-2, then the linear decay to 0


@pytest.mark.gpu
@pytest.mark.parametrize("optim", CUDA_OPTIMIZERS)
def test_cuda_only_optimizers_train_on_the_schedule(optim):
    """bitsandbytes' optimizer of `optim`, built as a run builds it, steps on the schedule and its loss falls on a
    batch it trains on (the GPU machines install the qlora extra: a missing package fails, it is not skipped)."""
    import bitsandbytes

    model = tiny_classifier().cuda()
    cfg = resolve_options(None, {**schedule_options("constant_with_warmup"), "optim": optim, "learning_rate": 1e-2})
    check_distributed(cfg)
    optimizer, lrs, losses = build_optimizer(model, cfg), [], []
    assert type(optimizer).__name__ == BITSANDBYTES_CLASSES[optim]
    assert type(optimizer).__module__.startswith(bitsandbytes.optim.__name__)
    scheduler = build_scheduler(optimizer, cfg, TOTAL)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (8, 8), generator=generator).cuda()
    labels = torch.randint(0, 3, (8,), generator=generator).cuda()
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = model(input_ids=batch, labels=labels).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    assert lrs == pytest.approx([1e-2 * min(1.0, k / WARMUP) for k in range(12)])
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_lr_ratio": 0.1}, "--min_lr_ratio shapes only --lr_scheduler_type cosine_with_min_lr or "),
        ({"lr_scheduler_type": "cosine", "decay_ratio": 0.2}, "--decay_ratio shapes only --lr_scheduler_type warmup"),
        ({"polynomial_power": 2}, "--polynomial_power shapes only --lr_scheduler_type polynomial"),
        ({"optim": "adafactor", "adamw_implementation": "foreach"}, "--adamw_implementation applies to --optim adamw"),
        ({"warmup_steps": -1}, "--warmup_steps must not be negative"),
        ({"lr_scheduler_type": "cosine_with_min_lr", "min_lr_ratio": 1.0}, "--min_lr_ratio must be in [0, 1)"),
        (
            {"lr_scheduler_type": "warmup_stable_decay", "warmup_ratio": 0.5, "decay_ratio": 0.6},
            "--warmup_ratio + --decay_ratio exceed 1",
        ),
    ],
)
def test_contradicting_optimizer_and_schedule_options_are_refused(options, message):
    with pytest.raises(UserError, match="^" + re.escape(message)):
        resolve_options(None, options)


def test_muon_under_zero_is_refused():
    with pytest.raises(UserError, match="^--optim muon orthogonalises whole weight matrices"):
        check_distributed(resolve_options(None, {"optim": "muon", "zero_stage": 2}))


@pytest.mark.parametrize("options", [{"fsdp": True}, {"tensor_parallel_size": 2, "task": "causal_lm"}])
def test_adafactor_with_dtensor_weights_is_refused_before_loading(options):
    """It crashed at the first optimizer step with a traceback on every process (found in audit)."""
    with pytest.raises(UserError, match="^--optim adafactor .* cannot step the DTensor weights"):
        check_distributed(resolve_options(None, {"optim": "adafactor", **options}))
    check_distributed(resolve_options(None, {"optim": "adafactor", "context_parallel_size": 1}))  # DDP: fine


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note of a machine without CUDA")
def test_tf32_is_a_noted_no_op_on_cpu(capsys):
    precision = torch.backends.cuda.matmul.fp32_precision
    Runtime.for_launch(resolve_options(None, {"training_type": "basic", "tf32": True}))
    assert capsys.readouterr().out == "note: --tf32 has no effect on cpu (TF32 is a CUDA matmul mode)\n"
    assert torch.backends.cuda.matmul.fp32_precision == precision


@pytest.mark.gpu
def test_tf32_sets_cuda_matmul_precision():
    """--tf32 on CUDA: float32 matmuls run in TF32 (seen in their results: about 1e-3 relative error against
    float64, where full float32 gives about 1e-6), and are back to full float32 once the setting is undone."""
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=generator, dtype=torch.float64) for _ in range(2))
    exact = a @ b

    def error() -> float:
        product = a.float().cuda() @ b.float().cuda()
        return float((product.double().cpu() - exact).abs().max() / exact.abs().max())

    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        full = error()
        Runtime.for_launch(resolve_options(None, {"training_type": "basic", "tf32": True}))
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert error() > 20 * full, (error(), full)
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


# ---------------------------------------------------------------- a DeepSpeed JSON's own optimizer and schedule
def users_json(tmp_path, **params) -> str:
    """A DeepSpeed JSON as users write it: AdamW, WarmupDecayLR, fp16 with dynamic loss scaling."""
    config = {
        **zero_config(2),
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.98]}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 2, **params},
        },
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_the_users_sections_are_kept_and_their_auto_values_filled(tmp_path):
    path = users_json(tmp_path, total_num_steps="auto")
    cfg = resolve_options(None, {"deepspeed_config": path, "max_steps": 10, "learning_rate": 3e-4, "weight_decay": 0})
    resolved = resolve_deepspeed_config(path, json.loads(open(path).read()), cfg, world_size=2)
    assert resolved["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.0, "betas": [0.9, 0.98]}
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 2,
        "total_num_steps": 10,
    }


@pytest.mark.parametrize(
    ("options", "extra", "message"),
    [
        ({"optim": "adafactor"}, {}, "has its own optimizer section, which --optim would contradict; drop --optim"),
        ({"lr_scheduler_type": "cosine"}, {}, "has its own scheduler section, which --lr_scheduler_type would"),
        ({}, {"total_num_steps": "auto"}, 'leaves scheduler.params.total_num_steps "auto", which no option fills'),
        ({"warmup_steps": 5, "max_steps": 9}, {}, "sets scheduler.params.warmup_num_steps = 2 but --warmup_steps"),
        (
            {"per_device_train_batch_size": 8, "max_steps": 9},
            {"train_micro_batch_size_per_gpu": 4},
            "sets train_micro_batch_size_per_gpu = 4 but --per_device_train_batch_size gives 8",
        ),
    ],
)
def test_the_users_sections_refuse_what_contradicts_them(tmp_path, options, extra, message):
    config = json.loads(open(users_json(tmp_path, total_num_steps=12)).read())
    for key, value in extra.items():  # top-level keys, or the scheduler's params
        (config["scheduler"]["params"] if key == "total_num_steps" else config)[key] = value
    (tmp_path / "ds.json").write_text(json.dumps(config))
    cfg = resolve_options(None, {"deepspeed_config": str(tmp_path / "ds.json"), "mixed_precision": "no", **options})
    with pytest.raises(UserError, match=re.escape(message)):
        resolve_deepspeed_config(str(tmp_path / "ds.json"), config, cfg, world_size=2)


@pytest.mark.parametrize("kept", ["optimizer", "scheduler"])
def test_a_json_with_one_section_takes_the_other_from_the_options(tmp_path, kept):
    """Only an optimizer section: DeepSpeed builds the file's optimizer (accelerate's placeholder here) and
    --lr_scheduler_type drives it; only a scheduler section: --optim's optimizer, the engine's schedule observed.
    The options of the half the file leaves out are cloudtrain's to give (2-process runs: tests/test_own_module.py)."""
    config = json.loads(open(users_json(tmp_path, total_num_steps="auto")).read())
    del config["scheduler" if kept == "optimizer" else "optimizer"]
    (tmp_path / "ds.json").write_text(json.dumps(config))
    other = {"lr_scheduler_type": "cosine"} if kept == "optimizer" else {"optim": "adafactor"}
    options = {"deepspeed_config": str(tmp_path / "ds.json"), "mixed_precision": "no", "max_steps": 10, **other}
    cfg = resolve_options(None, options)
    resolved = resolve_deepspeed_config(str(tmp_path / "ds.json"), config, cfg, world_size=2)  # nothing refused
    assert {"optimizer", "scheduler"} & resolved.keys() == {kept}
    model = tiny_classifier()
    optimizer = build_optimizer(model, cfg)
    # the schedule is built over the engine's optimizer, after prepare(): here over a torch one in its place
    engine_optimizer = torch.optim.AdamW(model.parameters()) if kept == "optimizer" else optimizer
    schedule = build_scheduler(engine_optimizer, cfg, TOTAL)
    if kept == "optimizer":
        assert type(optimizer).__name__ == "DummyOptim" and isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
        assert resolved["optimizer"]["params"]["lr"] == cfg.training.learning_rate
    else:
        assert type(optimizer).__name__ == "Adafactor" and isinstance(schedule, EngineSchedule)
        assert resolved["scheduler"]["params"]["total_num_steps"] == 10


def test_muon_leaves_every_output_head_to_adamw():
    """An untied T5 LM head sits inside its base_model, and PEFT's trained copy of a classifier head inside the
    LoraModel: both went to Muon, which the docs keep for the body's matrices (found in audit)."""
    from peft import LoraConfig, get_peft_model
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, tie_word_embeddings=False)
    )
    assert id(t5.lm_head.weight) not in {id(w) for w in hidden_matrices(t5)} and hidden_matrices(t5)
    bert = BertForSequenceClassification(
        BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    lora = get_peft_model(bert, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value", "dense"]))
    trainable = {name for name, p in lora.named_parameters() if p.requires_grad}
    muon = {name for name, p in lora.named_parameters() if id(p) in {id(w) for w in hidden_matrices(lora)}}
    assert any("classifier.modules_to_save" in name for name in trainable)
    assert muon and not any("classifier" in name for name in muon), muon


def test_warmup_that_a_schedule_cannot_run_is_one_line():
    """--lr_scheduler_type constant ignored a warmup without a word; warmup_stable_decay with --warmup_steps
    covering the run never decayed (found in audit)."""
    from cloudtrain.config import build_config
    from cloudtrain.training.optim import build_scheduler

    with pytest.raises(UserError, match="constant has no warmup, .* use --lr_scheduler_type constant_with_warmup"):
        resolve_options(None, {"lr_scheduler_type": "constant", "warmup_steps": 3})
    resolve_options(None, {"lr_scheduler_type": "constant", "warmup_ratio": 0.0})  # no warmup: fine
    cfg = build_config({"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 10})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UserError, match=r"--warmup_steps 10 and --decay_ratio 0.1 \(1 steps\) exceed the run's 10 "):
        build_scheduler(optimizer, cfg, 10)
    build_scheduler(optimizer, cfg, 20)
    ratios = build_config({"lr_scheduler_type": "warmup_stable_decay", "warmup_ratio": 0.1, "decay_ratio": 0.9})
    build_scheduler(optimizer, ratios, 15)  # 2 + 14 rounded steps of 15: the ratios' rounding, not the user's (review)


@pytest.mark.parametrize("epochs, per_epoch, steps", [(2.2, 25, 55), (1.1, 50, 55), (0.14, 50, 7), (2.21, 25, 56)])
def test_fractional_epochs_count_the_steps_they_name(epochs, per_epoch, steps):
    from cloudtrain.training.trainer import epochs_in_steps

    assert epochs_in_steps(epochs, per_epoch) == steps


TENSOR_PARALLEL_GROUPS = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from cloudtrain.training.optim import adamw_kernel, weight_decay_groups

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
sharded = lambda t: torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]))
# as tensor parallelism leaves a biased attention projection: the matrix and its bias split, a norm's scale not
params = [sharded(torch.randn(4, 4)), sharded(torch.randn(4)), torch.nn.Parameter(torch.ones(4))]
groups = weight_decay_groups(params, 0.1)
print([(len(g["params"]), g["weight_decay"]) for g in groups])
for implementation in ("fused", "foreach"):
    optimizer = torch.optim.AdamW(weight_decay_groups(params, 0.1), lr=0.1, **adamw_kernel(implementation))
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
print("stepped", float(params[2].detach().sum()) < 4)
dist.destroy_process_group()
"""


def test_tensor_parallel_plain_and_split_parameters_never_share_a_group():
    """A model with biases (Qwen2, Llama with attention_bias) under tensor parallelism stopped at its first step:
    its split biases (DTensors) and its norms' plain scales shared the no-decay group, which AdamW's fused and
    foreach kernels refuse (found in audit). Run in a child: it starts a process group."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL_GROUPS, str(port)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["[(1, 0.1), (1, 0.0), (1, 0.0)]", "stepped True"]
