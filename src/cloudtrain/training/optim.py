"""The optimizer (--optim) and the learning-rate schedule (--lr_scheduler_type) every trainer steps.

Every optimizer gets the same two parameter groups: the matrices with --weight_decay, the 1-d tensors
(biases, normalisation weights) with none (under tensor parallelism each may split in two: plain tensors and
DTensors). A user DeepSpeed JSON with an `optimizer` or `scheduler`
section builds its own (cloudtrain.parallel.distributed): the optimizer is then accelerate's placeholder,
which DeepSpeed replaces, and the schedule an observer of the engine's.
"""

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from cloudtrain.config import Config
from cloudtrain.config.training import CUDA_OPTIMIZERS
from cloudtrain.errors import UserError

BITSANDBYTES_CLASSES = {
    "adamw_8bit": "AdamW8bit",
    "paged_adamw_32bit": "PagedAdamW32bit",
    "paged_adamw_8bit": "PagedAdamW8bit",
}


def adamw_kernel(implementation: str) -> dict:
    """torch.optim.AdamW's keyword for --adamw_implementation; auto is fused, measured the fastest
    (bench/results/latest.md) and supported on CPU and CUDA, also under DeepSpeed and FSDP."""
    return {
        "auto": {"fused": True},
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for_loop": {"foreach": False},
    }[implementation]


def check_optimizer(cfg: Config, cuda: bool | None = None) -> None:
    """What the chosen optimizer needs of this machine, refused in one line before anything loads."""
    optim = cfg.training.optim
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if optim in CUDA_OPTIMIZERS and not cuda:
        raise UserError(
            f"--optim {optim} needs a CUDA GPU (bitsandbytes' 8-bit and paged optimizers have CUDA kernels "
            "only); use --optim adamw or adafactor on this machine"
        )
    if optim in CUDA_OPTIMIZERS and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"--optim {optim} needs the bitsandbytes package: pip install bitsandbytes")


def weight_decay_groups(params: Iterable[torch.nn.Parameter], weight_decay: float | None) -> list[dict]:
    """The trainable `params` in two groups: matrices decayed, 1-d tensors not (decaying a bias or a norm's
    scale only pulls it off its useful value); each split by kind where it mixes plain tensors and DTensors.
    `weight_decay` None leaves the matrices' rate to the optimizer."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in params:
        if param.requires_grad:
            # ZeRO-3 partitions parameters to shape [0] while loading; `ds_shape` keeps the real one
            (no_decay if len(getattr(param, "ds_shape", param.shape)) < 2 else decay).append(param)
    rate = {} if weight_decay is None else {"weight_decay": weight_decay}
    return [{"params": group, **rate} for group in _by_kind(decay)] + [
        {"params": group, "weight_decay": 0.0} for group in _by_kind(no_decay)
    ]


def _by_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """`params` as one group, or as two where tensor parallelism left some plain and made others DTensors (a
    model's biases are split, its norms' scales not): AdamW's fused and foreach kernels refuse a group that mixes
    them (Qwen2 under TP stopped at its first step; found in audit)."""
    if not torch.distributed.is_available():
        return [params]
    from torch.distributed.tensor import DTensor

    split = [isinstance(p, DTensor) for p in params]
    sharded = [p for p, is_split in zip(params, split, strict=True) if is_split]
    plain = [p for p, is_split in zip(params, split, strict=True) if not is_split]
    return [plain, sharded] if plain and sharded else [params]


def build_optimizer(model: torch.nn.Module, cfg: Config) -> Any:
    """The --optim optimizer over the weight-decay groups, or DeepSpeed's placeholder when the user's
    DeepSpeed JSON has its own optimizer section."""
    from cloudtrain.parallel.distributed import deepspeed_sections

    t = cfg.training
    if "optimizer" in deepspeed_sections(cfg):
        # the file's weight_decay applies to the matrices; "auto" lr and weight_decay are filled from ours
        # accelerate.utils exports DummyOptim only where deepspeed is installed; this branch needs it anyway
        from accelerate.utils.deepspeed import DummyOptim

        groups = weight_decay_groups(model.parameters(), None)
        return DummyOptim(groups, lr=t.learning_rate, weight_decay=t.weight_decay)
    groups = weight_decay_groups(model.parameters(), t.weight_decay)
    if t.optim == "adamw":
        return torch.optim.AdamW(groups, lr=t.learning_rate, **adamw_kernel(t.adamw_implementation))
    if t.optim == "adafactor":
        # a fixed learning rate (no relative step, no parameter scaling), so the schedule is the one asked for
        return Adafactor(groups, lr=t.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)
    if t.optim == "muon":
        return MuonWithAdamW(model, t.learning_rate, t.weight_decay)
    import bitsandbytes  # checked by check_optimizer: CUDA and the package

    return getattr(bitsandbytes.optim, BITSANDBYTES_CLASSES[t.optim])(groups, lr=t.learning_rate)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the hidden layers' matrices, AdamW for the rest (embeddings, output heads, 1-d
    tensors: Muon orthogonalises 2-d updates, which suits neither), as one optimizer: one list of groups
    for the schedule and one state dict for checkpoints. Muon's step is scaled to AdamW's update size
    (`match_rms_adamw`), so one --learning_rate serves both."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float):
        hidden = hidden_matrices(model)
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in {id(h) for h in hidden}]
        self.muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(weight_decay_groups(rest, weight_decay), lr=lr, fused=True)
        # the inner optimizers' own group dicts: a schedule that sets "lr" here sets it for them
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {"lr": lr})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (their parameters are disjoint)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts and the state: link them again
        self._link()


def hidden_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of the Linear layers inside the model's body (`base_model` of a transformers model), less
    any weight an embedding shares (tied output heads) and the output heads themselves (an untied LM head, which
    a T5 keeps inside its `base_model`; a classifier head PEFT trains in full): what Muon is meant for."""
    body = getattr(model, "base_model", model)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    heads = {id(p) for m in _output_heads(model) for p in m.parameters()}
    linears = [m for m in body.modules() if isinstance(m, torch.nn.Linear)]
    return [m.weight for m in linears if m.weight.requires_grad and id(m.weight) not in embeddings | heads]


def _output_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that map the body's states to outputs: the LM head, and the heads PEFT trains in full
    (`modules_to_save`: a classifier's). A pipeline trainer's model is its stages: the last one's head."""
    heads = []
    for part in model if isinstance(model, torch.nn.ModuleList) else [model]:
        get_head: Any = getattr(part, "get_output_embeddings", None)  # transformers' models (and PEFT's around them)
        if get_head is not None and (head := get_head()) is not None:
            heads.append(head)
    heads += [m for name, m in model.named_modules() if name.endswith("modules_to_save")]
    return heads


def warmup_steps(cfg: Config, total_steps: int) -> int:
    """--warmup_steps when given (it wins, as in transformers), else --warmup_ratio of the steps."""
    t = cfg.training
    return t.warmup_steps if t.warmup_steps is not None else round(t.warmup_ratio * total_steps)


def schedule_name(cfg: Config) -> str:
    """The schedule a run's learning rate follows, as its options give it ("cosine, 100 warmup steps"; a warmup
    ratio as a ratio, so that a resume with another --max_steps, which has its own note, is no other schedule)."""
    from cloudtrain.parallel.distributed import deepspeed_sections

    t = cfg.training
    if "scheduler" in deepspeed_sections(cfg):
        return "its DeepSpeed JSON's"
    if t.lr_scheduler_type == "constant":  # (no warmup)
        return "constant"
    warmup = f"{t.warmup_steps} warmup steps" if t.warmup_steps is not None else f"warmup ratio {t.warmup_ratio:g}"
    # each schedule's own options shape its curve too (a resume with another --min_lr_ratio changed it unsaid)
    own = {
        "cosine_with_min_lr": f", to {t.min_lr_ratio:g} x peak",
        "warmup_stable_decay": f", decay ratio {t.decay_ratio:g} to {t.min_lr_ratio:g} x peak",
        "polynomial": f", power {t.polynomial_power:g} to {t.min_lr_ratio:g} x peak",
    }
    return f"{t.lr_scheduler_type}, {warmup}{own.get(t.lr_scheduler_type, '')}"


def other_schedule(saved: str | None, now: str) -> bool:
    """Whether a checkpoint's schedule (`saved`, None where it recorded none) is another than this run's; one
    written before names carried a schedule's own options is taken as the same where the rest agrees."""
    return saved is not None and saved != now and not now.startswith(f"{saved}, ")


def build_scheduler(optimizer: Any, cfg: Config, total_steps: int) -> Any:
    """--lr_scheduler_type over `total_steps` optimizer steps (transformers' schedules); the engine's own
    schedule, observed, when the user's DeepSpeed JSON has a scheduler section."""
    from cloudtrain.parallel.distributed import deepspeed_sections

    if "scheduler" in deepspeed_sections(cfg):
        return EngineSchedule(optimizer)
    t, warmup = cfg.training, warmup_steps(cfg, total_steps)
    decay = round(t.decay_ratio * total_steps)
    if t.warmup_steps is None:  # ratios the config checked sum to at most 1; their rounding may not
        decay = min(decay, total_steps - warmup)
    elif t.lr_scheduler_type == "warmup_stable_decay" and warmup + decay > total_steps:
        raise UserError(
            f"--warmup_steps {warmup} and --decay_ratio {t.decay_ratio} ({decay} steps) exceed the run's "
            f"{total_steps} steps: warmup_stable_decay has no steps left to run them; give fewer warmup steps"
        )
    own_arguments: dict[str, dict] = {
        "cosine_with_min_lr": {"min_lr_rate": t.min_lr_ratio},
        "warmup_stable_decay": {"num_decay_steps": decay, "min_lr_ratio": t.min_lr_ratio},
        "polynomial": {"lr_end": t.min_lr_ratio * t.learning_rate, "power": t.polynomial_power},
        # the decay's timescale is the warmup (transformers' 10,000 steps when there is none)
        "inverse_sqrt": {"timescale": warmup or 10_000},
    }
    return get_scheduler(
        t.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=own_arguments.get(t.lr_scheduler_type, {}),
    )


def settings(optimizer: Any, scheduler: Any) -> dict:
    """The learning rates the schedule scales and each group's weight decay: what loading a checkpoint's optimizer
    and schedule states brings back as they were trained."""
    schedule = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps it
    return {
        "lr": list(getattr(schedule, "base_lrs", [])),  # none for a DeepSpeed JSON's own schedule
        "weight_decay": [group.get("weight_decay") for group in optimizer.param_groups],
    }


def keep_settings(optimizer: Any, scheduler: Any, ours: dict) -> list[str]:
    """This run's `settings` over those a checkpoint's states brought back: a changed --learning_rate scales the
    schedule (its shape kept), a changed --weight_decay applies from the next step. The options that differed, as
    they were and are."""
    theirs, changed = settings(optimizer, scheduler), []
    groups = optimizer.param_groups
    if ours["lr"] and theirs["lr"] != ours["lr"] and len(theirs["lr"]) == len(ours["lr"]) == len(groups):
        for group, old, new in zip(groups, theirs["lr"], ours["lr"], strict=True):
            group["lr"] = group["lr"] * new / old if old else new  # lr = base x the schedule's factor
            group["initial_lr"] = new
        schedule = getattr(scheduler, "scheduler", scheduler)
        schedule.base_lrs = list(ours["lr"])
        schedule._last_lr = [group["lr"] for group in groups]
        changed.append(f"--learning_rate {max(theirs['lr']):g} (this run's {max(ours['lr']):g})")
    if theirs["weight_decay"] != ours["weight_decay"] and len(ours["weight_decay"]) == len(groups):
        for group, decay in zip(groups, ours["weight_decay"], strict=True):
            group["weight_decay"] = decay
        changed.append(f"--weight_decay {max(theirs['weight_decay'])} (this run's {max(ours['weight_decay'])})")
    return changed


def follow_schedule(scheduler: Any) -> None:
    """The optimizer's rates set from this run's schedule at the step a checkpoint brought back: the rates loaded
    were the checkpoint's schedule's, so a run extended past its planned steps (or given another schedule) took
    its first step at the old schedule's rate, 0 at a linear decay's end (found in review). The same values where
    the schedule is the checkpoint's own. A DeepSpeed engine's schedule keeps its own."""
    schedule = getattr(scheduler, "scheduler", scheduler)
    if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        return
    groups = schedule.optimizer.param_groups
    for group, base, factor in zip(groups, schedule.base_lrs, schedule.lr_lambdas, strict=True):
        group["lr"] = base * factor(schedule.last_epoch)
    schedule._last_lr = [group["lr"] for group in groups]


class EngineSchedule:
    """The schedule a DeepSpeed engine built from the user's JSON and steps itself, at each optimizer step:
    the loop's step() is a no-op, the learning rate is read from the optimizer, and the state travels in the
    engine's own checkpoint."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
