"""Sequence to sequence (`--task seq2seq`): a source text -> a target text, with an encoder-decoder (T5, BART).

Supports: summarization and translation data as two text columns (XSum's, CNN/DailyMail's or `source`/`target`
are read without options; else --text_column and --label_column) or WMT's `translation` records (--source_lang,
--target_lang), T5's task prefixes (--source_prefix), targets cut at --max_target_length; the loss over target
tokens, and at each evaluation generations (greedy, or --generation_num_beams beams) scored by ROUGE-1/2/L/Lsum
(--rouge_stemmer: stemmed) and BLEU (cloudtrain.metrics.text_overlap), a table of the first few; several
references per row (a list of texts: each trains as its own pair, evaluation scores against them all and takes
its loss against the first); unlabelled evaluation splits (generations in `<split>_predictions.jsonl`);
`cloudtrain generate` with the saved model; adapters (LoRA, DoRA, QLoRA), both trainers, DDP, DeepSpeed ZeRO 1-3
and FSDP2 (every process generates in step), planning its memory (`cloudtrain plan --task seq2seq`), and the Hub
push.
Does not support: decoder-only models (use --task sft with --prompt_column/--completion_column), sampling in
evaluation, pretraining from --model_config, --training_type pipeline, tensor or context parallelism, packing.
"""

import json
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard
from transformers import (
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cloudtrain import invocation
from cloudtrain.assets import DEFAULT_MODEL_NAME
from cloudtrain.config import Config, DataConfig
from cloudtrain.data.processing import ProcessedData, longest_row, with_named_columns
from cloudtrain.data.source_target import (
    IGNORED,
    adds_eos,
    check_family,
    check_translations,
    family_columns,
    process_source_target,
    shift_right,
    with_translations,
)
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode, pad_to_width, whole_root
from cloudtrain.generate import beam_length_problem, search_options
from cloudtrain.metrics.text_overlap import bleu, porter_stemmer, rouge
from cloudtrain.models.load import context_length, read_config
from cloudtrain.paths import resolve_model_path
from cloudtrain.publish.classifier_card import CardKind, build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.classification import ClassificationTask

SHOWN = 5  # generations logged in the evaluation's table


# its card: the snippet generates as the run evaluated (its beams, or one greedy pass whatever the base model saved)
CARD = CardKind(
    purpose="sequence-to-sequence generation (a target text written from a source text: summaries, translations)",
    metrics=(
        ("rougeL", "rouge", "ROUGE-L", None),
        ("rouge1", "rouge", "ROUGE-1", None),
        ("rouge2", "rouge", "ROUGE-2", None),
        ("rougeLsum", "rouge", "ROUGE-Lsum", None),
        ("bleu", "sacrebleu", "BLEU", None),
    ),
    pipeline=("text2text-generation", "Text2Text Generation", "AutoPeftModelForSeq2SeqLM"),
    labelled=False,
    model_class="AutoModelForSeq2SeqLM",
    inputs='inputs = tokenizer({{ source_text }}, return_tensors="pt")',
    output="{% if num_beams > 1 %}# beam search, as evaluated\n"
    "output = model.generate(**inputs, max_new_tokens={{ max_new_tokens }}, num_beams={{ num_beams }})\n"
    "{% else %}# one greedy pass, as evaluated (not any beam search the base model saved)\n"
    "output = model.generate(**inputs, max_new_tokens={{ max_new_tokens }}, num_beams=1, min_length=0, "
    "no_repeat_ngram_size=0)\n"
    "{% endif %}print(tokenizer.decode(output[0], skip_special_tokens=True))",
)


@TASKS.register
class Seq2SeqTask(ClassificationTask):
    name = "seq2seq"
    no_mfu = "the decoder's tokens are not counted (tokens/s counts source tokens), so the formula does not fit"
    summary = "a source text -> a target text (summaries, translations) with an encoder-decoder"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    predicts = None  # an encoder-decoder: `generate` writes with it
    metrics: tuple[str, ...] = ("rougeL", "rouge1", "rouge2", "rougeLsum", "bleu", "loss")
    default_best_metric = "rougeL"
    auto_class = AutoModelForSeq2SeqLM
    adds_head = False
    load_error = "could not load an encoder-decoder model"
    peft_task_type = "SEQ_2_SEQ_LM"
    embedding_noise = False  # NEFTune's noise is for a decoder's prompt embeddings
    runs_in_pipeline = False  # the pipeline trainer cuts one stack of decoder layers
    nouns = ("pairs", "targets")

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        self.tokenizer: PreTrainedTokenizerBase | None = None  # process() keeps it: evaluation decodes generations
        self.decoder_ids = (0, 0)  # (start, pad) of the decoder's inputs, from the model's config (build_config)
        self.forced_eos = False  # whether generation ends every text with EOS, cut or not (BART's forced_eos_token_id)

    def check_options(self, cfg: Config) -> None:
        """One source column, the stemmer where asked for, then the classifier's checks (a pretrained checkpoint,
        the tokenizer within its vocabulary, --max_length within its positions, and `check_fit`)."""
        if cfg.data.text_pair_column:
            raise UserError(
                "--task seq2seq reads one source column (--text_column); drop --text_pair_column, or join the two "
                "texts into one column"
            )
        if cfg.data.rouge_stemmer:
            porter_stemmer()  # installed, or refused before any work
        super().check_options(cfg)

    def check_fit(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> None:
        """An encoder-decoder whose decoder knows its start token; --max_target_length within its positions and
        past the tokenizer's special tokens, and past the minimum length beam search would keep."""
        _check_model(config, cfg.model.model_name_or_path or f"the default model ({DEFAULT_MODEL_NAME})")
        _check_target_length(config, tokenizer, cfg.data.max_target_length)
        if cfg.data.generation_num_beams > 1:
            _check_beam_length(config, cfg)

    def target_length(self, cfg: Config) -> int | None:
        return cfg.data.max_target_length  # labels, EOS included; the decoder reads them shifted by one

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        return {"--text_column": (cfg.text_column, True), "--label_column": (cfg.label_column, False)}

    def connect(self, cfg: Config) -> DatasetDict:
        """The raw splits, holding the source and (in training) the target columns, or the `translation` records
        --source_lang and --target_lang name (read into two columns by `process`, once per node)."""
        from cloudtrain.data.sources import check_columns, connect_data

        raw = connect_data(cfg.data, {})
        check_translations(raw["train"], cfg.data)
        if not cfg.data.source_lang:
            check_family(raw["train"].column_names, cfg.data)
            check_columns(raw, self.columns(self.data_options(cfg, raw)))
        return raw

    def data_options(self, cfg: Config, raw: DatasetDict) -> DataConfig:
        """The source and target columns: the translation's languages, a dataset family's names or the options."""
        if cfg.data.source_lang and cfg.data.target_lang:
            return replace(cfg.data, text_column=cfg.data.source_lang, label_column=cfg.data.target_lang)
        columns = raw["train"].column_names
        return with_named_columns(cfg.data, columns, family_columns(columns))

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        from cloudtrain.data.sources import check_columns

        self.tokenizer = tokenizer
        raw = with_translations(raw, cfg.data)
        data = self.data_options(cfg, raw)
        check_columns(raw, self.columns(data))  # a translation's evaluation split may lack the source language
        return process_source_target(raw, tokenizer, data, cfg.training.seed)

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = read_config(cfg.model)
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        self.decoder_ids = (int(config.decoder_start_token_id), int(config.pad_token_id))
        return config

    def replaces_head(self, cfg: Config, data: ProcessedData, announce: bool) -> bool:
        return False  # the LM head is the checkpoint's own

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        return []  # nothing new: adapters train alone

    def probe_row(self, train: Dataset) -> dict:
        """The longest source with the longest target: the two stacks' worst cases, which one row may not hold."""
        target = longest_row(train, "labels")
        return {**longest_row(train, "input_ids"), "labels": target["labels"]}

    def loss_count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORED).sum()

    def row_losses(self, model: torch.nn.Module, batch: dict, smoothing: float = 0.0) -> torch.Tensor:
        """Each row's summed cross-entropy over its target tokens (label-smoothed by `smoothing`), the decoder fed
        the targets shifted right."""
        labels = batch["labels"]
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=shift_right(labels, *self.decoder_ids),
        ).logits
        losses = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORED,
            reduction="none",
            label_smoothing=smoothing,
        )
        return losses.view(labels.shape).sum(1)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_losses(model, batch, self.smoothing()).sum(), self.loss_count(batch)

    def generate(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The targets of a batch's sources (greedy, or beam search with --generation_num_beams), padded to
        --max_target_length + 1 (the start token) so that every process gathers the same shape. Every process
        steps together where the model's weights are sharded or several processes run (generation's
        collectives)."""
        assert self.cfg is not None
        width = self.cfg.data.max_target_length
        bare: Any = getattr(model, "module", model)  # DDP and DeepSpeed wrap it
        with whole_root(bare):  # FSDP2: generate calls the encoder itself, not the root's forward
            out = bare.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                # our beams (greedy by default), not the checkpoint's; beam search keeps its saved length rules
                **search_options(self.cfg.data.generation_num_beams),
                max_new_tokens=width,
                do_sample=False,
                pad_token_id=self.decoder_ids[1],
                use_cache=True,
                synced_gpus=dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1,
            )
        self.forced_eos = bare.generation_config.forced_eos_token_id is not None
        return pad_to_width(out, width + 1, self.decoder_ids[1])

    def written(self, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the text's tokens generated (after the start token; EOS, BOS and padding left out), and whether
        it ended with EOS (else --max_target_length cut it; a forced EOS in the last place is a cut)."""
        assert self.tokenizer is not None  # process() kept it
        new = generated[:, 1:]
        eos = new == self.tokenizer.eos_token_id
        text = (new != self.decoder_ids[1]) & ~eos & (new != self.tokenizer.bos_token_id)
        return text.sum(1), (eos[:, :-1] if self.forced_eos else eos).any(1)

    def decode(self, ids: torch.Tensor) -> list[str]:
        assert self.tokenizer is not None  # process() kept it
        ids = ids.masked_fill(ids == IGNORED, self.tokenizer.pad_token_id)
        return [text.strip() for text in self.tokenizer.batch_decode(ids, skip_special_tokens=True)]

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        assert self.cfg is not None
        start = time.perf_counter()
        predictions: list[str] = []
        references: list[str | list[str]] = []  # a row's target, or its several references
        sources: list[str] = []
        loss_sum, tokens, written = 0.0, 0, 0
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                with autocast():
                    losses = self.row_losses(model, batch)
                    generated = self.generate(model, batch)
                counts = (batch["labels"] != IGNORED).sum(1)
                labels = pad_to_width(batch["labels"], self.cfg.data.max_target_length, IGNORED)
                # every process holds the same split: all gather its rows' ids (several references), or none
                rows = (batch["row"],) if "row" in batch else ()
                losses, counts, generated, labels, *rows = gather((losses, counts, generated, labels, *rows))
                if len(sources) < SHOWN:  # every process has gathered as many: all gather here, or none
                    inputs = pad_to_width(batch["input_ids"], self.cfg.data.max_length, IGNORED)
                    sources += self.decode(gather(inputs).cpu())
                loss_sum, tokens = loss_sum + losses.sum().item(), tokens + int(counts.sum().item())
                written += int(self.written(generated)[0].sum().item())
                predictions += self.decode(generated.cpu())
                references += self._references(rows[0], data) if rows else self.decode(labels.cpu())
        runtime = time.perf_counter() - start
        return {
            **rouge(predictions, references, porter_stemmer() if self.cfg.data.rouge_stemmer else None),
            "bleu": bleu(predictions, references),
            "loss": loss_sum / max(tokens, 1),
            "generated_tokens": written / max(len(predictions), 1),
            "samples": len(predictions),
            "runtime_s": round(runtime, 3),
            "samples_per_s": round(len(predictions) / max(runtime, 1e-9), 2),
            "generations": [
                {"source": s, "target": r, "generated": p}
                for s, r, p in zip(sources[:SHOWN], references[:SHOWN], predictions[:SHOWN], strict=False)
            ],
        }

    def _references(self, rows: torch.Tensor, data: ProcessedData) -> list[str | list[str]]:
        """The references of a batch's rows of several (by their ids), tokenized and decoded as a target is."""
        return [data.extras["references"][row] for row in rows.tolist()]

    @torch.no_grad()
    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """The generated target of each source of an unlabelled split, in the split's order, with its length in
        tokens and whether it ended (EOS) before --max_target_length."""
        texts: list[str] = []
        lengths: list[tuple[int, bool]] = []
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                with autocast():
                    ids = gather(self.generate(model, batch)).cpu()
                texts += self.decode(ids)
                lengths += list(zip(*(part.tolist() for part in self.written(ids)), strict=True))
        return texts, lengths

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        rows = [
            {"source": source, "generated": text, "tokens": tokens, "ended": ended}
            for source, text, (tokens, ended) in zip(data.unlabelled_texts[split], *predicted, strict=True)
        ]
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        shown = metrics.get("generations") or []
        rows = [[g["source"], shown_target(g["target"]), g["generated"]] for g in shown]
        return {"generations": (["source", "target", "generated"], rows)} if rows else {}

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, CARD)

    def describe_data(self, data: ProcessedData) -> str:
        rows = data.extras.get("training_rows")
        spread = f" ({rows} training rows: {len(data.train)} pairs from their references)" if rows else ""
        return self.data_summary(data, f"(source, target) pairs{spread}")

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"rougeL {metrics['rougeL']:.2f} | rouge1 {metrics['rouge1']:.2f} | rouge2 {metrics['rouge2']:.2f} | "
            f"rougeLsum {metrics['rougeLsum']:.2f} | "
            f"bleu {metrics['bleu']:.2f} | loss {metrics['loss']:.4f} ({metrics['samples']} pairs{self._beams()})"
        )

    def _beams(self) -> str:
        beams = self.cfg.data.generation_num_beams if self.cfg else 1
        return f", {beams} beams" if beams > 1 else ""

    def inference_hint(self, output_dir: str) -> str:
        return f'{invocation.command()} generate --model_dir {shlex.quote(output_dir)} --prompt "..."'


def shown_target(target: str | list[str]) -> str:
    """A table's target cell: the text, or every reference as a JSON list (a cell holds a string; a reference's own
    " | " or line break would blur a joined one)."""
    return target if isinstance(target, str) else json.dumps(target, ensure_ascii=False)


def _check_model(config: PretrainedConfig, name: str) -> None:
    if not config.is_encoder_decoder:
        kind = ", ".join(config.architectures or [config.model_type])
        raise UserError(
            f"{name} is not an encoder-decoder model ({kind}); --task seq2seq trains models such as T5 or BART; for "
            "a decoder use --task sft with --prompt_column and --completion_column"
        )
    if config.decoder_start_token_id is None:
        raise UserError(
            f"the config of {name} has no decoder_start_token_id, so the decoder could not start; set it in its "
            "config.json"
        )


def _check_beam_length(config: PretrainedConfig, cfg: Config) -> None:
    """Beam search keeps the checkpoint's saved minimum length (bart-large-cnn: 56): past --max_target_length, no
    generation could end, and every one would run to the cut."""
    path = resolve_model_path(cfg.model)
    try:
        saved = GenerationConfig.from_pretrained(path)
    except OSError:  # none saved: the model config's legacy generation fields
        saved = GenerationConfig.from_model_config(config)
    n = cfg.data.max_target_length
    if problem := beam_length_problem(saved, n, encoder_decoder=True):
        raise UserError(
            f"{problem}, and --max_target_length {n} leaves no room for its end: raise --max_target_length, or "
            "pass --generation_num_beams 1 (one pass, without the saved length rules)"
        )


def _check_target_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, length: int) -> None:
    """--max_target_length within the decoder's positions, with room for text beside the special tokens (the
    tokenizer's own, and EOS where the task adds it): a shorter cut is one the tokenizer cannot make."""
    decoder = context_length(config)
    if decoder and length > decoder:
        raise UserError(
            f"--max_target_length {length} is longer than the model's context ({decoder} positions); pass "
            f"--max_target_length {decoder} or less"
        )
    specials = tokenizer.num_special_tokens_to_add() + (0 if adds_eos(tokenizer) else 1)
    if length <= specials:
        raise UserError(
            f"--max_target_length {length} leaves no room for a target's text beside its {specials} special "
            f"token(s); pass --max_target_length {specials + 1} or more"
        )
