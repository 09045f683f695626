"""What the planner plans: the strategies, a pipeline's layout, a candidate (a strategy with or without
gradient checkpointing, adapters, a pipeline, a tensor- or context-parallel degree), the GPUs it is planned for,
and the mesh each arranges."""

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
    fsdp_sharding: str = "full_shard"  # --fsdp_sharding_strategy: full_shard, shard_grad_op, hybrid_shard, no_shard
    reshard_after_forward: bool = True  # --fsdp_reshard_after_forward (shard_grad_op: false)

    @property
    def shards(self) -> bool:
        """Whether the data-parallel processes shard the model's states (ZeRO, FSDP) instead of replicating them."""
        return self.zero_stage is not None or self.fsdp

    def shard_degree(self, setup: "Setup") -> int:
        """Processes one copy of the states is sharded over: all of them (ZeRO, FSDP full_shard and
        shard_grad_op), a node's (hybrid_shard: replicated across nodes), or 1 (DDP, no_shard)."""
        if not self.shards or self.fsdp_sharding == "no_shard":
            return 1
        return setup.num_gpus if self.fsdp_sharding == "hybrid_shard" else setup.world_size

    def fsdp_flags(self) -> list[str]:
        """The application's flags that select this FSDP2 variant (none for other strategies)."""
        if not self.fsdp:
            return []
        flags = ["--fsdp", "true"]
        if self.fsdp_sharding != "full_shard":
            flags += ["--fsdp_sharding_strategy", self.fsdp_sharding]
        if self.offload_param:
            flags += ["--fsdp_cpu_offload", "true"]
        if self.reshard_after_forward != (self.fsdp_sharding != "shard_grad_op"):  # not the strategy's default
            flags += ["--fsdp_reshard_after_forward", str(self.reshard_after_forward).lower()]
        return flags


STRATEGIES = (
    Strategy("ddp", "DDP", 1.00),
    Strategy("zero1", "ZeRO-1", 1.02, zero_stage=1),
    Strategy("zero2", "ZeRO-2", 1.05, zero_stage=2),
    Strategy("fsdp_no_shard", "FSDP no shard", 1.02, fsdp=True, fsdp_sharding="no_shard"),
    Strategy(
        "fsdp_grad_op",
        "FSDP shard grad-op",
        1.08,
        fsdp=True,
        fsdp_sharding="shard_grad_op",
        reshard_after_forward=False,
    ),
    Strategy("fsdp_hybrid", "FSDP hybrid shard", 1.09, fsdp=True, fsdp_sharding="hybrid_shard"),
    Strategy("fsdp", "FSDP full shard", 1.12, fsdp=True),
    Strategy("zero3", "ZeRO-3", 1.15, zero_stage=3),
    Strategy("zero2_offload", "ZeRO-2 + optimizer offload", 1.6, zero_stage=2, offload_optimizer=True),
    Strategy("zero3_offload", "ZeRO-3 + optimizer offload", 1.8, zero_stage=3, offload_optimizer=True),
    Strategy(
        "fsdp_offload",
        "FSDP full shard + CPU offload",
        2.2,
        fsdp=True,
        offload_optimizer=True,
        offload_param=True,
    ),
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
# tensor parallel groups replicated (transformers' FSDP2 of shard degree 1 averages their gradients), or sharded by
# FSDP2 over the data-parallel processes (--fsdp true: 2-D); context parallel with FSDP2 over every process
TENSOR_PARALLEL = Strategy("tp", "TP", 1.00)
TENSOR_FSDP = Strategy("tp_fsdp", "FSDP2", 1.12, fsdp=True)
CONTEXT_FSDP = Strategy("cp_fsdp", "FSDP2", 1.12, fsdp=True)
MODEL_PARALLEL = (TENSOR_PARALLEL, TENSOR_FSDP, CONTEXT_FSDP)


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
    step_rows: int | None = None  # examples per GPU per optimizer step; None: unknown (as if accumulating)
    dense_mask: bool = True  # a decoder's packed rows under sdpa get a dense [b, 1, s, s] mask (False: varlen, flash)
    fused_loss: str | bool | None = None  # a fused linear cross-entropy (liger, chunked): the logits never whole
    fused_loss_asked: bool = False  # --fused_cross_entropy true: the run refuses rows that shard the LM head
    fused_modules: bool = False  # Liger's fused RMSNorm, SwiGLU and RoPE (full fine-tuning, no TP or CP)
    liger_asked: bool = False  # --liger_kernels true: the run refuses tensor parallelism with it
    target_length: int | None = None  # an encoder-decoder's target tokens (--max_target_length); max_length: source

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
    tensor_parallel: int = 1  # with TENSOR_PARALLEL or TENSOR_FSDP: processes that split each layer
    context_parallel: int = 1  # with CONTEXT_FSDP: processes that split each sequence
    split_cost: float = 0.0  # the TP/CP collectives' time over the compute's (cloudtrain.planning.communication)

    @property
    def speed(self) -> float:
        bubble = 1.0 + (self.pipeline.bubble if self.pipeline else 0.0)
        recompute = CHECKPOINTING_COST if self.checkpointing else 1.0
        split = 1.0 + self.split_cost
        return self.strategy.speed * PEFT_SPEED[self.peft] * recompute * bubble * split

    @property
    def model_parallel(self) -> int:
        """Processes that compute on the same rows (a tensor- or context-parallel group; 1 otherwise)."""
        return self.tensor_parallel * self.context_parallel

    @property
    def name(self) -> str:
        adapters = "" if self.peft == "none" else PEFT_LABELS[self.peft] + " + "
        return adapters + self._strategy_label() + (" + checkpointing" if self.checkpointing else "")

    def _strategy_label(self) -> str:
        pipe = self.pipeline
        if self.tensor_parallel > 1:
            return f"TP={self.tensor_parallel}" + (" x FSDP2" if self.strategy.fsdp else "")
        if self.context_parallel > 1:
            return f"CP={self.context_parallel} x FSDP2"
        if pipe is None:
            return self.strategy.label
        v = f" v={pipe.stages_per_rank}" if pipe.stages_per_rank > 1 else ""
        return f"pipeline {SCHEDULE_LABELS[pipe.schedule]} pp={pipe.parallel_size}{v} M={pipe.microbatches}"

    def mesh(self, setup: Setup) -> Mesh:
        """How this candidate arranges the set-up's GPUs, as its trainer's `mesh` would: pipelines of pp processes
        side by side, or every process data-parallel, holding the model whole (DDP, adapters) or a shard of it."""
        world = setup.world_size
        if self.model_parallel > 1:
            dp = world // self.model_parallel
            data = {"dp_shard": dp} if self.strategy.fsdp else {"dp_replicate": dp}
            return Mesh(world=world, tp=self.tensor_parallel, cp=self.context_parallel, **data)
        if self.pipeline:
            pp = self.pipeline.parallel_size
            return Mesh(world=world, dp_replicate=world // pp, pp=pp)
        if self.strategy.shards:
            shard = self.strategy.shard_degree(setup)
            if shard > 1:
                return Mesh(world=world, dp_replicate=world // shard, dp_shard=shard)
        return self._replicated(world)

    @staticmethod
    def _replicated(world: int) -> Mesh:
        return Mesh(world=world, dp_replicate=world)


# what adapters are planned under: DDP, ZeRO 1-3 and FSDP2 full shard (their states are small; sharding them matters
# for the frozen base under ZeRO-3 and FSDP)
ADAPTER_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def candidates(
    adapters: tuple[str, ...] = (), pipelines: list[Candidate] | None = None, splits: list[Candidate] | None = None
) -> list[Candidate]:
    """Every full fine-tuning strategy with and without gradient checkpointing, fastest first; then the tensor- and
    context-parallel `splits` (cloudtrain.planning.search.tensor_candidates, context_candidates); then the
    `pipelines` (cloudtrain.planning.search.pipeline_candidates); then each of `adapters` (lora, dora, qlora) under
    DDP, ZeRO 1-3 and FSDP2, without and with checkpointing, fastest first."""
    full = sorted((Candidate(s, gc) for s in STRATEGIES for gc in (False, True)), key=lambda c: c.speed)
    by_key = {s.key: s for s in STRATEGIES}
    adapter_rows = [
        row
        for peft in adapters
        for row in sorted(
            (Candidate(by_key[k], gc, peft) for k in ADAPTER_STRATEGIES for gc in (False, True)), key=lambda c: c.speed
        )
    ]
    return full + (splits or []) + (pipelines or []) + adapter_rows
