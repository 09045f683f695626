"""Reward models (`--task reward`): a sequence-classification head with one output, trained on preference pairs.

Supports:
- the pair formats of `--task dpo` (cloudtrain.data.pairs), `--chosen_column`, `--rejected_column` and an
  optional `--margin_column` (Llama 2's margin, subtracted inside the loss);
- the Bradley-Terry loss, -log sigmoid(r(chosen) - r(rejected) - margin), summed over pairs;
- text as the model reads it: with a chat template (the tokenizer's, or --chat_template; chatml for a
  tokenizer with no separator, a decoder's) the conversation rendered through it; otherwise (an encoder such as
  BERT) the prompt and the answer as a text pair;
- evaluation: the loss, pair accuracy (the share of pairs whose chosen answer scores higher) and the mean
  margin, over every pair exactly once; the saved model scores a text with `predict` (one output: the reward).
Does not support: packing, the pipeline trainer.
"""

import math
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard, ModelCardData
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cloudtrain import invocation
from cloudtrain.commands.predict import PLAIN_INPUT, REWARD_INPUT
from cloudtrain.config import Config, DataConfig
from cloudtrain.data.chat import ChatFormat
from cloudtrain.data.pairs import (
    SIDES,
    PairColumns,
    is_plain,
    pair_columns,
    pair_place,
    plain_pair,
    plain_text,
    to_pair,
)
from cloudtrain.data.processing import ProcessedData, cache_key, cached_map, first_rows
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode
from cloudtrain.models.load import (
    CONFIG_ERRORS,
    check_checkpoint,
    grow_embeddings,
    head_labels,
    load_failure,
    pad_as_batches,
    trained_config,
)
from cloudtrain.paths import resolve_model_path
from cloudtrain.publish.card_metadata import dataset_info
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import PROMPT_ANSWERS, TASK_ROWS
from cloudtrain.tasks.base import PairRows, Task, model_label
from cloudtrain.tasks.sft import SFTTask

REWARD_FEATURES = datasets.Features(
    {
        "chosen_ids": datasets.List(datasets.Value("int32")),
        "rejected_ids": datasets.List(datasets.Value("int32")),
        "margin": datasets.Value("float32"),
    }
)


class RewardCollator:
    """Pairs -> one batch of 2B rows (the B chosen, then the B rejected), right-padded, with their attention mask;
    `margin` [B]."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [row[f"{side}_ids"] for side in SIDES for row in rows]
        width = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for b, ids in enumerate(sequences):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[b, : len(ids)] = 1
        margin = torch.tensor([row["margin"] for row in rows], dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "margin": margin}


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Per-pair -log sigmoid(r_chosen - r_rejected - margin) (Bradley and Terry 1952; the margin: Llama 2, eq. 2)."""
    return -F.logsigmoid(chosen - rejected - margin)


@TASKS.register
class RewardTask(PairRows, Task):
    name = "reward"
    summary = "a reward model: one score per text, trained on chosen/rejected pairs (Bradley-Terry)"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    predicts = PROMPT_ANSWERS
    metrics: tuple[str, ...] = ("loss", "accuracy", "margin")
    lower_is_better = frozenset({"loss"})
    default_best_metric = "accuracy"
    auto_class = AutoModelForSequenceClassification
    peft_task_type = "SEQ_CLS"
    adds_head = True
    load_error = "could not load the reward model"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.cfg: Config = cfg
        self.chat: ChatFormat | None = None
        self.added_tokens = 0
        self.report: dict[str, dict] = {}
        self.reads: str | None = None  # how the sides were read, once `process` ran: saved with the tokenizer

    # ------------------------------------------------------------ options and data
    def check_options(self, cfg: Config) -> None:
        if cfg.model.model_config:
            raise UserError(
                "--task reward starts from a pretrained model: pass --model_name_or_path, not --model_config"
            )
        if cfg.model.model_name_or_path:  # an SFT LoRA output (an adapter, no config.json) gets its own line
            check_checkpoint(resolve_model_path(cfg.model), "--model_name_or_path")

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        p = self.cfg.preference
        named = {"--chosen_column": p.chosen_column, "--rejected_column": p.rejected_column}
        if cfg.prompt_column:
            named["--prompt_column"] = cfg.prompt_column
        if p.margin_column:
            named["--margin_column"] = p.margin_column
        return {flag: (column, flag != "--margin_column") for flag, column in named.items()}

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        """Rows -> (prompt, chosen, rejected) -> token ids of each side (and the margin); validation carved by pair."""
        self.cfg, self.tokenizer, d, p = cfg, tokenizer, cfg.data, cfg.preference
        # a decoder's tokenizer, with no separator, glued a text pair's prompt and answer ("the frogThe frog"): it
        # reads them through chatml instead, as dpo does (an encoder-decoder's, T5's, puts </s> between them)
        glued = tokenizer.sep_token is None and not trained_config(cfg.model).is_encoder_decoder
        raw = DatasetDict(raw)
        columns = {split: pair_columns(ds.column_names, d.prompt_column, *p.pair_columns) for split, ds in raw.items()}
        self.plain = len(raw["train"]) > 0 and is_plain(raw["train"][0], columns["train"])
        if d.chat_template or tokenizer.chat_template or glued:  # (plain pairs too: a checkpoint counts its tokens)
            size = len(tokenizer)
            self.chat = ChatFormat.setup(tokenizer, d.chat_template, generates=False)  # it scores, never writes
            self.added_tokens = len(tokenizer) - size
        self.reads = PLAIN_INPUT if self.plain else "template" if self.chat else "text_pair"
        pairs = {split: self._encode(ds, split, columns[split], cfg) for split, ds in raw.items()}
        if "validation" not in pairs:
            train, validation = SFTTask._carve_indices(
                len(pairs["train"]), d.validation_split_percentage, cfg.training.seed
            )
            pairs["train"], pairs["validation"] = pairs["train"].select(train), pairs["train"].select(validation)
        pairs["train"] = first_rows(pairs["train"], d.max_train_samples)
        for split in ("validation", "test"):
            if split in pairs:
                pairs[split] = first_rows(pairs[split], d.max_eval_samples)
        pairs = {split: self._usable(ds, split, d.max_length) for split, ds in pairs.items()}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return ProcessedData(
            train=pairs["train"],
            validation=pairs["validation"],
            test=pairs.get("test"),
            collator=RewardCollator(pad if pad is not None else 0),
        )

    def _encode(self, ds: Dataset, split: str, columns: PairColumns, cfg: Config) -> Dataset:
        """Each side's token ids, cut to --max_length (a text pair truncates the longer part first, so the answer
        keeps tokens; a templated conversation's side whose answer is cut away entirely is empty: `_usable`)."""
        margin, limit, chat, tokenizer = cfg.preference.margin_column, cfg.data.max_length, self.chat, self.tokenizer

        def encode(batch: dict, indices: list[int]) -> dict:
            out: dict[str, list] = {name: [] for name in REWARD_FEATURES}
            for i, index in enumerate(indices):
                try:
                    sides = self._sides({c: batch[c][i] for c in batch}, columns, limit)
                    value = float(batch[margin][i]) if margin and margin in batch else 0.0
                except (ValueError, TypeError) as err:
                    raise UserError(f"{pair_place(cfg.data, split, index)}: {err}") from None
                out["chosen_ids"].append(sides[0] or [])
                out["rejected_ids"].append(sides[1] or [])
                out["margin"].append(value)
            return out

        if margin and margin in ds.column_names:
            check_margins(ds[margin], margin, split, cfg.data)
        template = tokenizer.chat_template if chat else None
        key = cache_key(ds, tokenizer, *columns.names, columns.prompt, margin, limit, template, "reward-v4")
        desc = f"Tokenizing {split} pairs"
        return cached_map(ds, encode, REWARD_FEATURES, cfg.data, f"reward-{split}", key, desc, with_indices=True)

    def _usable(self, pairs: Dataset, split: str, limit: int) -> Dataset:
        """The pairs of a split as selected whose sides both keep an answer token and still differ once cut to
        --max_length (equal sides give a constant loss and no gradient); the others dropped and counted."""
        keep = [
            i
            for i, (chosen, rejected) in enumerate(zip(pairs["chosen_ids"], pairs["rejected_ids"], strict=True))
            if chosen and rejected and chosen != rejected
        ]
        self.report[split] = {"pairs": len(pairs), "dropped": len(pairs) - len(keep)}
        if not keep:
            raise UserError(
                f"all {len(pairs)} {split} pairs lose an answer, or all that tells their answers apart, within "
                f"--max_length {limit}; raise --max_length or shorten the prompts"
            )
        return pairs.select(keep) if len(keep) < len(pairs) else pairs

    def _sides(self, row: dict, columns: PairColumns, limit: int) -> list[list[int] | None]:
        """Both sides' token ids: plain text for an implicit-prompt pair of strings (as `--task dpo` reads it, with
        no EOS: the score is read where the text ends), else through the template or as a text pair."""
        plain = plain_pair(row, columns)
        if plain is None:
            prompt, *answers = to_pair(row, columns)
            return [self._side(prompt, answer, limit) for answer in answers]
        sides = [plain_text(self.tokenizer, plain[0], answer, eos=False) for answer in plain[1:]]
        return [ids[:limit] if any(mask[:limit]) else None for ids, mask in sides]

    def _side(self, prompt: list[dict], answer: list[dict], limit: int) -> list[int] | None:
        """One side's token ids, or None when truncation leaves none of its answer."""
        if self.chat is not None:
            ids, mask = self.chat.answer(prompt, answer)
            return ids[:limit] if any(mask[:limit]) else None
        text = "\n".join(m["content"] for m in prompt)
        reply = "\n".join(m["content"] for m in answer)
        return self.tokenizer(text, reply, truncation="longest_first", max_length=limit)["input_ids"]  # type: ignore[misc]

    def save_tokenizer(self, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
        """The tokenizer with how the model read its sides (REWARD_INPUT in its tokenizer_config.json): `predict`
        reads a plain model's texts whole, as it trained. The tokenizer travels with an adapter and into its merge,
        so the record does too (the config.json of a full model alone would not)."""
        if self.reads is None:  # no data was read: nothing to say
            return super().save_tokenizer(tokenizer, folder)
        kwargs = tokenizer.init_kwargs  # what transformers writes into tokenizer_config.json, and reads back
        before = kwargs.get(REWARD_INPUT)
        kwargs[REWARD_INPUT] = self.reads
        try:
            super().save_tokenizer(tokenizer, folder)
        finally:
            if before is None:
                kwargs.pop(REWARD_INPUT, None)
            else:
                kwargs[REWARD_INPUT] = before

    # ------------------------------------------------------------ the model
    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        path = resolve_model_path(cfg.model)
        try:
            config = AutoConfig.from_pretrained(
                path,
                id2label={0: "reward"},  # one output; num_labels beside it: a warning against a classifier's labels
                label2id={"reward": 0},
                trust_remote_code=cfg.model.trust_remote_code,
            )
        except CONFIG_ERRORS as err:
            raise load_failure(err, f"the model config in {path}", path) from None
        pad_as_batches(config, tokenizer)  # a decoder finds each row's last token by it
        return config

    def replaces_head(self, cfg: Config, data: ProcessedData, announce: bool) -> bool:
        """A checkpoint's classification head with other than one output gives way to a new one."""
        labels = head_labels(cfg.model)
        if labels is None or len(labels) == 1:
            return False
        if announce:
            print(f"the checkpoint's head ({len(labels)} labels) is replaced by a new one-output reward head")
        return True

    def fit_model(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: Config, announce: bool
    ) -> None:
        embeddings: Any = model.get_input_embeddings()
        if len(tokenizer) > embeddings.num_embeddings:  # a chat template's new tokens
            grow_embeddings(model, len(tokenizer))

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        """The head (and the embeddings when a chat template added tokens): new weights adapters cannot train."""
        head = [
            name
            for name, child in model.named_children()
            if name != model.base_model_prefix and any(True for _ in child.parameters())
        ]
        if self.added_tokens:
            names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
            head.append(names[model.get_input_embeddings()])
        return head

    # ------------------------------------------------------------ loss and evaluation
    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), len(batch["margin"]), device=batch["input_ids"].device)

    def rewards(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen rewards, rejected rewards), [B] each, from one forward over both sides."""
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].float()
        pairs = len(batch["margin"])
        return scores[:pairs], scores[pairs:]

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = self.rewards(model, batch)
        return bradley_terry(chosen, rejected, batch["margin"].to(chosen)).sum(), self.loss_count(batch)

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
        """The loss, pair accuracy and mean margin over every pair exactly once (gathered per pair)."""
        with eval_mode(model):
            sums, pairs = torch.zeros(5, dtype=torch.float64), 0
            for batch in batches:
                batch = move(batch)
                with autocast():
                    chosen, rejected = self.rewards(model, batch)
                losses = bradley_terry(chosen, rejected, batch["margin"].to(chosen))
                values = [losses, (chosen > rejected).float(), chosen - rejected, chosen, rejected]
                (rows,) = gather((torch.stack(values, dim=1),))
                sums += rows.double().sum(dim=0).cpu()
                pairs += len(rows)
        loss, accuracy, margin, chosen_mean, rejected_mean = (sums / max(pairs, 1)).tolist()
        return {
            "loss": loss,
            "accuracy": accuracy,
            "margin": margin,
            "rewards/chosen": chosen_mean,
            "rewards/rejected": rejected_mean,
            "samples": pairs,
        }

    # ------------------------------------------------------------ summaries
    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        assert cfg.hub.hub_model_id is not None  # a card is for a push, which needs --hub_model_id
        evaluation = results.get("eval", {})
        data = ModelCardData(
            model_name=cfg.hub.hub_model_id.split("/")[-1],
            library_name="transformers",
            tags=["reward-model", "cloudtrain"],
        )
        body = (
            f"# {cfg.hub.hub_model_id.split('/')[-1]}\n\nA reward model trained with cloudtrain (`--task reward`, "
            f"Bradley-Terry loss) from `{model_label(cfg.model.model_name_or_path)}` on "
            f"`{dataset_info(cfg.data)[1]}`: one output, the reward of a text.\n"
        )
        if "accuracy" in evaluation:
            body += f"\nValidation pair accuracy {evaluation['accuracy']:.3f} ({evaluation['samples']} pairs).\n"
        return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")

    def describe_data(self, data: ProcessedData) -> str:
        parts = [
            f"{len(rows)} {split} pairs"
            for split, rows in (("train", data.train), ("validation", data.validation), ("test", data.test))
            if rows is not None
        ]
        how = f"template: {self.chat.source}" if self.chat else "prompt and answer as a text pair"
        how = "plain text (implicit prompts, no template)" if self.plain else how
        notes = [
            f"\nnote: {r['dropped']} {split} pairs dropped (within --max_length an answer lost every token, or the "
            "two answers became the same)"
            for split, r in self.report.items()
            if r["dropped"]
        ]
        return f"data: {', '.join(parts)}; {how}" + "".join(notes)

    def describe_metrics(self, metrics: dict) -> str:
        return (
            f"loss {metrics['loss']:.4f} | pair accuracy {metrics['accuracy']:.3f} | margin {metrics['margin']:.4f} "
            f"({metrics['samples']} pairs)"
        )

    def inference_hint(self, output_dir: str) -> str:
        # a prompt and an answer: rendered through the chat template, or (without one) read as a text pair; a plain
        # model's input is one whole text, as each side of its pairs was
        texts = '--text "<prompt>" --text_pair "<answer>"'
        if self.reads == PLAIN_INPUT:
            texts = '--text "<prompt and answer, as one text>"'
        return f"{invocation.command()} predict --model_dir {shlex.quote(output_dir)} {texts}"


def check_margins(values: list, column: str, split: str, cfg: DataConfig) -> None:
    """Every pair has a finite margin: a NaN one made the loss non-finite and blamed the learning rate."""

    def finite(value: object) -> bool:
        try:
            return math.isfinite(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    bad = [index for index, value in enumerate(values) if not finite(value)]
    if bad:
        raise UserError(
            f"{len(bad)} of {len(values)} {split} pairs have no finite --margin_column {column!r} value (the first: "
            f"{pair_place(cfg, split, bad[0])}, {values[bad[0]]!r}); give each pair a number or drop those pairs"
        )
