"""bench/pipeline_bench.py's plan: its settings and the variants it launches (the same global batch in each).

bench/tp_bench.py launches its own variants through the same runner (bench/pipeline_runs.py).
"""

from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ENTRY = REPO / "src" / "training_application.py"
PRESETS = REPO / "src" / "cloudtrain" / "model_presets"

TINY_MODEL = {  # --quick: a 4-layer, hidden-64 Llama
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}


@dataclass
class Settings:
    model: str = "llama-8m"  # a preset name or a config.json (--model_config)
    steps: int = 12
    warmup: int = 2  # step intervals left out of the medians
    batch_size: int = 16  # global rows per step (one pipeline: all of them; DDP: half per process)
    max_length: int = 128
    microbatches: int = 4  # M of the GPipe / 1F1B comparison
    sweep: list = field(default_factory=lambda: [2, 8])  # more M for 1F1B
    threads: int = 1  # OpenMP threads per process
    two_threads_reference: bool = True  # also 1 process with 2 threads
    ddp: bool = True  # also DDP over 2 processes (not in --quick: each launch costs ~25 s of imports)
    gpipe: bool = True  # also GPipe at M=microbatches (not in --quick: tests/test_pipeline.py trains with it)
    interleaved: bool = False  # also interleaved 1F1B (2 stages per process)
    split_at: int | None = None  # also 1F1B (M=microbatches) with stage 1 starting at this layer
    vocab_size: int = 4096
    learning_rate: float = 2e-3
    seed: int = 42
    tab: str | None = None  # an Orange .tab corpus other than the Grimm tales (tests)
    timeout: float = 900.0  # seconds per launch


@dataclass
class Variant:
    name: str
    processes: int
    args: list
    threads: int
    schedule: str | None = None
    microbatches: int | None = None
    stages: int = 1


def variants(s: Settings) -> list[Variant]:
    m = s.microbatches
    out = [Variant("basic, 1 process (reference)", 1, ["--training_type", "basic"], s.threads)]
    if s.two_threads_reference:
        out.append(
            Variant(f"basic, 1 process, {2 * s.threads} threads", 1, ["--training_type", "basic"], 2 * s.threads)
        )
    if s.ddp:
        out.append(
            Variant(
                "DDP, 2 processes",
                2,
                ["--training_type", "accelerated", "--per_device_train_batch_size", str(s.batch_size // 2)],
                s.threads,
            )
        )

    def pipe(schedule: str, micro: int, per_rank: int = 1, split_at: int | None = None) -> Variant:
        args = ["--training_type", "pipeline", "--pipeline_schedule", schedule, "--pipeline_microbatches", str(micro)]
        if per_rank > 1:
            args += ["--pipeline_stages_per_rank", str(per_rank)]
        label = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}[schedule]
        name = f"{label}, 2 processes, M={micro}"
        if split_at is not None:  # names the layer that ends stage 0; a Llama's layers are model.layers.<i>
            args += ["--pipeline_split_points", f"model.layers.{split_at - 1}"]
            name += f", stage 1 from layer {split_at}"
        return Variant(name, 2, args, s.threads, schedule, micro, 2 * per_rank)

    out += ([pipe("gpipe", m)] if s.gpipe else []) + [pipe("1f1b", m)]
    out += [pipe("1f1b", k) for k in s.sweep if k != m]
    if s.interleaved:
        out.append(pipe("interleaved_1f1b", m, per_rank=2))
    if s.split_at is not None:
        out.append(pipe("1f1b", m, split_at=s.split_at))
    return out
