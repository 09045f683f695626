"""Options of the launch: DeepSpeed, FSDP, pipeline stages and collectives."""

import os
from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError, refuse_first

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
OFFLOAD = ("none", "cpu", "nvme")
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")


@dataclass
class DistributedConfig(OnlyFields):
    zero_stage: int | None = opt(
        None,
        "DeepSpeed ZeRO stage (needs the deepspeed package); unset or none (over a config file's): no DeepSpeed.",
        (0, 1, 2, 3),
    )
    offload_optimizer: str = opt(
        "none",
        "DeepSpeed: keep optimizer states in CPU memory, or on a local NVMe disk (nvme: ZeRO-Infinity, "
        "ZeRO-3 only, with --nvme_path).",
        OFFLOAD,
    )
    offload_param: str = opt(
        "none", "DeepSpeed ZeRO-3: keep parameters in CPU memory, or on a local NVMe disk (nvme).", OFFLOAD
    )
    nvme_path: str | None = opt(
        None,
        "Offload nvme: a folder on a fast local disk for the offloaded states (each process writes its own "
        "swap files there; needs DeepSpeed's async I/O, built against libaio).",
        path=True,
    )
    aio_block_size: int = opt(1048576, "Offload nvme: bytes per async I/O request (DeepSpeed's aio block_size).")
    aio_queue_depth: int = opt(8, "Offload nvme: async I/O requests in flight (DeepSpeed's aio queue_depth).")
    deepspeed_config: str | None = opt(
        None, 'A DeepSpeed JSON config, used as-is; its "auto" values are filled from these options.', path=True
    )
    fsdp: bool = opt(
        False, "Shard the model with FSDP2 (torch's fully_shard, through accelerate); GPUs, or CPU processes (gloo)."
    )
    fsdp_sharding_strategy: str = opt(
        "full_shard",
        "--fsdp: full_shard (parameters, gradients and optimizer states over every process), shard_grad_op (the "
        "same, parameters kept gathered between forward and backward), hybrid_shard (sharded within a node, "
        "replicated across nodes), no_shard (replicated everywhere, like DDP).",
        FSDP_STRATEGIES,
    )
    fsdp_cpu_offload: bool = opt(
        False, "--fsdp: keep the sharded parameters, gradients and optimizer states in CPU memory between uses."
    )
    fsdp_reshard_after_forward: bool | None = opt(
        None,
        "--fsdp: free each layer's gathered parameters after its forward (gathered again for backward); unset: "
        "true, false for shard_grad_op.",
    )
    pipeline_parallel_size: int = opt(
        2,
        "--training_type pipeline: processes per pipeline (at least 2); the launch's processes form "
        "processes / this many data-parallel pipelines.",
    )
    pipeline_schedule: str = opt(
        "1f1b", "--training_type pipeline: the schedule of micro-batches over the stages.", PIPELINE_SCHEDULES
    )
    pipeline_microbatches: int = opt(
        4,
        "--training_type pipeline: micro-batches each pipeline's batch (--per_device_train_batch_size rows) "
        "is cut into; more shrink the idle bubble, (stages - 1) / micro-batches.",
    )
    pipeline_stages_per_rank: int = opt(
        1, "--training_type pipeline: stages each process holds (2 or more for interleaved_1f1b)."
    )
    pipeline_split_points: list = opt(
        [],
        "--training_type pipeline: the layers that end a stage (like model.layers.4: layers 0-4 in the first), "
        "one fewer than the stages; default: layers balanced by count, the first and last stage one fewer "
        "(they hold the embeddings and the head).",
    )
    tensor_parallel_size: int = opt(
        1,
        "Processes that split each layer's weights (tensor parallelism, the model's own plan; --training_type "
        "accelerated); the launch's processes form processes / this many data-parallel replicas. See "
        "docs/parallelism.md.",
    )
    context_parallel_size: int = opt(
        1,
        "Processes that split each row's tokens (context parallelism: all-to-all sequence parallelism, on CPU "
        "and GPUs; --training_type accelerated, --task causal_lm or sft); they take the same rows, and must "
        "divide the model's heads and KV heads. See docs/parallelism.md.",
    )
    collective_timeout: float = opt(
        1800.0,
        "Seconds a process waits in one collective (all-reduce, barrier, ...) before the run stops with a "
        "message naming it: a peer that died or hung ends the job instead of billing it until its time limit.",
    )

    def check(self) -> None:
        refuse_first(
            [
                (self.pipeline_parallel_size < 1, "--pipeline_parallel_size must be at least 1"),
                (self.pipeline_microbatches < 1, "--pipeline_microbatches must be at least 1"),
                (self.pipeline_stages_per_rank < 1, "--pipeline_stages_per_rank must be at least 1"),
                (self.collective_timeout <= 0, "--collective_timeout must be positive (seconds)"),
            ]
        )
        nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        if nvme and not self.nvme_path:
            raise UserError("--offload_* nvme needs --nvme_path <folder on a fast local disk>")
        if nvme and self.zero_stage != 3:
            raise UserError("--offload_* nvme (ZeRO-Infinity) needs --zero_stage 3")
        if self.nvme_path and not nvme:
            raise UserError("--nvme_path is used only with --offload_optimizer nvme or --offload_param nvme")
        refuse_first(
            [
                (self.tensor_parallel_size < 1, "--tensor_parallel_size must be at least 1"),
                (self.context_parallel_size < 1, "--context_parallel_size must be at least 1"),
                (  # before the process counts are checked: no launch can make the two work together
                    self.tensor_parallel_size > 1 and self.context_parallel_size > 1,
                    f"--context_parallel_size {self.context_parallel_size} does not combine with "
                    "--tensor_parallel_size yet; use one of the two",
                ),
            ]
        )
        if self.aio_block_size < 4096 or self.aio_queue_depth < 1:
            raise UserError("--aio_block_size must be at least 4096 bytes and --aio_queue_depth at least 1")
        self.check_fsdp()

    def check_fsdp(self) -> None:
        given = [
            name
            for name, default in (
                ("fsdp_sharding_strategy", "full_shard"),
                ("fsdp_cpu_offload", False),
                ("fsdp_reshard_after_forward", None),
            )
            if getattr(self, name) != default
        ]
        launcher_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"  # an accelerate FSDP config
        if given and not (self.fsdp or launcher_fsdp):
            raise UserError(f"--{given[0]} is an FSDP option: add --fsdp true")
        if self.fsdp_sharding_strategy == "shard_grad_op" and self.fsdp_reshard_after_forward:
            raise UserError(
                "--fsdp_sharding_strategy shard_grad_op keeps parameters gathered after forward, which "
                "--fsdp_reshard_after_forward true contradicts; drop one of them (full_shard reshards)"
            )
        if self.fsdp_sharding_strategy == "no_shard" and self.fsdp_cpu_offload:
            raise UserError(
                "--fsdp_cpu_offload needs sharded parameters; --fsdp_sharding_strategy no_shard keeps the whole "
                "model on every device: use full_shard or hybrid_shard"
            )
