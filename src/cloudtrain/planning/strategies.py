"""What the planner plans: the strategies, a pipeline's layout, a candidate (a strategy with or without
gradient checkpointing, adapters or a pipeline), the GPUs it is planned for, and the mesh each arranges."""

from dataclasses import dataclass

from cloudtrain.parallel.mesh import Mesh

CHECKPOINTING_COST = 1.33
# rules of thumb, relative to full fine-tuning: no weight gradients of the base (about a third less compute), DoRA's
# weight norm every step, and QLoRA's dequantisation of every 4-bit weight in both passes
PEFT_SPEED = {"none": 1.0, "lora": 0.75, "dora": 0.95, "qlora": 1.0}
PEFT_LABELS = {"none": "full fine-tuning", "lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA"}
SCHEDULE_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
INTERLEAVED_STAGES = 2  # stages per process of the interleaved rows: the fewest it takes, the fewest in flight


@dataclass(frozen=True)
class Strategy:
    key: str
    label: str
    speed: float  # relative step time without checkpointing (rule of thumb)
    zero_stage: int | None = None  # None: not DeepSpeed
    fsdp: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False
    nvme: bool = False  # the offloaded states in swap files on a local NVMe disk (ZeRO-Infinity), not CPU memory
    trainer: str = "accelerated"  # the --training_type (registry name) that runs it

    @property
    def shards(self) -> bool:
        """Whether the data-parallel processes shard the model's states (ZeRO, FSDP) instead of replicating them."""
        return self.zero_stage is not None or self.fsdp


STRATEGIES = (
    Strategy("ddp", "DDP", 1.00),
    Strategy("zero1", "ZeRO-1", 1.02, zero_stage=1),
    Strategy("zero2", "ZeRO-2", 1.05, zero_stage=2),
    Strategy("fsdp", "FSDP full shard", 1.12, fsdp=True),
    Strategy("zero3", "ZeRO-3", 1.15, zero_stage=3),
    Strategy("zero2_offload", "ZeRO-2 + optimizer offload", 1.6, zero_stage=2, offload_optimizer=True),
    Strategy("zero3_offload", "ZeRO-3 + optimizer offload", 1.8, zero_stage=3, offload_optimizer=True),
    Strategy(
        "zero3_offload_all",
        "ZeRO-3 + optimizer & parameter offload",
        2.5,
        zero_stage=3,
        offload_optimizer=True,
        offload_param=True,
    ),
    Strategy(
        "zero3_nvme",
        "ZeRO-3 + NVMe offload (ZeRO-Infinity)",
        3.5,
        zero_stage=3,
        offload_optimizer=True,
        offload_param=True,
        nvme=True,
    ),
)
PIPELINE = Strategy("pipeline", "pipeline", 1.00, trainer="pipeline")  # its bubble is the Pipeline's


@dataclass(frozen=True)
class Pipeline:
    """pp processes per pipeline running `schedule` over M micro-batches per schedule step."""

    parallel_size: int
    schedule: str  # gpipe, 1f1b, interleaved_1f1b
    microbatches: int
    rows: int  # examples each pipeline takes per optimizer step

    @property
    def stages_per_rank(self) -> int:
        return INTERLEAVED_STAGES if self.schedule == "interleaved_1f1b" else 1

    @property
    def stages(self) -> int:
        return self.parallel_size * self.stages_per_rank

    @property
    def bubble(self) -> float:
        """Idle time over compute time (Narayanan et al. 2021, sec. 2.2): (pp - 1) / (v*M)."""
        return (self.parallel_size - 1) / (self.stages_per_rank * self.microbatches)

    def stage_ids(self, rank: int) -> range:
        return range(rank, self.stages, self.parallel_size)  # PyTorch's "loop" placement, as the trainer's

    def in_flight(self, rank: int) -> int:
        """Micro-batches (interleaved: stage micro-batches) whose activations process `rank` holds at its peak:
        the warm-up forwards of PyTorch's schedules, plus the forward before the first backward (interleaved)."""
        M, pp, v = self.microbatches, self.parallel_size, self.stages_per_rank
        if self.schedule == "gpipe":
            return M
        if self.schedule == "1f1b":
            return min(M, self.stages - rank)
        return min(v * M, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)


@dataclass(frozen=True)
class Setup:
    num_gpus: int  # per node
    num_nodes: int
    gpu_memory_bytes: int
    cpu_memory_bytes: int | None  # per node; None: not checked
    max_length: int
    mixed_precision: str
    nvme_memory_bytes: int | None = None  # per node, for ZeRO-Infinity's swap files; None: no NVMe disk given

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def half(self) -> bool:
        return self.mixed_precision != "no"


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    checkpointing: bool
    peft: str = "none"  # none: full fine-tuning; lora, dora, qlora: adapters on a frozen base
    pipeline: Pipeline | None = None  # with the PIPELINE strategy

    @property
    def speed(self) -> float:
        bubble = 1.0 + (self.pipeline.bubble if self.pipeline else 0.0)
        recompute = CHECKPOINTING_COST if self.checkpointing else 1.0
        return self.strategy.speed * PEFT_SPEED[self.peft] * recompute * bubble

    @property
    def name(self) -> str:
        adapters = "" if self.peft == "none" else PEFT_LABELS[self.peft] + " + "
        return adapters + self._strategy_label() + (" + checkpointing" if self.checkpointing else "")

    def _strategy_label(self) -> str:
        pipe = self.pipeline
        if pipe is None:
            return self.strategy.label
        v = f" v={pipe.stages_per_rank}" if pipe.stages_per_rank > 1 else ""
        return f"pipeline {SCHEDULE_LABELS[pipe.schedule]} pp={pipe.parallel_size}{v} M={pipe.microbatches}"

    def mesh(self, setup: Setup) -> Mesh:
        """How this candidate arranges the set-up's GPUs, as its trainer's `mesh` would: pipelines of pp processes
        side by side, or every process data-parallel, holding the model whole (DDP, adapters) or a shard of it."""
        world = setup.world_size
        if self.pipeline:
            pp = self.pipeline.parallel_size
            return Mesh(world=world, dp_replicate=world // pp, pp=pp)
        if self.strategy.shards:
            return Mesh(world=world, dp_shard=world)
        return Mesh(world=world, dp_replicate=world)


def candidates(adapters: tuple[str, ...] = (), pipelines: list[Candidate] | None = None) -> list[Candidate]:
    """Every full fine-tuning strategy with and without gradient checkpointing, fastest first; then the
    `pipelines` (cloudtrain.planning.search.pipeline_candidates); then each of `adapters` (lora, dora, qlora) under
    DDP, without and with checkpointing."""
    full = sorted((Candidate(s, gc) for s in STRATEGIES for gc in (False, True)), key=lambda c: c.speed)
    adapter_rows = [Candidate(STRATEGIES[0], gc, peft) for peft in adapters for gc in (False, True)]
    return full + (pipelines or []) + adapter_rows
