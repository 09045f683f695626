"""Supervised fine-tuning (`--task sft`): a decoder taught to answer, on conversations or prompt/completion pairs.

Supports:
- data as conversations (`--messages_column`, lists of {role, content}; ShareGPT {from, value}),
  prompt/completion columns, or Alpaca instruction/input/output; detected from the usual column names
  when not named; `--system_prompt` put first where an example has no system message;
- the tokenizer's chat template, else `--chat_template` (chatml, zephyr, or a Jinja file; chatml when
  the tokenizer has none); a shipped template's special tokens are added and the embeddings grown
  to fit; the template is saved with the tokenizer, and the end-of-turn token joins EOS as a stop
  token in the saved generation config, so the model stops after its answer;
- the loss on every assistant turn, end-of-turn token included, and on nothing else
  (`--train_on_prompt true` trains every token); examples longer than `--max_length` are truncated,
  and those left with no answer token are dropped and counted (most of the data: an error);
- `--packing none` (default, one example per row) or `bfd` (whole examples, kept apart);
- evaluation: loss and perplexity on answer tokens, and greedy answers to `--num_sample_prompts`
  validation examples with their exact_match against the reference.
Everything else (trainers, DDP/ZeRO, resume, tracking, Hub) is the causal-LM task's.
Does not support: `--packing wrapped` (it cuts examples apart), tool calls, multimodal messages.
"""

import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import is_deepspeed_zero3_enabled

from cloudtrain import invocation
from cloudtrain.config import Config, DataConfig
from cloudtrain.data.chat import ChatFormat, Columns, detect_columns, last_answer, to_messages
from cloudtrain.data.mixture import skip_or_stop
from cloudtrain.data.packing import CausalLMCollator, pack_examples
from cloudtrain.data.processing import ProcessedData, cache_key, cached_map, first_rows
from cloudtrain.data.shards import made_with
from cloudtrain.data.streaming import MOST_CUT, Cut, Refused, StreamPlan, stream_plan
from cloudtrain.errors import UserError, first_line
from cloudtrain.generate import generate_texts
from cloudtrain.models.load import grow_embeddings, load_tokenizer
from cloudtrain.parallel.tensor import check_embeddings_fit
from cloudtrain.publish.lm_card import build_lm_model_card
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import EXAMPLES, TASK_ROWS
from cloudtrain.tasks.causal_lm import CausalLMTask

ANSWER_BATCH = 16  # sample answers generated this many at a time
ROW_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "seq_lengths": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
    }
)


def _stream_encoder(chat: ChatFormat, columns: Columns, cfg: DataConfig) -> Callable:
    """Streamed records -> per record, its examples (token ids, answer mask) cut to --max_length; a record the
    chat format refuses is `Refused` (the stream warns and counts it), an example left with no answer token trains
    nothing."""
    system, train_on_prompt, limit = cfg.system_prompt, cfg.train_on_prompt, cfg.max_length

    def encode(records: list[dict]) -> list[list[tuple[list[int], list[int]]]]:
        out: list[list[tuple[list[int], list[int]]]] = []
        for record in records:
            try:
                examples = chat.examples(to_messages(record, columns, system))
            except (ValueError, KeyError, TypeError) as err:
                why = f"no column {err.args[0]!r}" if isinstance(err, KeyError) else first_line(err)
                out.append(Refused(why))  # said and counted by the stream (--on_bad_data)
                continue
            cut = [(ids[:limit], mask[:limit]) for ids, mask in examples]
            kept = [(ids, mask) for ids, mask in cut if any(mask[1:])]  # by its answer, whatever trains
            out.append(
                Cut([(ids, [1] * len(ids)) for ids, _ in kept] if train_on_prompt else kept, len(cut) - len(kept))
            )
        return out

    return encode


def of_conversations(examples: Dataset, conversations: list[int]) -> Dataset:
    """The examples of these conversations (an example's `conversation`: its row's index in the data encoded)."""
    owners = examples["conversation"]  # read once: a column of every example
    if owners == conversations:
        return examples  # one example per conversation, all kept
    keep = set(conversations)
    return examples.select([i for i, c in enumerate(owners) if c in keep])


@TASKS.register
class SFTTask(CausalLMTask):
    name = "sft"
    summary = "supervised fine-tuning of a decoder on conversations or prompt/completion pairs, with a chat template"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("loss", "perplexity", "exact_match")
    lower_is_better = frozenset({"loss", "perplexity"})
    default_packing = "none"
    chat_template = True
    stream_records = EXAMPLES
    stream_options: tuple[str, ...] = (
        "max_length",
        "messages_column",
        "prompt_column",
        "completion_column",
        "system_prompt",
        "chat_template",
        "train_on_prompt",
    )

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.chat: ChatFormat | None = None
        self.questions: list[str] = []  # the last user message of each sample prompt, for tables
        self.report: dict[str, dict] = {}  # per split: examples, truncated, dropped

    # ------------------------------------------------------------ options and data
    def check_options(self, cfg: Config) -> None:
        super().check_options(cfg)
        if cfg.data.packing == "wrapped":
            raise UserError(
                "--task sft packs whole examples: use --packing none (the default) or bfd; wrapped "
                "would cut examples apart"
            )
        if cfg.checkpoint.metric_for_best_model == "exact_match" and (
            cfg.data.sample_prompts or not cfg.data.num_sample_prompts
        ):
            raise UserError(
                "--metric_for_best_model exact_match compares sample answers with validation references: "
                "set --num_sample_prompts N (and no --sample_prompts), or pick loss"
            )
        tokenizer = load_tokenizer(cfg.model)
        size = len(tokenizer)
        ChatFormat.setup(tokenizer, cfg.data.chat_template)  # a bad template fails here
        self.added_tokens = len(tokenizer) - size  # (what train_in_full reads when adapters are checked)
        if cfg.distributed.tensor_parallel_size > 1:  # the template's tokens need rows a sharded model cannot grow
            check_embeddings_fit(tokenizer, self.model_config(cfg), cfg.distributed.tensor_parallel_size)

    text_names = ("prompt", "completion", "instruction", "input", "output")  # chat.detect_columns finds these

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        named = {
            "--messages_column": cfg.messages_column,
            "--prompt_column": cfg.prompt_column,
            "--completion_column": cfg.completion_column,
        }
        return {flag: (column, True) for flag, column in named.items() if column}

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        """Rows -> messages -> (token ids, loss mask) -> truncated -> packed rows; validation carved by example."""
        self.cfg, self.tokenizer = cfg, tokenizer
        d = cfg.data
        size = len(tokenizer)
        self.chat = ChatFormat.setup(tokenizer, d.chat_template)
        self.added_tokens = len(tokenizer) - size
        columns = detect_columns(raw["train"].column_names, d.messages_column, d.prompt_column, d.completion_column)
        for split, ds in raw.items():
            missing = [c for c in columns.names if c not in ds.column_names and c != "input"]
            if missing:
                raise UserError(
                    f"the {split} data has no column {missing[0]!r} (its columns: {', '.join(ds.column_names)})"
                )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        static = cfg.training.torch_compile and cfg.model.compile_layers  # one shape for the compiled layers
        collator = CausalLMCollator(
            pad if pad is not None else 0, cu_seqlens=d.packing == "bfd", pad_to=d.max_length if static else None
        )
        plan = None
        if d.streaming:  # training examples are encoded and packed on the fly (cloudtrain.data.streaming)
            plan, held_out = stream_plan(
                raw, cfg, self.stream_encoder(columns, d), collator, made_with(self, tokenizer, d)
            )
            raw = DatasetDict({split: ds for split, ds in raw.items() if split != "train"})
            if held_out is not None:
                held_out = self._answerable(held_out, columns, d)
                names = [c for c in columns.names if any(c in r for r in held_out)]
                raw["validation"] = Dataset.from_list([{c: r.get(c) for c in names} for r in held_out])
        raw = DatasetDict(raw)
        examples = {split: self._encode(ds, split, columns, d) for split, ds in raw.items()}  # checks every row
        # Each split's conversations, by their index in the data encoded: a template that renders each answer
        # apart (Qwen3's) gives a conversation several examples, so splits and limits count conversations.
        kept = {split: list(range(len(ds))) for split, ds in raw.items()}
        if "validation" not in raw:  # carved from both alike, so sample prompts match the rows
            train, validation = self._carve_indices(len(raw["train"]), d.validation_split_percentage, cfg.training.seed)
            raw["train"], raw["validation"] = raw["train"].select(train), raw["train"].select(validation)
            examples["validation"], kept["train"], kept["validation"] = examples["train"], train, validation
            if d.train_on_prompt:  # the training examples' masks hold the prompts: evaluation's must not
                examples["validation"] = self._encode(raw["validation"], "validation", columns, d)
                kept["validation"] = list(range(len(raw["validation"])))
        for split, limit in (
            ("train", d.max_train_samples),
            ("validation", d.max_eval_samples),
            ("test", d.max_eval_samples),
        ):
            if split in raw and not (split == "train" and plan is not None):
                raw[split], kept[split] = first_rows(raw[split], limit), kept[split][:limit]
        rows = {split: self._rows(split, of_conversations(ds, kept[split]), d) for split, ds in examples.items()}
        self._sample_prompts(raw["validation"], columns, cfg)
        return ProcessedData(
            train=plan if plan is not None else rows["train"],
            validation=rows["validation"],
            test=rows.get("test"),
            collator=collator,
            prompts=self.prompts,
            references=self.references,
        )

    @classmethod
    def preprocess_encoder(
        cls, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, first: dict
    ) -> tuple[Callable, list[str]]:
        """The columns are detected from the first record, as training detects them from the data's."""
        columns = detect_columns(list(first), cfg.messages_column, cfg.prompt_column, cfg.completion_column)
        encode = _stream_encoder(ChatFormat.setup(tokenizer, cfg.chat_template), columns, cfg)
        return encode, [c for c in columns.names if c in first]

    def stream_encoder(self, columns: Columns, cfg: DataConfig) -> Callable:  # type: ignore[override]
        """`_stream_encoder` with the chat format `process` set up."""
        assert self.chat is not None
        return _stream_encoder(self.chat, columns, cfg)

    def _answerable(self, records: list[dict], columns: Columns, cfg: DataConfig) -> list[dict]:
        """The stream's held-out validation records the chat format takes: one it refuses is skipped with a warning
        or stops the run, as --on_bad_data says for the training records."""
        assert self.chat is not None
        kept, encode = [], _stream_encoder(self.chat, columns, cfg)
        for i, record in enumerate(records):
            refused = encode([record])[0]
            if not isinstance(refused, Refused):
                kept.append(record)
                continue
            skip_or_stop(f"held-out validation record {i} of the stream", refused.why, cfg.on_bad_data)
        if not kept:
            raise UserError(
                f"the chat format refuses every one of the stream's {len(records)} held-out validation records: "
                "give --validation_file, or a larger --stream_validation_docs"
            )
        return kept

    @staticmethod
    def _carve_indices(n: int, percentage: float, seed: int) -> tuple[list[int], list[int]]:
        """(train, validation) example indices: a seeded share of the examples for validation."""
        n_val = math.ceil(n * percentage / 100)
        if n_val >= n:
            raise UserError(
                f"the training data has only {n} example(s), too few to carve a validation split; "
                "give --validation_file or more examples"
            )
        order = np.random.default_rng(seed).permutation(n)
        return sorted(order[n_val:].tolist()), sorted(order[:n_val].tolist())

    def _encode(self, ds: Dataset, split: str, columns: Columns, cfg: DataConfig) -> Dataset:
        """(input_ids, answer mask) per example, every example checked; cached by data, tokenizer and template.
        (--train_on_prompt acts on the rows: an example is kept or dropped by its answer all the same.)"""
        chat, system = self.chat, cfg.system_prompt
        assert chat is not None and self.tokenizer is not None  # both set by `process`

        def encode(batch: dict, indices: list[int]) -> dict:
            ids, masks, conversations = [], [], []
            for i, index in enumerate(indices):
                try:
                    examples = chat.examples(to_messages({c: batch[c][i] for c in batch}, columns, system))
                except ValueError as err:
                    raise UserError(f"{split} example {index}: {err}") from None
                ids += [example_ids for example_ids, _ in examples]
                masks += [mask for _, mask in examples]
                conversations += [index] * len(examples)
            return {"input_ids": ids, "loss_mask": masks, "conversation": conversations}

        # The template writes BOS/EOS by their strings: two tokenizers with one vocabulary may differ there.
        key = cache_key(
            ds,
            self.tokenizer,
            columns.format,
            *columns.names,
            system,
            self.tokenizer.chat_template,
            self.tokenizer.special_tokens_map,
            "sft-v4",
        )
        features = datasets.Features(
            {"input_ids": ROW_FEATURES["input_ids"], "loss_mask": ROW_FEATURES["loss_mask"],
             "conversation": datasets.Value("int64")}
        )  # fmt: skip
        desc = f"Tokenizing {split} with the chat template"
        return cached_map(ds, encode, features, cfg, f"sft-{split}", key, desc, with_indices=True)

    def _rows(self, split: str, examples: Dataset, cfg: DataConfig) -> Dataset:
        """Examples cut to --max_length, those left with no answer token dropped (and counted), then packed;
        --train_on_prompt marks every token of a training row."""
        limit, ids, masks = cfg.max_length, [], []
        truncated = answers = 0
        for example_ids, mask in zip(examples["input_ids"], examples["loss_mask"], strict=True):
            truncated += len(example_ids) > limit
            example_ids, mask = example_ids[:limit], mask[:limit]
            if any(mask[1:]):  # a row's first token is never a target
                answers += sum(mask[1:])
                ids.append(example_ids)
                masks.append([1] * len(mask) if cfg.train_on_prompt and split == "train" else mask)
        dropped = len(examples) - len(ids)
        self.report[split] = {"examples": len(examples), "truncated": truncated, "dropped": dropped, "answers": answers}
        if dropped > MOST_CUT * len(examples) or not ids:
            longest = max(len(x) for x in examples["input_ids"])
            raise UserError(
                f"{dropped} of {len(examples)} {split} examples have no answer token within --max_length "
                f"{limit} (the longest example is {longest} tokens); raise --max_length or shorten the "
                "prompts"
            )
        return Dataset.from_list(pack_examples(ids, masks, limit, cfg.packing), features=ROW_FEATURES)

    def _sample_prompts(self, validation: Dataset, columns: Columns, cfg: Config) -> None:
        """--sample_prompts as one-turn chats, else the first validation examples (up to their last answer)
        whose prompt leaves room for --sample_max_new_tokens within --max_length."""
        room = cfg.data.max_length - cfg.training.sample_max_new_tokens
        tokenizer, chat_format = self.tokenizer, self.chat
        assert tokenizer is not None and chat_format is not None  # both set by `process`

        def fits(chat: list[dict]) -> bool:
            return len(tokenizer(chat_format.prompt(chat), add_special_tokens=False)["input_ids"]) <= room

        system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
        self.prompts, self.references, self.questions = [], [], []
        if cfg.data.sample_prompts:
            chats = [[*system, {"role": "user", "content": p}] for p in cfg.data.sample_prompts]
            too_long = next((chat[-1]["content"] for chat in chats if not fits(chat)), None)
            if too_long is not None:
                raise UserError(
                    f"--sample_prompts {too_long[:40]!r}... leaves no room for --sample_max_new_tokens "
                    f"{cfg.training.sample_max_new_tokens} within --max_length {cfg.data.max_length}"
                )
        else:
            chats = []
            for row in validation:
                if len(chats) == cfg.data.num_sample_prompts:
                    break
                chat = to_messages(row, columns, cfg.data.system_prompt)
                if fits(chat):
                    chats.append(chat)
                    self.references.append(chat[last_answer(chat)]["content"])
        self.prompts = [chat_format.prompt(chat) for chat in chats]
        self.questions = [last_question(chat) for chat in chats]
        check_prompts_fit(self.prompts, cfg)

    # ------------------------------------------------------------ the model
    def fit_model(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: Config, announce: bool
    ) -> None:
        """Embedding rows for the chat template's new tokens; generation stops at the end of a turn."""
        weight: Any = model.get_input_embeddings().weight
        rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 partitions the weight
        if len(tokenizer) > rows:
            # a multiple of 64 suits matmul kernels; an adapter's base grows to len(tokenizer) exactly, as
            # PEFT's AutoPeftModel... grows it when loading the adapter
            grow_embeddings(model, len(tokenizer), pad_to_multiple_of=None if cfg.model.peft != "none" else 64)
            if announce:
                print(
                    f"grew the embeddings from {rows} to {model.get_input_embeddings().num_embeddings} rows for "
                    f"the chat template's tokens ({', '.join(_added(tokenizer, self.added_tokens))}); they train "
                    "with the model",
                    flush=True,
                )
        assert self.chat is not None  # set by `process`
        stops = [self.chat.end_of_turn_id, tokenizer.eos_token_id]
        model.generation_config.eos_token_id = list(dict.fromkeys(t for t in stops if t is not None))
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    def train_in_full(self, model: PreTrainedModel) -> list[str]:
        """New tokens need their embedding rows (and output rows) trained, which adapters alone cannot do."""
        if not self.added_tokens:  # also when they fit in rows the embeddings had spare: those are untrained
            return []
        names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
        return list(
            dict.fromkeys(
                names[m] for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            )
        )

    # ------------------------------------------------------------ evaluation
    def samples(self, model: torch.nn.Module, data: ProcessedData) -> dict:
        answers = generate_texts(
            model,
            self.tokenizer,
            data.prompts,
            add_special_tokens=False,
            max_new_tokens=self.cfg.training.sample_max_new_tokens,
            synced_gpus=is_deepspeed_zero3_enabled(),
            batch_size=ANSWER_BATCH,
        )
        answers = [a.strip() for a in answers]
        generations = [{"question": q, "answer": a} for q, a in zip(self.questions, answers, strict=True)]
        result: dict[str, Any] = {"generations": generations}
        if data.references:  # none for --sample_prompts
            for generation, reference in zip(generations, data.references, strict=True):
                generation["reference"] = reference
            matches = sum(a == r.strip() for a, r in zip(answers, data.references, strict=True))
            result["exact_match"] = matches / len(answers)
        return result

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        generations = metrics.get("generations") or []
        if not generations:
            return {}
        header = [key for key in ("question", "reference", "answer") if key in generations[0]]
        return {"answers": (header, [[g[key] for key in header] for g in generations])}

    # ------------------------------------------------------------ summaries
    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_lm_model_card(output_dir, cfg, results, chat=True)

    def describe_data(self, data: ProcessedData) -> str:
        from cloudtrain.tasks.causal_lm import describe_stream

        parts = []
        if isinstance(data.train, StreamPlan):
            parts.append(describe_stream(data.train, data.validation, self.cfg).removeprefix("data: "))
        for split, rows in (("train", data.train), ("validation", data.validation), ("test", data.test)):
            if rows is None or isinstance(rows, StreamPlan):
                continue
            trained = sum(
                _targets(mask, lengths) for mask, lengths in zip(rows["loss_mask"], rows["seq_lengths"], strict=True)
            )
            tokens = sum(len(ids) for ids in rows["input_ids"])
            report = self.report[split]
            of = f"{report['answers']} answer tokens" + (f", {trained} trained" if trained != report["answers"] else "")
            parts.append(
                f"{report['examples'] - report['dropped']} {split} examples in {len(rows)} rows ({of} of {tokens})"
            )
        notes = [
            f"{r['truncated']} {split} examples cut to --max_length {self.cfg.data.max_length}"
            + (f", {r['dropped']} of them dropped (no answer token left)" if r["dropped"] else "")
            for split, r in self.report.items()
            if r["truncated"]
        ]
        if self.cfg.data.num_sample_prompts and not data.prompts:  # every validation prompt is longer than the room
            notes.append(no_prompt_fits(self.cfg))
        assert self.chat is not None  # set by `process`
        return f"data: {'; '.join(parts)}; template: {self.chat.source}; packing {self.cfg.data.packing}" + "".join(
            f"\nnote: {n}" for n in notes
        )

    def describe_metrics(self, metrics: dict) -> str:
        line = (
            f"loss {metrics['loss']:.4f} | perplexity {metrics['perplexity']:.2f} ({metrics['tokens']} answer tokens)"
        )
        if "exact_match" in metrics:
            line += f" | exact_match {metrics['exact_match']:.3f} ({len(metrics['generations'])} answers)"
        for g in metrics.get("generations", [])[:3]:
            line += f"\n  {shortened(g['question'])} -> {json.dumps(g['answer'], ensure_ascii=False)}"
            if "reference" in g:
                line += f" (reference {json.dumps(g['reference'], ensure_ascii=False)})"
        return line

    def inference_hint(self, output_dir: str) -> str:
        return f"{invocation.command()} generate --model_dir {shlex.quote(output_dir)} --chat"


def _targets(mask: list[int], lengths: list[int]) -> int:
    """The tokens of a row the loss is taken on: marked, and not the first of an example (the collator's rule)."""
    starts, total = set(), 0
    for length in lengths:
        starts.add(total)
        total += length
    return sum(m for i, m in enumerate(mask) if i not in starts)


def no_prompt_fits(cfg: Config) -> str:
    """Why evaluations hold no sample answers: no validation prompt leaves room for the answer's tokens."""
    new_tokens, length = cfg.training.sample_max_new_tokens, cfg.data.max_length
    room = (
        f"fits in {length - new_tokens} tokens (--max_length {length} less --sample_max_new_tokens {new_tokens})"
        if new_tokens < length
        else f"fits: --sample_max_new_tokens {new_tokens} leaves no room within --max_length {length}"
    )
    return (
        f"no validation prompt {room}, so evaluations show no sample answers or exact_match: raise --max_length or "
        "lower --sample_max_new_tokens"
    )


def check_prompts_fit(prompts: list[str], cfg: Config) -> None:
    """Refuse, before training, a run whose best checkpoint would be chosen by an exact_match never computed."""
    if not prompts and cfg.checkpoint.metric_for_best_model == "exact_match":
        raise UserError(f"--metric_for_best_model exact_match: {no_prompt_fits(cfg)}, or pick loss")


def last_question(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages[: last_answer(messages)]) if m["role"] == "user"), "")


def shortened(text: str, head: int = 24, tail: int = 45) -> str:
    """`text` on one line, its middle elided when long (questions often share their opening)."""
    text = " ".join(text.split())
    return json.dumps(text if len(text) <= head + tail + 1 else f"{text[:head]}…{text[-tail:]}", ensure_ascii=False)


def _added(tokenizer: PreTrainedTokenizerBase, count: int) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer) - count, len(tokenizer))))  # type: ignore[return-value]
