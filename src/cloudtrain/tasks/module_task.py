"""The user's own `nn.Module`, trained through `cloudtrain.train(model=my_module, ...)`.

`ModuleTask` is a Task that is not registered by name: the Python API builds it around the module and hands
the object to the pipeline (`run_training(cfg, task=...)`), so `--task` and the registries never see it. Its
model is the module; its data are the user's datasets of tensor dicts (`train_dataset=`, `eval_dataset=`: any
map-style dataset with a length, a list of dicts included) collated by stacking; its loss is what the
module's forward returns for a batch (`model(**batch)`): a tensor, a dict with "loss", or an object with
`.loss`, taken as the mean over the batch's rows. docs/extending.md (Your own module) has the whole contract.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from datasets import DatasetDict
from torch.utils.data import Dataset, Subset, default_collate
from transformers import PreTrainedModel

from cloudtrain.config import Config
from cloudtrain.config.inert import OWN_MODULE
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.evaluation import eval_mode
from cloudtrain.tasks.base import Task

MODULE_FILE = "module.json"  # beside model.safetensors: the class whose state_dict it holds
MASK = "attention_mask"  # the trainers' logging counts rows by it; added when the user's rows have none


def forward_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The loss the module's forward returns: a tensor, a dict with "loss", or an object with `.loss`."""
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, dict) else None
    if loss is None:
        loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserError(
            f"the model's forward returned {type(out).__name__}; it must return the batch's loss: a scalar tensor, "
            "a dict with 'loss', or an object with .loss"
        )
    return loss.reshape(())


def rows_of(batch: dict) -> int:
    return len(next(iter(batch.values())))


def collate_with_mask(rows: list[dict]) -> dict:
    """Rows stacked by torch's default_collate, with a one-column mask when they have none (the trainers'
    logging counts rows and tokens by it; the module never sees it)."""
    batch = default_collate(rows)
    if MASK not in batch:
        batch[MASK] = torch.ones(rows_of(batch), 1, dtype=torch.long)
    return batch


def save_module(model: torch.nn.Module, folder: Path, state_dict: dict | None = None) -> None:
    """A plain module's final save: its state_dict as model.safetensors, and module.json naming its class."""
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict() if state_dict is None else state_dict
    # copies: tied weights share storage, which safetensors refuses to write twice
    safetensors.torch.save_file(
        {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}, folder / "model.safetensors"
    )
    cls = type(model)
    info = {"class": f"{cls.__module__}:{cls.__qualname__}", "parameters": sum(p.numel() for p in model.parameters())}
    (folder / MODULE_FILE).write_text(json.dumps(info, indent=2) + "\n")


def is_plain_module(model: torch.nn.Module) -> bool:
    """Neither a transformers model nor a PEFT adapter around one, nor a model that saves itself (save_pretrained,
    as a task's own model does: text_to_image's pipeline): saved by `save_module`."""
    from cloudtrain.models import adapters

    saves_itself = callable(getattr(model, "save_pretrained", None))
    return not isinstance(model, PreTrainedModel) and not adapters.is_adapter(model) and not saves_itself


class ModuleTask(Task):
    """A user's module and datasets; never registered by name (the API builds it)."""

    name = OWN_MODULE  # what run logs and the model card would call it; no --task takes it
    summary = "the user's own nn.Module, its forward returning the loss"
    plans_micro_batch = False  # the planner knows Hugging Face models only

    def __init__(
        self,
        model: torch.nn.Module | None,
        train_dataset: Dataset | list | None,
        eval_dataset: Dataset | list | None = None,
        cfg: Config | None = None,
    ):
        super().__init__(cfg)
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"model= takes a torch.nn.Module (got {type(model).__name__})")
        if train_dataset is None:
            raise UserError("model= needs train_dataset= (rows: dicts of tensors the module's forward takes)")
        self.module, self.train_dataset, self.eval_dataset = model, train_dataset, eval_dataset

    # ------------------------------------------------------------ options
    def check_options(self, cfg: Config) -> None:
        h, t, m = cfg.hub, cfg.training, cfg.model
        refusals = [
            (h.push_to_hub, "--push_to_hub: a plain module has no Hub format (config, card); push its folder yourself"),
            (t.per_device_train_batch_size == "auto", "--per_device_train_batch_size auto probes transformers "
             "models only; give a number for your own module"),
            (m.gradient_checkpointing and not isinstance(self.module, PreTrainedModel),
             "--gradient_checkpointing needs a transformers model; use torch.utils.checkpoint in your module"),
            (m.attn_implementation and not isinstance(self.module, PreTrainedModel),
             "--attn_implementation needs a transformers model"),
            (m.model_config or m.model_name_or_path, "model= is the model: leave out --model_name_or_path and "
             "--model_config"),
        ]  # fmt: skip
        refuse_first(refusals)

    def resolve_options(self, cfg: Config) -> Config:
        """The default output folder is named after the module's class (there is no checkpoint name)."""
        from dataclasses import replace

        if cfg.output.output_dir:
            return cfg
        return replace(cfg, output=replace(cfg.output, output_dir=f"outputs/{type(self.module).__name__}"))

    def check_adapters(self, cfg: Config) -> None:
        """--peft lora/dora on a transformers module; refused on a plain one (PEFT needs a transformers model)."""
        if cfg.model.peft == "none":
            return
        if not isinstance(self.module, PreTrainedModel):
            raise UserError(
                f"--peft {cfg.model.peft} needs a transformers PreTrainedModel; model= is a plain "
                f"{type(self.module).__name__}: train it in full"
            )
        if cfg.model.peft == "qlora":
            raise UserError("--peft qlora loads its base in 4-bit from a checkpoint; use lora or dora with model=")

    def check_data(self, cfg: Config) -> None:
        sources = ("train_file", "dataset_name", "validation_file", "test_file", "dataset_config")
        given = [f"--{name}" for name in sources if getattr(cfg.data, name)]
        if given:  # (the other files were ignored without a word: found in audit)
            raise UserError(f"model= takes its data as train_dataset= / eval_dataset=; leave out {', '.join(given)}")
        if cfg.model.tokenizer_name_or_path:
            raise UserError("model= takes tensors, which no tokenizer reads: leave out --tokenizer_name_or_path")

    # ------------------------------------------------------------ data and model
    def connect(self, cfg: Config) -> DatasetDict:
        return DatasetDict()  # the datasets came with the module

    def load_tokenizer(self, cfg: Config) -> Any:
        return None  # rows are tensors already

    def save_tokenizer(self, tokenizer: Any, folder: Path) -> None:
        """No tokenizer to save."""

    def process(self, raw: DatasetDict, tokenizer: Any, cfg: Config) -> ProcessedData:
        """The user's splits; without eval_dataset, --validation_split_percentage of the rows, drawn by --seed."""
        train, validation = self.train_dataset, self.eval_dataset
        if len(train) == 0:  # type: ignore[arg-type]
            raise UserError("train_dataset= is empty")
        check_row(train[0], "train_dataset", self.module)
        if validation is None:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.training.seed))  # type: ignore[arg-type]
            n = max(1, int(len(order) * cfg.data.validation_split_percentage // 100))  # the option is a float
            train, validation = Subset(train, order[n:].tolist()), Subset(train, order[:n].tolist())  # type: ignore[arg-type]
        elif len(validation) == 0:  # type: ignore[arg-type]
            raise UserError("eval_dataset= is empty")
        check_row(validation[0], "eval_dataset", self.module)
        self.strip_mask = MASK not in train[0]
        return ProcessedData(train=train, validation=validation, test=None, collator=collate_with_mask)

    def load_model(self, cfg: Config, data: ProcessedData, tokenizer: Any, announce: bool) -> torch.nn.Module:
        return self.module

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        return []

    # ------------------------------------------------------------ loss and evaluation
    def _inputs(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k != MASK} if getattr(self, "strip_mask", True) else batch

    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), rows_of(batch), device=next(iter(batch.values())).device)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's mean loss times the rows: a sum the trainer divides by the step's global row count."""
        n = self.loss_count(batch)
        return forward_loss(model, self._inputs(batch)) * n, n

    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        """The mean loss over the split's rows, each counted once over processes. The module gives a batch's mean
        only, and `gather` drops the rows the loader filled a process's last batch up with (from the split's start)
        after the mean counted them (found in audit): there, where the gathered rows are fewer than the processes'
        batches hold, each row of the batch is a forward of its own, gathered again."""
        processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        with eval_mode(model):
            loss_sum, rows = 0.0, 0
            with torch.no_grad():
                for batch in batches:
                    batch = move(batch)
                    with autocast():
                        loss = forward_loss(model, self._inputs(batch)).float()
                    per_row = gather(loss.expand(rows_of(batch)).contiguous())  # drops the last batch's duplicates
                    if len(per_row) < rows_of(batch) * processes:  # (every process alike: gather's count is shared)
                        with autocast():
                            losses = [forward_loss(model, self._inputs(row)).float() for row in _rows(batch)]
                        per_row = gather(torch.stack(losses))
                    loss_sum += per_row.double().sum().item()
                    rows += len(per_row)
        return {"loss": loss_sum / max(rows, 1), "examples": rows}

    def describe_data(self, data: ProcessedData) -> str:
        return f"data: {len(data.train)} train / {len(data.validation)} validation rows (your datasets)"

    def describe_metrics(self, metrics: dict) -> str:
        return f"loss {metrics['loss']:.4f} ({metrics['examples']} examples)"

    def inference_hint(self, output_dir: str) -> str:
        return (
            f"model.load_state_dict(safetensors.torch.load_file('{output_dir}/model.safetensors')) on a new "
            f"{type(self.module).__name__} (module.json names the class; generate and push are for transformers "
            "models)"
        )


def _rows(batch: dict) -> list[dict]:
    """The batch's rows, each a batch of one."""
    return [{k: v[i : i + 1] for k, v in batch.items()} for i in range(rows_of(batch))]


def check_row(row: Any, name: str, module: torch.nn.Module) -> None:
    if not isinstance(row, dict) or not row or not all(isinstance(v, torch.Tensor) for v in row.values()):
        raise UserError(f"{name}= rows must be dicts of tensors (the module's forward keyword arguments)")
    if type(module).__call__ is not torch.nn.Module.__call__ or type(module).forward is torch.nn.Module.forward:
        return  # called otherwise than through its forward: the call's own error says it
    parameters = inspect.signature(module.forward).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = [key for key in row if key not in parameters]  # (a mask the rows hold reaches the forward too)
    if unknown:  # a TypeError from inside the first step otherwise (found in audit)
        raise UserError(
            f"{name}= rows hold {', '.join(map(repr, unknown))}, which {type(module).__name__}.forward takes no "
            f"argument of (it takes {', '.join(parameters)}); name the rows' keys as its arguments"
        )
