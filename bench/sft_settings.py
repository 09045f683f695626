"""What every runner of bench/sft_bench.py shares: the runners' names, which of them pack, and the settings."""

from dataclasses import dataclass, field

RUNNERS = ("ours-none", "ours-bfd", "hf-trainer", "trl-none", "trl-packing")
PACKED = {"ours-none": False, "ours-bfd": True, "hf-trainer": False, "trl-none": False, "trl-packing": True}
IGNORE_INDEX = -100


@dataclass
class SFTSettings:
    """What every runner shares."""

    max_length: int = 512  # fits 91% of the articles whole: lengths vary as they do in the news
    batch_size: int = 4  # rows of max_length per step for the packed runners; unpacked ones get as many examples
    steps: int = 6
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    train_examples: int = 400  # the pool every runner packs or batches from (more than the steps consume)
    heldout_examples: int = 64
    eval_batch_size: int = 16
    preset: str = "llama-8m"
    model_overrides: dict = field(default_factory=dict)  # e.g. a tinier model for the tests
    threads: int = 1  # one thread: the least disturbed by other tenants of a shared machine (0: torch's default)
    seed: int = 42
    runners: list = field(default_factory=lambda: list(RUNNERS))
