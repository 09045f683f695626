"""Causal language modelling (`--task causal_lm`): continued pretraining, or pretraining from scratch,
of a decoder on raw text.

Supports:
- text from .txt files (one document per line), csv/json/jsonl/parquet (`--text_column`), a
  save_to_disk directory or a Hub dataset; each document tokenized, EOS appended, then packed into rows
  of `--max_length` tokens (`--packing`, see cloudtrain.data.packing): wrapped (concatenate and cut), bfd
  (whole documents, isolated by restarting position_ids; refused when the model's attention cannot
  isolate them) or none (one document per row);
- a pretrained checkpoint (`--model_name_or_path`: anything AutoModelForCausalLM loads) or a model
  built from `--model_config` (a config.json or a shipped preset) with `--tokenizer_name_or_path`,
  weights initialised from the seed; a tokenizer without a pad token, with no vocabulary resizing;
- the loss as (summed next-token cross-entropy, target tokens), so a step's loss is the mean over
  every target token of the step; evaluation: token-weighted loss, perplexity, and greedy
  continuations of a few prompts (`--sample_prompts`, default: openings of validation documents).
Does not support: chat templates and prompt masking (supervised fine-tuning), encoder-decoder models.
"""

import copy
import json
import math
import shlex
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import datasets
import torch
import torch.nn.functional as F
import transformers
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import is_deepspeed_zero3_enabled

from cloudtrain import invocation
from cloudtrain.config import Config, DataConfig
from cloudtrain.data.packing import (
    IGNORE_INDEX,
    CausalLMCollator,
    causal_lm_forward,
    forward_inputs,
    isolation_error,
    pack,
    shifted_loss,
    target_loss,
)
from cloudtrain.data.processing import ProcessedData, cache_key, cached_map, first_rows
from cloudtrain.data.shards import made_with
from cloudtrain.data.streaming import StreamPlan, check_streaming, stream_plan
from cloudtrain.errors import UserError, first_line
from cloudtrain.evaluation import eval_mode
from cloudtrain.generate import generate_texts
from cloudtrain.models.attention import VARLEN
from cloudtrain.models.kernels import hidden_states, linear_cross_entropy, output_head
from cloudtrain.models.load import (
    CONFIG_ERRORS,
    check_checkpoint,
    check_positions,
    check_sizes,
    context_length,
    is_causal_lm,
    load_failure,
    read_config,
)
from cloudtrain.observe import console
from cloudtrain.paths import resolve_model_path
from cloudtrain.publish.lm_card import build_lm_model_card
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.base import DecoderTask

PRESETS_DIR = Path(__file__).resolve().parents[1] / "model_presets"
PROMPT_TOKENS = 12  # the default sample prompts: this many tokens of a few validation documents


def presets() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def model_config_file(name: str) -> Path:
    """--model_config as a file: a path to a config.json, or a shipped preset's name."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if (PRESETS_DIR / f"{name}.json").is_file():
        return PRESETS_DIR / f"{name}.json"
    raise UserError(f"--model_config {name} is neither a config.json file nor a preset ({', '.join(presets())})")


@TASKS.register
class CausalLMTask(DecoderTask):
    name = "causal_lm"
    summary = "continued pretraining, or pretraining from scratch, of a decoder on raw text"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("loss", "perplexity")
    lower_is_better = frozenset(metrics)
    default_best_metric = "loss"
    default_packing = "wrapped"
    auto_class = AutoModelForCausalLM
    load_error = "could not build the causal language model"
    peft_task_type = "CAUSAL_LM"
    added_tokens = 0  # tokens the task adds to the tokenizer, and so to the model's vocabulary
    streams_data = True
    bounds_length = True
    stream_options: tuple[str, ...] = ("text_column",)
    packed_attention = True  # bfd batches carry their documents' lengths, and `loss` passes them (varlen attention)
    tensor_parallel = True
    context_parallel = True
    embedding_noise = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.cfg: Config = cfg
        self.tokenizer: PreTrainedTokenizerBase | None = None  # set by `process`, used for sample generations
        self.loss_kernel: str | None = None  # --fused_cross_entropy's backend, set by models.prepare
        self.context: int | None = None  # the model's position count (None: relative), set by `check_options`

    # ------------------------------------------------------------ options and data
    def check_options(self, cfg: Config) -> None:
        m = cfg.model
        if cfg.data.streaming:
            check_streaming(cfg)
        if not m.model_name_or_path and not m.model_config:
            raise UserError(
                f"--task {self.name} needs a decoder: --model_name_or_path <causal LM> to train on, or "
                f"--model_config <config.json or preset: {', '.join(presets())}> with --tokenizer_name_or_path to "
                "start from random weights"
            )
        if m.model_name_or_path:
            check_checkpoint(resolve_model_path(m), "--model_name_or_path")
        config = self.model_config(cfg)
        if not is_causal_lm(config):
            kind = ", ".join(config.architectures or [config.model_type])
            hint = (
                "; use --task classification" if any("Classification" in a for a in config.architectures or []) else ""
            )
            raise UserError(
                f"{m.model_name_or_path or m.model_config} is not a causal language model ({kind}); "
                f"--task {self.name} needs one that AutoModelForCausalLM loads (…ForCausalLM){hint}"
            )
        check_positions(config, cfg.data.max_length)  # before the data is read and tokenized
        self.context = context_length(config)

    def model_config(self, cfg: Config) -> transformers.PretrainedConfig:
        m = cfg.model
        if not m.model_config:
            return read_config(m)
        source = str(model_config_file(m.model_config))
        try:
            return AutoConfig.from_pretrained(source, trust_remote_code=m.trust_remote_code)
        except CONFIG_ERRORS as err:
            raise load_failure(err, f"the model config {source}", source) from None

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        return {"--text_column": (cfg.text_column, True)}

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        """Documents -> token ids (+EOS) -> rows of --max_length tokens; validation carved by document.
        Streaming: the training rows are a StreamPlan, packed on the fly (cloudtrain.data.streaming)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        d = cfg.data
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        static = cfg.training.torch_compile and cfg.model.compile_layers  # one shape for the compiled layers
        collator = CausalLMCollator(
            pad if pad is not None else 0, cu_seqlens=d.packing == "bfd", pad_to=d.max_length if static else None
        )
        plan = None
        if d.streaming:
            plan, held_out = stream_plan(
                raw, cfg, self.stream_encoder(tokenizer, d), collator, made_with(self, tokenizer, d)
            )
            raw = DatasetDict({split: ds for split, ds in raw.items() if split != "train"})
            if held_out is not None:
                # as the stream's encoder reads them: a number is its text (Arrow refused a column of texts and
                # numbers; found in audit), a missing text an empty document
                texts = [{d.text_column: str(r.get(d.text_column) or "")} for r in held_out]
                if not any(t[d.text_column].strip() for t in texts):  # "pass --text_column" misled (audit)
                    raise UserError(
                        f"the {len(texts)} documents held out of the stream for validation (--stream_validation_docs "
                        f"{d.stream_validation_docs}) are all empty in column {d.text_column!r}; raise "
                        "--stream_validation_docs, or give a --validation_file"
                    )
                raw["validation"] = Dataset.from_list(texts)
        docs = {split: self._tokenize(ds, split, tokenizer, d) for split, ds in raw.items()}
        if "validation" not in docs:
            docs["train"], docs["validation"] = self._carve(
                docs["train"], d.validation_split_percentage, cfg.training.seed
            )
        if plan is None:
            docs["train"] = first_rows(docs["train"], d.max_train_samples)
        for split in ("validation", "test"):
            if split in docs:
                docs[split] = first_rows(docs[split], d.max_eval_samples)
        rows = {split: _rows(split_docs, d.max_length, d.packing) for split, split_docs in docs.items()}
        prompts = (
            list(d.sample_prompts)
            or [
                tokenizer.decode(doc[:PROMPT_TOKENS], skip_special_tokens=True).strip()  # type: ignore[union-attr]
                for doc in docs["validation"]["input_ids"][: d.num_sample_prompts]
            ]
        )
        prompts = [p for p in prompts if p]
        self._check_sample_lengths(tokenizer, prompts, cfg.training.sample_max_new_tokens)
        return ProcessedData(
            train=plan if plan is not None else rows["train"],
            validation=rows["validation"],
            test=rows.get("test"),
            collator=collator,
            prompts=prompts,
        )

    def _check_sample_lengths(self, tokenizer: PreTrainedTokenizerBase, prompts: list[str], new_tokens: int) -> None:
        """Each sample prompt and its continuation fit the model's positions, before training: past them, learned
        positions failed at the first evaluation with an IndexError, and RoPE's went on for minutes (audit)."""
        if not self.context or not prompts:
            return
        longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in prompts)
        if longest + new_tokens <= self.context:
            return
        room = self.context - longest
        fix = f"pass --sample_max_new_tokens {room} or less" if room > 0 else "give shorter --sample_prompts"
        raise UserError(
            f"a sample prompt of {console.counted(longest, 'token')} and --sample_max_new_tokens {new_tokens} exceed "
            f"the model's context ({self.context} positions); {fix}"
        )

    @classmethod
    def preprocess_encoder(
        cls, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, first: dict
    ) -> tuple[Callable, list[str]]:
        return cls.stream_encoder(tokenizer, cfg), [cfg.text_column]

    @staticmethod
    def stream_encoder(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Callable:
        """Streamed records -> per record, one document (token ids + EOS), or none for an empty text."""
        column, eos = cfg.text_column, tokenizer.eos_token_id

        def encode(records: list[dict]) -> list[list[tuple[list[int], None]]]:
            texts = [str(r.get(column) or "") for r in records]
            keep = [i for i, text in enumerate(texts) if text.strip()]
            ids = tokenizer([texts[i] for i in keep])["input_ids"] if keep else []
            out: list[list[tuple[list[int], None]]] = [[] for _ in records]
            for i, doc in zip(keep, ids, strict=True):
                out[i] = [(doc + [eos] if eos is not None and doc[-1:] != [eos] else doc, None)]
            return out

        return encode

    def _tokenize(self, ds: Dataset, split: str, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> Dataset:
        """One row of token ids per non-empty document, EOS appended; cached like classification's."""
        column, eos = cfg.text_column, tokenizer.eos_token_id
        ds = ds.filter(
            lambda batch: [bool(t and str(t).strip()) for t in batch[column]],
            batched=True,
            desc=f"Dropping empty {split} rows",
        )
        if len(ds) == 0:
            raise UserError(
                f"the {split} data has no text in column {column!r} (every row is empty); "
                "give a corpus with text, or pass --text_column <name>"
            )

        def encode(batch: dict) -> dict:
            ids = tokenizer([str(t) for t in batch[column]])["input_ids"]
            return {"input_ids": [doc + [eos] if eos is not None and doc[-1:] != [eos] else doc for doc in ids]}

        key = cache_key(ds, tokenizer, column, eos, "lm-v1")
        features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
        return cached_map(ds, encode, features, cfg, f"lm-{split}", key, f"Tokenizing {split}")

    @staticmethod
    def _carve(docs: Dataset, percentage: float, seed: int) -> tuple[Dataset, Dataset]:
        n_val = math.ceil(len(docs) * percentage / 100)
        if n_val >= len(docs):
            raise UserError(
                f"the training data has only {len(docs)} document(s), too few to carve a validation "
                "split by document; give --validation_file or more documents"
            )
        parts = docs.train_test_split(test_size=n_val, seed=seed)
        return parts["train"], parts["test"]

    # ------------------------------------------------------------ the model
    def build_config(
        self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase
    ) -> transformers.PretrainedConfig:
        """The decoder's config (a preset fitted to the tokenizer), checked against the tokenizer and --max_length."""
        config = self.model_config(cfg)
        if cfg.model.model_config:
            self.fit_config(config, tokenizer, cfg.model.model_config)
        check_sizes(config, tokenizer, cfg.data.max_length, self.added_tokens)
        return config

    @staticmethod
    def fit_config(config: transformers.PretrainedConfig, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        """A preset takes its vocabulary and special tokens from the tokenizer; a user's config.json keeps those it
        sets, and takes the others from the tokenizer too (the config class's defaults, Llama's 32000 tokens and
        eos id 2, mean another tokenizer)."""
        path = Path(name).expanduser()
        given = set(json.loads(path.read_text())) if path.is_file() else set()
        fitted = {
            "vocab_size": math.ceil(len(tokenizer) / 64) * 64,  # a multiple of 64 suits matmul kernels
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        for key, value in fitted.items():
            if key not in given:
                setattr(config, key, value)

    def check_model(self, model: PreTrainedModel, cfg: Config, announce: bool) -> None:
        """Under --packing bfd: the model keeps packed documents apart with the kernels the run computes with,
        probed on this process's copy (CPU), and on the GPU with a one-layer copy in bf16, or the run stops."""
        if cfg.data.packing != "bfd":
            return
        if is_deepspeed_zero3_enabled():  # partitioned weights cannot run a probe before the engine exists
            if announce:
                print("note: document isolation of --packing bfd was not probed under ZeRO-3", flush=True)
            return
        probes: list[tuple[str, Callable[[], PreTrainedModel]]] = [] if _needs_cuda(model) else [("", lambda: model)]
        if torch.cuda.is_available():
            probes.append((" on the GPU (bf16)", lambda: one_layer_copy(model, "cuda", torch.bfloat16)))
        if not probes:
            raise UserError(
                f"--attn_implementation {model.config._attn_implementation} needs a GPU; this machine has none"
            )
        for where, probed in probes:
            try:
                problem = isolation_error(probed())
            except (RuntimeError, NotImplementedError, ValueError, ImportError, TypeError) as err:
                problem = f"its attention {model.config._attn_implementation!r} did not run ({first_line(err)})"
            if problem:  # cloudtrain's varlen kernels keep documents apart whatever the model does with positions
                varlen = "" if model.config._attn_implementation == VARLEN else ", or --attn_implementation varlen"
                raise UserError(f"--packing bfd: {problem}{where}; use --packing wrapped or none{varlen}")

    # ------------------------------------------------------------ loss and evaluation
    def loss_count(self, batch: dict) -> torch.Tensor:
        return (next_targets(batch) != IGNORE_INDEX).sum()

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = self.loss_kernel
        head = output_head(model) if kernel else None
        # An adapter on the head (PEFT's own module) is more than its weight: the plain path then.
        smoothing = self.smoothing()
        if kernel is None or head is None or type(head) is not torch.nn.Linear:
            if "targets" in batch:  # a context-parallel slice: its targets were shifted before the cut
                return target_loss(causal_lm_forward(model, batch), batch["targets"], smoothing)
            return self.logits_loss(causal_lm_forward(model, batch), batch["labels"], smoothing)
        # --fused_cross_entropy: from the hidden states, the logits never held whole
        hidden = hidden_states(model, forward_inputs(model, batch))
        return self.head_loss(predicting(hidden, batch), head, next_targets(batch).to(hidden.device), smoothing)

    def head_loss(
        self, hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, smoothing: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) of [B, T, h] hidden states through `head` against their [B, T] targets by the loss
        kernel (`use_loss_kernel`): the logits are never held whole. A pipeline's last stage calls it too."""
        assert self.loss_kernel is not None
        weight, bias = cast(torch.Tensor, head.weight), cast("torch.Tensor | None", head.bias)
        total = linear_cross_entropy(
            self.loss_kernel, hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), smoothing
        )
        return total, (targets != IGNORE_INDEX).sum()

    def use_loss_kernel(self, backend: str | None) -> bool:
        """Compute the training loss with `backend` (cloudtrain.models.kernels), or plainly (None); False where
        this task's loss is its own (DPO)."""
        if type(self).loss is not CausalLMTask.loss:
            return False
        self.loss_kernel = backend
        return True

    def logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, count) from the logits (a pipeline's last stage computes them, not `loss`)."""
        return shifted_loss(logits, labels, smoothing)

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
        """Token-weighted loss and perplexity over every row exactly once; then the sample generations."""
        with eval_mode(model):
            start = time.perf_counter()
            loss_sum = tokens = rows = 0.0
            for batch in batches:
                batch = move(batch)
                with autocast():
                    logits = causal_lm_forward(model, batch)
                targets = next_targets(batch)
                per_token = F.cross_entropy(
                    predicting(logits, batch).float().transpose(1, 2),
                    targets,
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                )
                row_sums, row_counts = gather((per_token.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)))
                loss_sum += row_sums.double().sum().item()
                tokens += row_counts.sum().item()
                rows += len(row_counts)
        result = self.loss_metrics(loss_sum, tokens, rows, time.perf_counter() - start)
        if data.prompts and self.tokenizer is not None:
            with autocast():  # as in the step: adapters' fp32 embeddings meet a 16-bit base
                result.update(self.samples(getattr(model, "module", model), data))  # DDP and DeepSpeed wrap it
        return result

    @staticmethod
    def loss_metrics(loss_sum: float, tokens: float, rows: float, seconds: float) -> dict:
        """Token-weighted loss and perplexity from the sums over a split (also a pipeline's evaluation)."""
        loss = loss_sum / max(tokens, 1)
        return {
            "loss": loss,
            "perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "tokens": int(tokens),
            "samples": int(rows),
            "runtime_s": round(seconds, 3),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        }

    def samples(self, model: torch.nn.Module, data: ProcessedData) -> dict:
        """The greedy continuations of the sample prompts (every process generates the same ones)."""
        continuations = generate_texts(
            model,
            self.tokenizer,
            data.prompts,
            max_new_tokens=self.cfg.training.sample_max_new_tokens,
            synced_gpus=is_deepspeed_zero3_enabled(),
        )
        return {
            "generations": [{"prompt": p, "continuation": c} for p, c in zip(data.prompts, continuations, strict=True)]
        }

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        if not metrics.get("generations"):
            return {}
        return {
            "generations": (
                ["prompt", "continuation"],
                [[g["prompt"], g["continuation"]] for g in metrics["generations"]],
            )
        }

    # ------------------------------------------------------------ summaries
    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_lm_model_card(output_dir, cfg, results)

    def describe_data(self, data: ProcessedData) -> str:
        if isinstance(data.train, StreamPlan):
            return describe_stream(data.train, data.validation, self.cfg)
        parts = [
            f"{len(rows)} {split} rows ({sum(sum(n) for n in rows['seq_lengths'])} tokens)"
            for split, rows in (("train", data.train), ("validation", data.validation), ("test", data.test))
            if rows is not None
        ]
        packing, block = self.cfg.data.packing, self.cfg.data.max_length
        fill = sum(sum(n) for n in data.train["seq_lengths"]) / (len(data.train) * block)
        return f"data: {', '.join(parts)}; packing {packing}, {block} tokens per row, {fill:.0%} filled"

    def describe_metrics(self, metrics: dict) -> str:
        line = f"loss {metrics['loss']:.4f} | perplexity {metrics['perplexity']:.2f} ({metrics['tokens']} tokens)"
        for g in metrics.get("generations", []):
            prompt = json.dumps(g["prompt"], ensure_ascii=False)
            continuation = json.dumps(g["continuation"], ensure_ascii=False)
            line += f"\n  {prompt} -> {continuation}"
        return line

    def inference_hint(self, output_dir: str) -> str:
        return f'{invocation.command()} generate --model_dir {shlex.quote(output_dir)} --prompt "..."'


def next_targets(batch: dict) -> torch.Tensor:
    """Each predicting position's target: a context-parallel slice's own `targets` (shifted before the cut,
    cloudtrain.parallel.context), else the next token of the row."""
    return batch["targets"] if "targets" in batch else batch["labels"][:, 1:]


def predicting(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """The positions of [B, L, ...] `values` that have a target in `next_targets` (a row's last one has none)."""
    return values if "targets" in batch else values[:, :-1]


def describe_stream(plan: StreamPlan, validation: Dataset, run: Config) -> str:
    """The data line of a streaming run: its sources and weights, and the stored validation rows."""
    cfg = run.data
    total = sum(source.weight for source in plan.sources) or 1.0
    sources = ", ".join(
        f"{s.name} ({len(s.files)} file(s){', packed rows' if s.packed else ''}, weight {s.weight / total:.2f})"
        for s in plan.sources
    )
    steps, tokens = plan.budget.get("max_steps"), plan.budget.get("max_tokens")
    notes = (
        [f"--max_steps {steps} sets the run's length; --max_tokens {tokens} is not used"] if steps and tokens else []
    )
    notes += _epochless(run)
    if len({s.packed for s in plan.sources if s.weight > 0}) > 1:
        notes.append(
            "a weight draws a packed row (a whole row of tokens) from a source of packed shards and a document from "
            "the others: weigh the sources by the tokens you want from each (train_results.json counts them)"
        )
    return (
        f"data: streaming {sources}; packing {cfg.packing} in buffers of {cfg.stream_buffer} documents"
        f"{f' or {cfg.stream_buffer_mb:g} MiB of text' if cfg.stream_buffer_mb else ''}, "
        f"{cfg.max_length} tokens per row; {len(validation)} validation rows"
    ) + "".join(f"\nnote: {note}" for note in notes)


def _epochless(run: Config) -> list[str]:
    """What an `epoch` schedule means on a stream, which has no epochs: the run's end only (found in audit: a long
    stream at the default --eval_strategy epoch evaluated once, at its end, without a word)."""
    said = []
    if run.training.eval_strategy == "epoch":
        said.append("a stream has no epochs: --eval_strategy epoch evaluates at the run's end only; "
                    "--eval_strategy steps --eval_steps N evaluates along the way")  # fmt: skip
    if run.checkpoint.checkpointing_steps == "epoch":
        said.append("a stream has no epochs: --checkpointing_steps epoch saves at the run's end only; "
                    "--checkpointing_steps N saves along the way")  # fmt: skip
    return said


def _needs_cuda(model: PreTrainedModel) -> bool:
    """Whether the model's attention runs only on a GPU (FlashAttention, a hub kernel), so not on its CPU copy."""
    implementation = model.config._attn_implementation or ""
    return "flash" in implementation or "/" in implementation


def one_layer_copy(model: PreTrainedModel, device: str, dtype: torch.dtype) -> PreTrainedModel:
    """A randomly initialised copy of `model` with one decoder layer, on `device` in `dtype`: the same classes
    and attention kernel, small enough to probe on the GPU before the full model is moved there."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    with torch.device(device):
        small = type(model)._from_config(config, dtype=dtype, attn_implementation=model.config._attn_implementation)
    return small.eval()


def _rows(docs: Dataset, block_size: int, packing: str) -> Dataset:
    rows = pack([list(doc) for doc in docs["input_ids"]], block_size, packing)
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "seq_lengths": datasets.List(datasets.Value("int32"))}
    )
    return Dataset.from_list(rows, features=features)
