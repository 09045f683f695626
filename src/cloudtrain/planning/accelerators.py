"""GPUs by name for `plan --gpu`: their memory, and what differs on AMD; other accelerators refused plainly.

Memory is the capacity one device (what torch sees as one GPU) is sold with, in GiB, as `--gpu_memory_gb`
takes it; the memory model subtracts the CUDA context and fragmentation itself. An AMD MI250 is two devices
(graphics compute dies) of 64 GiB each: plan for `--num_gpus` devices, not cards.
"""

from dataclasses import dataclass

from cloudtrain.errors import UserError


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    vendor: str  # nvidia or amd
    bf16: bool = True  # computes bf16 natively (Ampere, Ada, Hopper, Blackwell; CDNA2 on): training's auto picks it

    def notes(self) -> list[str]:
        """What a plan for this GPU should say beyond the memory."""
        if self.vendor != "amd":
            return []
        return [
            f"{self.name}: AMD Instinct runs the same code on a ROCm build of torch (its collectives go to RCCL, "
            "NCCL's ROCm port); QLoRA and the 8-bit or paged optimizers need bitsandbytes' ROCm build, and FLOP "
            "peaks for MFU are not in cloudtrain's table"
        ]


GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("t4", 16, "nvidia", bf16=False),
        Gpu("v100-16gb", 16, "nvidia", bf16=False),
        Gpu("v100-32gb", 32, "nvidia", bf16=False),
        Gpu("a10g", 24, "nvidia"),
        Gpu("l4", 24, "nvidia"),
        Gpu("rtx-4090", 24, "nvidia"),
        Gpu("l40s", 48, "nvidia"),
        Gpu("a100-40gb", 40, "nvidia"),
        Gpu("a100-80gb", 80, "nvidia"),
        Gpu("h100", 80, "nvidia"),
        Gpu("h200", 141, "nvidia"),
        Gpu("b200", 180, "nvidia"),
        Gpu("mi210", 64, "amd"),
        Gpu("mi250", 64, "amd"),
        Gpu("mi250x", 64, "amd"),
        Gpu("mi300x", 192, "amd"),
    )
}

# accelerators people ask for that cloudtrain does not train on, and why in a word
UNSUPPORTED = {
    "tpu": "Google TPUs (XLA)",
    "trainium": "AWS Trainium (Neuron SDK)",
    "trn1": "AWS Trainium (Neuron SDK)",
    "trn2": "AWS Trainium (Neuron SDK)",
    "inferentia": "AWS Inferentia (inference only)",
    "inf1": "AWS Inferentia (inference only)",
    "inf2": "AWS Inferentia (inference only)",
    "gaudi": "Intel Gaudi (HPU)",
    "hpu": "Intel Gaudi (HPU)",
    "mps": "Apple silicon (MPS)",
    "ipu": "Graphcore IPUs",
}


def gpu_by_name(name: str) -> Gpu:
    """The GPU `name` (any case); a UserError naming what is unsupported, or what is known."""
    key = name.lower().replace("_", "-").replace(" ", "-")
    if key in GPUS:
        return GPUS[key]
    family = next((what for prefix, what in UNSUPPORTED.items() if key.startswith(prefix)), None)
    if family:
        raise UserError(
            f"--gpu {name}: {family} are not supported: cloudtrain trains on NVIDIA GPUs (CUDA) and AMD Instinct "
            "GPUs (ROCm) only, so there is nothing to plan"
        )
    raise UserError(f"--gpu {name} is not a GPU the planner knows ({', '.join(GPUS)}); give --gpu_memory_gb instead")
