"""PipelineTrainer: a decoder cut into stages over processes, run by torch.distributed.pipelining.

The same loop as the other trainers; what differs is only here:
- the model: each process holds its stages (cloudtrain.parallel.stages) and frees the rest; a schedule (GPipe,
  1F1B or interleaved 1F1B) runs forward and backward of a batch's micro-batches over the stages,
  sending activations and their gradients between neighbouring processes;
- the data: every process of a pipeline reads the same rows (stage 0 needs the tokens, the last stage
  the labels, every stage the positions); batches are padded to a fixed shape (--max_length, the
  micro-batch's rows), as the schedule fixes the shapes it sends at its first step;
- the loss: the task's, computed on the last stage from the logits, each micro-batch's sum divided by
  the step's global target-token count (summed over the accumulation window and the data-parallel
  pipelines), so the update equals one process training on the whole batch;
- the gradients: summed across the data-parallel pipelines and, for tied embeddings, between the first
  and last process of a pipeline (the last stage keeps its own copy of the matrix); clipped by the norm
  over every stage;
- checkpoints: one file of weights and one of optimizer, schedule and RNG per process, in the usual
  atomic checkpoint folder; the final model is gathered on the main process into one ordinary
  Hugging Face checkpoint;
- evaluation: loss and perplexity through the schedule's evaluation path.

Supports: --task causal_lm and sft; the decoders cloudtrain.parallel.stages knows (Llama family, GPT-2);
--pipeline_parallel_size processes per pipeline, the rest as data-parallel pipelines on a (dp, pp)
mesh; gloo (CPU) and NCCL (CUDA); fp32 and bf16; gradient checkpointing; gradient accumulation.
Does not support: classification; adapters (--peft); DeepSpeed or FSDP; fp16; --torch_compile;
--per_device_train_batch_size auto; sample generations during evaluation (`generate` the saved model).
"""

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.compute as pc
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from transformers import PreTrainedModel

from cloudtrain import invocation
from cloudtrain.config import Config, DistributedConfig
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.hardware import autocast
from cloudtrain.observe.flops import ModelFlops
from cloudtrain.observe.tracking import RunLog
from cloudtrain.parallel import stages as stage_split
from cloudtrain.parallel.distributed import deepspeed_requested, fsdp_requested, launched_processes
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.parallel.runtime import PipelineRuntime, Runtime
from cloudtrain.registry import TRAINERS
from cloudtrain.tasks.base import DecoderTask, Task
from cloudtrain.training.basic import rng_state, set_rng_state
from cloudtrain.training.meter import StepStats
from cloudtrain.training.trainer import Trainer
from cloudtrain.training.weights import count_parameters

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
LAYOUT = "pipeline.json"  # how the checkpoint's stages were cut; a resume must cut the same way


def stage_ranges(cfg: Config, config) -> list[range]:
    """The layers of every stage: at --pipeline_split_points, else balanced (cloudtrain.parallel.stages)."""
    d = cfg.distributed
    n_stages, n_layers = d.pipeline_parallel_size * d.pipeline_stages_per_rank, config.num_hidden_layers
    if d.pipeline_split_points:
        return stage_split.split_after([int(p.rpartition(".")[2]) for p in d.pipeline_split_points], n_layers)
    return stage_split.balanced_split(n_layers, n_stages)


def longest_row(data: ProcessedData, max_length: int) -> int:
    """The longest row of every split (the same on every process), at most --max_length: the padded width."""
    splits = [ds for ds in (data.train, data.validation, data.test) if ds is not None]
    lengths = [pc.max(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 1 for ds in splits]
    return min(max(lengths), max_length)


def schedule_problem(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why PyTorch's `schedule` cannot run this layout (one line), or None; the planner asks too."""
    n_stages = pp * stages_per_rank
    problems = [
        (
            schedule == "interleaved_1f1b" and stages_per_rank < 2,
            "--pipeline_schedule interleaved_1f1b needs --pipeline_stages_per_rank 2 or more",
        ),
        (
            schedule != "interleaved_1f1b" and stages_per_rank > 1,
            f"--pipeline_stages_per_rank {stages_per_rank} needs --pipeline_schedule interleaved_1f1b",
        ),
        (
            schedule == "1f1b" and microbatches < n_stages,
            f"--pipeline_schedule 1f1b needs at least as many --pipeline_microbatches as stages ({n_stages})",
        ),
        (
            schedule == "interleaved_1f1b" and microbatches % pp != 0,
            f"--pipeline_schedule interleaved_1f1b needs --pipeline_microbatches a multiple of {pp}",
        ),
    ]
    return next((message for failed, message in problems if failed), None)


@TRAINERS.register
class PipelineTrainer(Trainer):
    name = "pipeline"
    summary = "decoder layers split into stages across processes (torch.distributed.pipelining), under torchrun"
    step_collectives = "the stages' sends and receives, the gradient all-reduce"

    # a stage's forward passes run inside the schedule, between waits for the stages around it
    times_own_work = False
    own_options = tuple(f.name for f in dataclasses.fields(DistributedConfig) if f.name.startswith("pipeline_"))
    schedule_problem = staticmethod(schedule_problem)  # the planner asks it which pipelines can run

    @classmethod
    def mesh(cls, cfg: Config, processes: int) -> Mesh:
        """Pipelines of --pipeline_parallel_size processes, replicated data-parallel (a launch that does not fit
        is refused in check_options)."""
        pp = cfg.distributed.pipeline_parallel_size
        return Mesh(world=processes, dp_replicate=max(1, processes // pp), pp=pp)

    @classmethod
    def launch(cls, cfg: Config) -> Runtime:
        return PipelineRuntime(cfg.distributed.pipeline_parallel_size, cfg.distributed.collective_timeout)

    @classmethod
    def check_options(cls, cfg: Config, task: Task) -> None:
        super().check_options(cfg, task)
        d, t = cfg.distributed, cfg.training
        pp, world = d.pipeline_parallel_size, launched_processes()
        schedule = schedule_problem(d.pipeline_schedule, pp, d.pipeline_stages_per_rank, d.pipeline_microbatches)
        if not isinstance(task, DecoderTask):
            raise UserError(
                f"--training_type pipeline trains decoders (--task causal_lm or sft), not --task {task.name}: "
                "use --training_type accelerated"
            )
        problems = [
            (pp < 2, f"--pipeline_parallel_size {pp}: a pipeline needs at least 2 processes"),
            (
                not cls.mesh(cfg, world).fits,
                f"--training_type pipeline with --pipeline_parallel_size {pp} needs a multiple of {pp} processes "
                f"(this launch has {world}): torchrun --nproc_per_node {pp} {' '.join(invocation.launch_target())} ...",
            ),
            (
                deepspeed_requested(cfg) or fsdp_requested(cfg),
                "DeepSpeed and FSDP shard data-parallel processes and do not combine with --training_type pipeline; "
                "use --training_type accelerated for ZeRO or FSDP",
            ),
            (
                t.mixed_precision == "fp16",
                "--training_type pipeline trains in bf16 or fp32: pass --mixed_precision bf16",
            ),
            (
                cfg.model.peft != "none",
                "--training_type pipeline does not train adapters; use --training_type accelerated",
            ),
            (t.torch_compile, "--torch_compile does not apply to pipeline stages; remove it"),
            (t.neftune_noise_alpha > 0, "--neftune_noise_alpha does not apply to pipeline stages; remove it"),
            (
                t.label_smoothing > 0,
                "--label_smoothing does not apply to pipeline stages (they train on the plain loss); use "
                "--training_type accelerated",
            ),
            (
                cfg.data.streaming,
                "--streaming true runs under --training_type basic and accelerated, not pipeline; use stored rows",
            ),
            (
                t.per_device_train_batch_size == "auto",
                "--per_device_train_batch_size auto probes one process's model, not a pipeline's stages: give a number",
            ),
            (schedule is not None, str(schedule)),
            (
                isinstance(t.per_device_train_batch_size, int)
                and t.per_device_train_batch_size % d.pipeline_microbatches != 0,
                f"--per_device_train_batch_size {t.per_device_train_batch_size} (rows per pipeline) does not split "
                f"into {d.pipeline_microbatches} --pipeline_microbatches; give a multiple of it",
            ),
            (
                cfg.checkpoint.metric_for_best_model == "exact_match",
                "--metric_for_best_model exact_match needs sample generations, which the pipeline does not make; "
                "use loss",
            ),
        ]
        if not hasattr(Schedule1F1B, "eval"):  # evaluation runs through it (torch 2.13 tested)
            problems.append((True, f"--training_type pipeline needs a newer torch than {torch.__version__}"))
        refuse_first(problems)
        cls._check_model(cfg, task.model_config(cfg))

    @staticmethod
    def _check_model(cfg: Config, config) -> None:
        """The model's layers can be cut into the pipeline's stages."""
        d = cfg.distributed
        n_stages = d.pipeline_parallel_size * d.pipeline_stages_per_rank
        if stage_split.family_of(config.model_type) is None:
            raise UserError(
                f"--training_type pipeline cannot cut a {config.model_type} model into stages (it knows "
                f"{', '.join(sorted(stage_split.FAMILIES))}); use --training_type accelerated with ZeRO-3 or FSDP"
            )
        if d.pipeline_split_points:
            prefix = stage_split.layer_prefix(config)
            problem = stage_split.split_points_error(
                d.pipeline_split_points, prefix, config.num_hidden_layers, n_stages
            )
            if problem:
                raise UserError(f"--pipeline_split_points: {problem}")
        elif n_stages > config.num_hidden_layers + 2:
            raise UserError(
                f"{n_stages} stages need at least {n_stages - 2} layers; the model has {config.num_hidden_layers}: "
                "lower --pipeline_parallel_size or --pipeline_stages_per_rank"
            )

    def __init__(
        self, cfg: Config, task: Task, model: PreTrainedModel, data: ProcessedData, run_log: RunLog, runtime: Runtime
    ):
        assert isinstance(runtime, PipelineRuntime)  # Runtime.for_launch builds it for this trainer
        self.rt, d = runtime, cfg.distributed
        self.whole = model  # its layers held elsewhere go to the meta device; saving uses its config and class
        self.ranges = stage_ranges(cfg, model.config)
        self.n_stages = len(self.ranges)
        stage_ids = [runtime.pp_rank + k * runtime.pp_size for k in range(d.pipeline_stages_per_rank)]  # "loop" order
        self.stages = stage_split.build_stages(model, self.ranges, stage_ids, cfg.training.mixed_precision)
        self.holds_first = any(s.first for s in self.stages)
        self.holds_last = any(s.last for s in self.stages)
        self.tied = stage_split.tied(model)
        self.parameters_total = (count_parameters(model), count_parameters(model, trainable=True))
        flops = ModelFlops.from_model(model)  # both before untie: a tied matrix counts once
        if self.tied and self.holds_last:
            stage_split.untie(next(s for s in self.stages if s.last))
        stage_split.release_others(model, self.stages)
        super().__init__(cfg, task, nn.ModuleList(self.stages), data, run_log, runtime)  # type: ignore[arg-type]  # its stages
        self.flops = flops  # the whole model's: tokens are counted once per pipeline
        assert isinstance(task, DecoderTask)  # check_options refuses others
        self.decoder = task
        self.counts_batches = self.holds_last  # one process per pipeline counts its rows and loss
        self.mode = (
            f"pipeline: {self.n_stages} stages over {runtime.pp_size} processes x {runtime.dp_size} data-parallel, "
            f"{d.pipeline_schedule}, {d.pipeline_microbatches} micro-batches"
        )
        self._scale: torch.Tensor | float = 1.0  # what the last stage multiplies each micro-batch's summed loss by
        self._head = self._head_in_loss()
        self.width = longest_row(data, cfg.data.max_length)

    # ------------------------------------------------------------ placement and data
    def setup(self) -> None:
        device = self.rt.device
        for stage in self.stages:
            stage.to(device)
        self.schedule = self._make_schedule()
        # torch 2.11's schedules infer the stages' shapes once, at the first step, and refuse evaluation's larger
        # micro-batches (PipeliningShapeError); 2.13's infer them again when switching between step and eval
        # (_initialize_pp_stages). Where they do not, evaluation runs through its own stages over the same modules.
        reinfers = hasattr(Schedule1F1B, "_initialize_pp_stages")
        self.eval_schedule = self.schedule if reinfers else self._make_schedule()
        if self.is_main_process:
            layout = ", ".join(
                f"{s}: layers {r.start}-{r.stop - 1}" if r else f"{s}: no layers" for s, r in enumerate(self.ranges)
            )
            print(f"pipeline stages ({layout}); the first holds the embeddings, the last the norm and head", flush=True)
            if self.data.prompts:
                print("note: no sample generations under the pipeline; `generate` the saved model", flush=True)

    def _make_schedule(self) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
        """The launch's schedule over fresh PipelineStage wrappers of this process's stage modules."""
        d, device = self.cfg.distributed, self.rt.device
        pipes = [PipelineStage(s, s.index, self.n_stages, device, group=self.rt.pp_group) for s in self.stages]
        return SCHEDULES[d.pipeline_schedule](
            pipes if d.pipeline_schedule == "interleaved_1f1b" else pipes[0],  # type: ignore[arg-type]
            n_microbatches=d.pipeline_microbatches,
            loss_fn=self._loss,
            scale_grads=False,  # the loss is already normalised by the step's global count
        )

    def autocast(self):
        return autocast(self.cfg.training.mixed_precision, self.rt.device)

    def loader_rows(self, per_process: int) -> int:
        return per_process * self.rt.dp_size  # every process reads its pipeline's batch and all others'; `move` cuts

    def move(self, batch: dict) -> dict:
        return self._shard(batch, self.cfg.training.micro_batch)

    def _shard(self, batch: dict, rows: int) -> dict:
        """This pipeline's `rows` rows of a batch of all pipelines, padded to `rows` x the longest row (the fixed
        shape the schedule sends): padding has no labels and, coming last in causal rows, is never attended."""
        width, total = self.width, rows * self.rt.dp_size
        fill = {"labels": IGNORE_INDEX}
        out = {}
        for key, value in batch.items():
            if key in ("cu_seqlens", "max_seqlen"):
                continue  # per-batch lengths: the stages mask from position_ids
            padded = value.new_full((total, width), fill.get(key, 0))
            padded[: value.shape[0], : value.shape[1]] = value
            out[key] = padded[self.rt.dp_rank * rows : (self.rt.dp_rank + 1) * rows].to(self.rt.device)
        return out

    def _head_in_loss(self) -> nn.Linear | None:
        """The last stage's LM head where --fused_cross_entropy gave the task a loss kernel (models.prepare): that
        stage then hands the loss its hidden states, and the loss applies the head in chunks."""
        last = next((s for s in self.stages if s.last), None)
        if last is None or self.decoder.loss_kernel is None or type(last.lm_head) is not nn.Linear:
            return None
        last.head_in_loss = True
        return last.lm_head

    # ------------------------------------------------------------ the step
    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on the last stage (from its logits, or its hidden states through the head): the
        task's summed loss times the step's scale."""
        if self._head is None:
            summed, _ = self.decoder.logits_loss(output, labels)
        else:
            with self.autocast():  # the head's matmuls in the stages' precision
                summed, _ = self.decoder.head_loss(output[:, :-1], self._head, labels[:, 1:].to(output.device))
        return summed * self._scale

    def _run(self, run, batch: dict) -> torch.Tensor:
        """One batch through the schedule (`step` or `eval`): tokens to stage 0, labels to the last stage.
        Returns the batch's summed loss on the last stage (zero elsewhere)."""
        inputs = (batch["input_ids"],) if self.holds_first else ()
        losses: list[torch.Tensor] = []
        target = {"target": batch["labels"], "losses": losses} if self.holds_last else {}
        run(*inputs, position_ids=batch["position_ids"], return_outputs=False, **target)  # no merged logits kept
        if not losses:
            return torch.zeros((), device=self.rt.device)
        return torch.stack(losses).detach().sum() / self._scale

    def _loss_scale(self, window: list[dict]) -> torch.Tensor:
        """1 / the step's target count over the window and every pipeline (each process has its labels)."""
        count = torch.stack([self.task.loss_count(batch) for batch in window]).sum().double()
        dist.all_reduce(count, group=self.rt.dp_group)
        return (1 / count.clamp(min=1)).float()

    def backward_window(self, window: list[dict], scale: torch.Tensor) -> StepStats:
        self._scale = scale
        loss_sum = torch.stack([self._run(self.schedule.step, batch) for batch in window]).sum()
        self._sync_gradients()
        grad_norm = self._clip() if self.cfg.training.max_grad_norm > 0 else None
        count = torch.stack([self.task.loss_count(batch) for batch in window]).sum() * self.holds_last
        return StepStats(loss_sum=loss_sum, count=count, grad_norm=grad_norm)

    def gradient_parameters(self) -> list[nn.Parameter]:
        return self._params()

    def _params(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters() if p.requires_grad]

    def _tied_copies(self) -> list[torch.Tensor]:
        """This process's halves of the tied embedding (stage 0's matrix, the last stage's copy)."""
        if not self.tied:
            return []
        return [s.body.get_submodule(s.family.embeddings[0]).weight for s in self.stages if s.first] + [
            s.lm_head.weight for s in self.stages if s.last
        ]

    def _sync_gradients(self) -> None:
        """Sum gradients over the data-parallel pipelines, then between the tied matrix's two copies."""
        params = self._params()
        for p in params:
            if p.grad is None:  # a stage whose parameter got no gradient still joins the sum
                p.grad = torch.zeros_like(p)
        if self.rt.dp_size > 1:
            grads = [p.grad for p in params if p.grad is not None]  # all of them, set above
            flat = torch._utils._flatten_dense_tensors(grads)  # one collective, not one per tensor
            dist.all_reduce(flat, group=self.rt.dp_group)
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)
        for weight in self._tied_copies():
            assert weight.grad is not None  # set in the loop above
            dist.all_reduce(weight.grad, group=self.rt.ends_group)

    def _clip(self) -> torch.Tensor:
        """Clip by the global norm over every stage (the tied matrix counted once), as one process would."""
        copy = {id(s.lm_head.weight) for s in self.stages if s.last and self.tied}
        grads = {id(p): p.grad for p in self._params() if p.grad is not None}  # all of them (_sync_gradients)
        squares = torch.stack([g.double().pow(2).sum() for key, g in grads.items() if key not in copy]).sum()
        dist.all_reduce(squares, group=self.rt.pp_group)
        norm = squares.sqrt().float()
        coefficient = (self.cfg.training.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(list(grads.values()), coefficient)
        return norm

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, split: str, stop: Callable[[], bool] | None = None) -> dict:
        """Token-weighted loss and perplexity through the schedule's evaluation path, on every process (a launch:
        `stop` is None, as every stage must run every batch)."""
        start = time.perf_counter()
        self.model.eval()
        self._scale = 1.0
        sums = torch.zeros(3, dtype=torch.float64, device=self.rt.device)  # loss, target tokens, rows
        m = self.cfg.distributed.pipeline_microbatches
        rows = math.ceil(self.cfg.training.per_device_eval_batch_size / m) * m
        for batch in self._batches(self.eval_dls[split], f"evaluation of {split}", stop):
            batch = self._shard(batch, rows)
            loss_sum = self._run(self.eval_schedule.eval, batch)
            if self.holds_last:
                real = batch["attention_mask"].any(dim=1).sum()
                sums += torch.stack([loss_sum, self.task.loss_count(batch), real]).double()
        self.model.train()
        loss_sum, tokens, n_rows = self.runtime.reduce_sum(sums).tolist()
        return self.decoder.loss_metrics(loss_sum, tokens, n_rows, time.perf_counter() - start)

    # ------------------------------------------------------------ saving and checkpoints
    def parameter_counts(self) -> tuple[int, int]:
        return self.parameters_total

    def _state(self) -> dict[str, torch.Tensor]:
        """This process's weights under the checkpoint's names."""
        return {name: t.detach() for stage in self.stages for name, t in stage.state_dict().items()}

    def save_model(self, output_dir: Path) -> None:
        """One ordinary sharded Hugging Face checkpoint: each process of the first pipeline writes its stages'
        shard, the main process the index and the config. Nothing is gathered: no process ever holds the whole
        model."""
        output_dir.mkdir(parents=True, exist_ok=True)
        shard = f"model-{self.rt.pp_rank + 1:05d}-of-{self.rt.pp_size:05d}.safetensors"
        names: dict[str, int] = {}  # name -> bytes, of this process's shard
        if self.rt.dp_rank == 0:
            state = {name: t.contiguous() for name, t in self._state().items()}
            if self.tied:  # the last stage's copy equals stage 0's matrix; the checkpoint ties them
                state.pop("lm_head.weight", None)
            safetensors.torch.save_file(state, str(output_dir / shard), metadata={"format": "pt"})
            names = {name: t.numel() * t.element_size() for name, t in state.items()}
            parts: list | None = [None] * self.rt.pp_size if self.is_main_process else None
            dist.gather_object((shard, names), parts, dst=0, group=self.rt.pp_group)
            if self.is_main_process:
                assert parts is not None
                self._write_index(output_dir, parts)
        self.rt.barrier()

    def _write_index(self, output_dir: Path, parts: list[tuple[str, dict[str, int]]]) -> None:
        weight_map = {name: shard for shard, names in parts for name in names}
        total = sum(size for _, names in parts for size in names.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (output_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = self.whole.config
        config.architectures = [type(self.whole).__name__]
        config.save_pretrained(output_dir)
        if self.whole.generation_config is not None:
            self.whole.generation_config.save_pretrained(output_dir)

    def _files(self, folder: Path) -> tuple[Path, Path]:
        rank = self.rt.index
        return folder / f"pipeline-rank{rank}.safetensors", folder / f"pipeline-rank{rank}.pt"

    def _layout(self) -> dict:
        return {
            "pipeline_parallel_size": self.rt.pp_size,
            "data_parallel_size": self.rt.dp_size,
            "stages": [[r.start, r.stop] for r in self.ranges],
        }

    def write_checkpoint(self, folder: Path) -> None:
        weights, training = self._files(folder)
        safetensors.torch.save_file({k: v.contiguous() for k, v in self._state().items()}, str(weights))
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": rng_state()},
            training,
        )
        if self.checkpoint_owner:
            (folder / LAYOUT).write_text(json.dumps(self._layout()))

    def load_checkpoint(self, folder: Path) -> None:
        written = json.loads((folder / LAYOUT).read_text()) if (folder / LAYOUT).is_file() else None
        if written != self._layout():
            raise UserError(
                f"checkpoint {folder} was cut into pipeline stages as {written}, this run as {self._layout()}: "
                "resume with the same --pipeline_parallel_size, --pipeline_stages_per_rank and split points"
            )
        weights, training = self._files(folder)
        tensors = safetensors.torch.load_file(str(weights), device=str(self.rt.device))
        for stage in self.stages:
            stage.load_state_dict({name: tensors.pop(name) for name in stage.state_dict()})
        if tensors:
            raise ValueError(f"{weights} holds {len(tensors)} weights no stage of this process has")
        saved = torch.load(training, map_location=self.rt.device, weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
