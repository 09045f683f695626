"""The mesh: how a launch's processes are arranged, built once from the launch and the options.

`world = dp_replicate x dp_shard x pp x tp x cp`. Data-parallel processes each take their own rows of a step,
either holding the whole model (replicate: DDP) or a shard of it (shard: ZeRO, FSDP); pipeline processes each
hold some of the model's layers; a tensor-parallel group splits each layer's weights, a context-parallel group
each row's tokens (both take the same rows: cloudtrain.parallel.tensor, .context).
The trainer class of `--training_type` builds it (`Trainer.mesh`); the trainers, the batch-size finder and
the checkpoint check read it instead of re-deriving it from the options.
"""

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Mesh:
    world: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def data_parallel(self) -> int:
        """Processes that take their own share of a step's rows (--global_batch_size splits over them)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fits(self) -> bool:
        """Whether the degrees multiply to the launch's processes (a launch that does not fit is refused)."""
        return self.data_parallel * self.pp * self.tp * self.cp == self.world

    @classmethod
    def split(cls, world: int, sharded: bool, **group: int) -> "Mesh":
        """`world` processes as groups that take the same rows (`tp=N` or `cp=N`) x data-parallel processes that
        replicate the states, or shard them (`sharded`: FSDP2)."""
        (degree,) = group.values()
        data_parallel = max(world // degree, 1)
        return cls(world=world, **group, **{"dp_shard" if sharded else "dp_replicate": data_parallel})

    def degrees(self) -> dict[str, int]:
        """The degrees above 1 (and the world), as stored with a checkpoint."""
        return {k: v for k, v in asdict(self).items() if k == "world" or v > 1}

    def describe(self) -> str:
        names = {"dp_replicate": "replicated", "dp_shard": "sharded", "pp": "pipeline", "tp": "tensor", "cp": "context"}
        parts = [f"{names[k]} {v}" for k, v in self.degrees().items() if k != "world"]
        return f"{self.world} process(es)" + (f": {' x '.join(parts)}" if parts else "")
