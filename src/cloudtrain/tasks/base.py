"""What a task is: everything that differs between training a classifier and a language model.

The pipeline, the trainers, checkpoints, tracking and the Hub are the same for every task; they ask
the task for these and branch on nothing else:

- `columns` / `check_options`: what the data must hold and which options make sense, checked before
  anything heavy is loaded;
- `streams_data`, `stream_records`, `stream_options`, `preprocess_encoder`: whether --streaming true reads its
  rows on the fly, and how (`cloudtrain preprocess` asks the same);
- `process`: raw splits -> tokenized, collatable splits (`ProcessedData`);
- `build_config`, `replaces_head`, `fit_model`: what loading the model needs (cloudtrain.models.load);
- `loss` and `loss_count`: the loss of a batch as a (sum, count) pair (rows for classification,
  target tokens after the shift for language models); the trainer divides the step's summed loss by
  the count summed over its micro-batches and all processes;
- `evaluate`: the metrics of a split, counted over every example exactly once, and the tables logged
  with them (`tables`);
- `before_adapters`, `train_metrics`: what a task keeps of the model before adapters (a reference model) and
  its own numbers at each logging step (preference rewards); `pending_state` / `restore_state`: those numbers
  not yet logged, kept in a checkpoint so a resumed run logs what an uninterrupted one would;
- `describe`: the one-line summaries printed for data and metrics; `card` and `inference_hint` for
  the model card and the command that uses the saved model.
"""

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.auto_factory import _BaseAutoModelClass

from cloudtrain.config import Config, DataConfig
from cloudtrain.data.processing import ProcessedData
from cloudtrain.registry_table import DOCUMENT

if TYPE_CHECKING:  # parallel.distributed loads accelerate: not at import
    from cloudtrain.parallel.distributed import Sharding


def model_label(name: str | None) -> str:
    """A model as a card names it: a Hub id as given, a local folder by its name (no path of the machine that
    trained it)."""
    return Path(name).name if name and Path(name).exists() else name or ""


class Task:
    name = "task"  # the --task that picks it (cloudtrain.registry)
    summary = ""  # a line for --help
    # the options only some tasks read that this one reads, or a config section's name for all of its options: the
    # others it leaves unused, and a run setting one says so (cloudtrain.config.inert); a built-in task takes its
    # list from its registry row, which the parser reads without importing the task
    reads_options: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ("loss",)  # evaluation metrics --metric_for_best_model may name
    # what `cloudtrain predict` gives its saved model (registry_table.TEXTS, QUESTIONS, PROMPT_ANSWERS; None: not
    # a predict model)
    predicts: str | None = None
    lower_is_better: frozenset[str] = frozenset({"loss"})
    default_best_metric = "loss"
    default_packing: str | None = None  # what --packing auto means (language-model tasks)
    auto_class: type[_BaseAutoModelClass] | None = None  # the transformers Auto class of the task's models
    # the label names, by id, of the checkpoint a run resumes (the pipeline sets them before `process`): the ids
    # the data's labels take, whatever order names sort in now (numbers written as text sorted as text before)
    resumed_labels: list[str] | None = None
    peft_task_type = ""  # PEFT's name for the task (adapter_config.json's task_type)
    chat_template = False  # whether `generate` talks to a model this task trained through its chat template
    adds_head = False  # a new head on a pretrained body: transformers' report of new weights is expected
    load_error = "could not load the model"  # the start of the one line a failed load gives
    runs_in_pipeline = True  # whether its loss can be taken on a pipeline's last stage (--training_type pipeline)
    # whether its model is a diffusers pipeline folder: the planner counts its parts (cloudtrain.planning.diffusion)
    plans_pipeline = False
    plans_micro_batch = True  # whether the planner estimates its micro-batch (run_micro_batch: rows of tokens)
    sequences_per_row = 1  # the sequences a row of the micro-batch runs through the model (a pair: its two answers)
    size_option = "max_length"  # the option that sets how large one row is (named where memory runs out)
    streams_data = False  # whether --streaming true reads its training rows on the fly (cloudtrain.data.streaming)
    bounds_length = False  # whether it refuses a --max_length beyond the model's positions (models.load.check_sizes)
    # what one streamed record encodes to (registry_table.DOCUMENT or EXAMPLES, in its STREAMING row where it streams)
    stream_records = DOCUMENT
    stream_options: tuple[str, ...] = ()  # the data options its stream encoder reads: preprocess takes them as training
    # whether its model is one decoder loaded as it is (no reference copy), which --tensor_parallel_size shards
    tensor_parallel = False
    # whether its loss is one decoder's next-token loss over the cut batch's `targets` (--context_parallel_size)
    context_parallel = False
    # whether --neftune_noise_alpha applies: one text model trained on its own (no reference sharing its embeddings)
    embedding_noise = False
    # whether its batches of packed rows carry their documents' lengths to the attention (varlen: no dense mask)
    packed_attention = False
    text_names: tuple[str, ...] = ()  # columns a csv holds texts in by their usual names (read as written)
    # why the MFU's formula (6 x matmul weights x tokens, cloudtrain.observe.flops) does not fit its model: no MFU
    no_mfu: str | None = None

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg

    def use_loss_kernel(self, backend: str | None) -> bool:
        """Compute the training loss with `backend` (cloudtrain.models.kernels), or plainly (None); False where the
        task has no language-model loss to fuse."""
        return False

    @classmethod
    def preprocess_encoder(
        cls, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, first: dict
    ) -> tuple[Callable, list[str]]:
        """`cloudtrain preprocess`'s encoder (records -> per record, its examples, as the task's stream encodes them)
        and the record columns a shard keeps, from the `stream_options` in `cfg` and the first non-empty record."""
        raise NotImplementedError(f"--task {cls.name} streams no data")

    def check_options(self, cfg: Config) -> None:
        """Reject options this task cannot use (light I/O only: configs, a tokenizer; no data, no weights)."""

    def resolve_options(self, cfg: Config) -> Config:
        """The options made concrete for this task (a task option that implies generic ones); by default as given."""
        return cfg

    def data_label(self, cfg: Config) -> str:
        """A short name for the data: the default output folder's and tracker runs' second part."""
        from cloudtrain.data.sources import dataset_label

        return dataset_label(cfg.data)

    def check_data(self, cfg: Config) -> None:
        """Cheap checks of the data options (files exist and have a format the task reads), before loading."""
        from cloudtrain.data.sources import check_data_sources

        check_data_sources(cfg.data)

    def connect(self, cfg: Config) -> DatasetDict:
        """The raw splits: the data connectors' (files, the Hub, a SageMaker channel, the built-in default)."""
        from cloudtrain.data.sources import connect_data

        return connect_data(cfg.data, self.columns(cfg.data), self.text_names)

    def check_adapters(self, cfg: Config) -> None:
        """--peft and its options against this task's models (light I/O only)."""
        from cloudtrain.models import adapters

        assert self.auto_class is not None  # a task that trains adapters on a transformers model names its class
        adapters.check_options(cfg, self.auto_class, self.train_in_full)

    def attach_adapters(self, model: PreTrainedModel, cfg: Config, announce: bool = False) -> torch.nn.Module:
        """The model with --peft adapters on (models.prepare calls this where adapters come in its order)."""
        from cloudtrain.models import adapters

        return adapters.attach(model, cfg, self.peft_task_type, self.train_in_full(model), announce)

    def keeps_model_copy(self, cfg: Config) -> bool:
        """Whether the run keeps a frozen copy of the model beside the one it trains (a DPO reference under full
        fine-tuning): whole in every process, or sharded as the policy's parameters under FSDP2. The planner
        counts it."""
        return False

    def sharding_refusal(self, cfg: Config, shards: "Sharding") -> str | None:
        """Why the run refuses to shard the model as `shards` says (a ZeRO stage, FSDP) with cfg's other options
        (--peft), in the one line `check_options` raises; None when it runs that way. The planner leaves out the
        rows it refuses, so the two cannot disagree."""
        return None

    def save_tokenizer(self, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
        """The tokenizer beside the saved model (a task whose model folder holds its own may skip it)."""
        from cloudtrain.models.load import save_tokenizer_files  # models.load names tasks in its types

        save_tokenizer_files(tokenizer, folder)

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        """{flag: (column, needed in every split)}; a column needed in train only may be absent elsewhere."""
        raise NotImplementedError

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        raise NotImplementedError

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        """The config the model is built or loaded with (cloudtrain.models.load.load_model)."""
        raise NotImplementedError

    def replaces_head(self, cfg: Config, data: ProcessedData, announce: bool) -> bool:
        """Whether the checkpoint's task head gives way to a new one (only the body's weights load)."""
        return False

    def fit_model(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: Config, announce: bool
    ) -> None:
        """What the loaded model still needs for this task's data (in place)."""

    def check_model(self, model: PreTrainedModel, cfg: Config, announce: bool) -> None:
        """Checks that need the loaded model (before training starts)."""

    def before_adapters(self, model: PreTrainedModel, cfg: Config, announce: bool) -> None:
        """What the task keeps of the model as it computes before adapters change it (a preference task's
        reference: a frozen copy, or its log-probabilities computed once)."""

    def train_metrics(self, reduce_sum: Callable, seconds: float) -> dict[str, float]:
        """The task's own numbers of a logging interval, from sums it kept on the device and adds over every
        process with `reduce_sum` (a collective: every process calls it); logged as train/<name>."""
        return {}

    def pending_state(self, reduce_sum: Callable) -> list[float] | None:
        """The task's own sums not yet logged, added over every process with `reduce_sum` (a collective: every
        process calls it), for a checkpoint; None when it keeps none."""
        return None

    def restore_state(self, state: list[float], is_main: bool) -> None:
        """Take back what `pending_state` gave a checkpoint (the main process holds every process's sums, as the
        trainer's own logging sums)."""

    def load_tokenizer(self, cfg: Config) -> PreTrainedTokenizerBase:
        """The tokenizer the data is processed with: the model's, or --tokenizer_name_or_path."""
        from cloudtrain.models.load import load_tokenizer  # models.load names tasks in its types

        return load_tokenizer(cfg.model)

    def load_model(
        self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase, announce: bool
    ) -> torch.nn.Module:
        """The model to train, before the transforms of models.prepare: the task's Auto class through
        cloudtrain.models.load; a task whose model is no single transformers model loads its own."""
        from cloudtrain.models.load import load_model

        return load_model(cfg, self, data, tokenizer, announce)

    def probe_row(self, train: Dataset) -> dict:
        """The training row that takes the most memory, which --per_device_train_batch_size auto repeats to find
        the largest batch that fits (cloudtrain.batch_size): the one with the most tokens."""
        from cloudtrain.data.processing import longest_row

        return longest_row(train, "input_ids")

    def probe_tokens(self, row: dict) -> int:
        """The tokens of one `probe_row`, as the planner counts a row's (its sequence length)."""
        return len(row["input_ids"])

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        """Modules that train in full next to adapters (--peft): what the task added or changed in the model."""
        return []

    def loss_count(self, batch: dict) -> torch.Tensor:
        """What this batch's loss sums over (rows, or target tokens), as a tensor on the batch's device."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) of one batch."""
        raise NotImplementedError

    def target_length(self, cfg: Config) -> int | None:
        """The tokens an encoder-decoder's decoder reads per row, where they are not its input's (the planner's
        question); None: the task feeds the decoder its input."""
        return None

    def smoothing(self) -> float:
        """--label_smoothing, for a training loss that reads it (evaluation's loss is the plain cross-entropy)."""
        return self.cfg.training.label_smoothing if self.cfg else 0.0

    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        raise NotImplementedError

    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ):
        """Predictions for an unlabelled split (a task whose `process` leaves `data.unlabelled` empty has none)."""
        raise NotImplementedError

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted) -> None:
        raise NotImplementedError

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        """Tables to log with an evaluation: {name: (header, rows)}."""
        return {}

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        """The README.md pushed to the Hub with the model."""
        raise NotImplementedError

    def published_files(self, output_dir: Path, results: dict) -> list[Path]:
        """Files of `output_dir` pushed beside the model's own (cloudtrain.publish.hub): those its card shows."""
        return []

    def describe_data(self, data: ProcessedData) -> str:
        raise NotImplementedError

    def describe_metrics(self, metrics: dict) -> str:
        raise NotImplementedError

    def inference_hint(self, output_dir: str) -> str:
        raise NotImplementedError


class PairRows:
    """What the pair tasks' rows share (chosen_ids and rejected_ids, both run through the model): the planner
    counts two sequences a row, and --per_device_train_batch_size auto repeats the pair with the most tokens."""

    sequences_per_row = 2
    plain = False  # whether the training pairs are plain text (implicit prompts as strings): set by `process`

    def save_tokenizer(self, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
        """Pairs of plain text leave no chat template with the model (a base model's own included): generate and
        predict then read plain text, as it trained (found in review: generate wrapped its prompts in ChatML)."""
        if not self.plain:
            return super().save_tokenizer(tokenizer, folder)  # type: ignore[misc]  # the Task this is mixed into
        template, tokenizer.chat_template = tokenizer.chat_template, None
        try:
            super().save_tokenizer(tokenizer, folder)  # type: ignore[misc]
        finally:
            tokenizer.chat_template = template

    def probe_row(self, train: Dataset) -> dict:
        from cloudtrain.data.processing import longest_pair

        return longest_pair(train)

    def probe_tokens(self, row: dict) -> int:
        return max(len(row["chosen_ids"]), len(row["rejected_ids"]))


class DecoderTask(Task):
    """What the language-model tasks share: a decoder with an LM head, whose loss is counted over target tokens.

    The planner and the pipeline trainer ask these of any decoder task; `issubclass(cls, DecoderTask)` is how
    other modules tell a language-model task from others."""

    def model_config(self, cfg: Config) -> PretrainedConfig:
        """The model's config, from --model_config (a preset or config.json) or the checkpoint, before loading."""
        raise NotImplementedError

    @staticmethod
    def fit_config(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        """Make a config built from --model_config `name` fit the tokenizer (vocabulary, special tokens)."""
        raise NotImplementedError

    loss_kernel: str | None = None  # --fused_cross_entropy's backend where the loss takes it (models.prepare)

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) from the logits (a pipeline's last stage computes them, not `loss`)."""
        raise NotImplementedError

    def head_loss(
        self, hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, smoothing: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) from the hidden states through the LM head by `loss_kernel`, the logits never held
        whole (a pipeline's last stage under --fused_cross_entropy)."""
        raise NotImplementedError

    @staticmethod
    def loss_metrics(loss_sum: float, tokens: float, rows: float, seconds: float) -> dict:
        """The evaluation metrics from the sums over a split (also a pipeline's evaluation)."""
        raise NotImplementedError
