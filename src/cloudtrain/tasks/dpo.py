"""Preference tuning of a decoder (`--task dpo`): DPO and its relatives on chosen/rejected pairs.

Supports:
- `--preference_loss` sigmoid (DPO), ipo, simpo and orpo (reference-free), `--beta` and `--simpo_gamma` with
  the papers' defaults (cloudtrain.config.preference); the pair formats of cloudtrain.data.pairs (explicit,
  conversational, implicit prompt), the chat template handled as `--task sft` handles it;
- chosen and rejected through the policy in one forward, each prompt computed once (one row per pair: shared
  tokens, chosen, rejected, under a mask that hides the chosen answer from the rejected; 2B rows for attention
  that takes no custom mask), the prompt's tokens out of the loss (exactly zero gradient), the LM head only on
  the answers' window and its softmax only on the positions that predict answer tokens;
- the reference: the policy's base with the adapters disabled under --peft (no copy), a frozen copy under full
  fine-tuning, or `--precompute_reference true`: its log-probabilities computed once before training and kept
  as two columns of the data (no reference model during training); none for simpo and orpo;
- per logging step and evaluation: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
  logps/chosen, logps/rejected; at evaluation also greedy answers to a few held-back prompts, with their
  exact_match against the chosen answer.
Under FSDP2 the full-fine-tuning reference copy is sharded as the policy is (at its first use).
Does not support: packing (pairs are padded), the pipeline trainer, a full-fine-tuning reference under ZeRO-3
(use FSDP2, ZeRO-1/2, --peft with the live reference, or a reference-free loss), a precomputed reference under
ZeRO-3 or FSDP2, a reference model other than the policy's starting point.
"""

import copy
import inspect
import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset, DatasetDict
from huggingface_hub import ModelCard
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cloudtrain.config import Config, DataConfig
from cloudtrain.data.chat import ChatFormat
from cloudtrain.data.pairs import (
    PAIR_FEATURES,
    REFERENCE_COLUMNS,
    SIDES,
    PairCollator,
    PairColumns,
    answer_logps,
    encode_pair,
    is_plain,
    pair_columns,
    pair_place,
    plain_pair,
    plain_text,
    segment_mask,
    to_pair,
    truncate_pairs,
)
from cloudtrain.data.processing import ProcessedData, cache_key, cached_map, first_rows
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode
from cloudtrain.hardware import autocast as autocast_for
from cloudtrain.models.load import check_checkpoint, is_causal_lm, load_tokenizer
from cloudtrain.parallel.distributed import Sharding, sharding
from cloudtrain.parallel.fsdp import place_like
from cloudtrain.paths import resolve_model_path
from cloudtrain.publish.card_metadata import SPLITS, dataset_info
from cloudtrain.publish.card_sections import table_cell
from cloudtrain.publish.lm_card import build_lm_model_card
from cloudtrain.registry import TASKS, TRAINERS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.base import PairRows, model_label
from cloudtrain.tasks.causal_lm import CausalLMTask
from cloudtrain.tasks.sft import SFTTask, check_prompts_fit, last_question, no_prompt_fits, shortened

# how the language-model card says the model was trained from its base
PREFERENCE_TUNED = "preference-tuned (on chosen/rejected pairs) from"
# What the loop and evaluation report, per pair: train/<name> at logging steps, eval/<name> at evaluation.
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logps/accuracies",  # the share of pairs whose chosen answer the model itself finds likelier (no reference)
)


def preference_loss(
    kind: str,
    beta: float,
    gamma: float,
    logps: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward), [B] each, from the summed answer log-probabilities of the
    policy (`logps` [2B]: the B chosen then the B rejected), their token `counts` and the `reference`'s."""
    pairs = logps.shape[0] // 2
    chosen, rejected = logps[:pairs], logps[pairs:]
    if kind in ("sigmoid", "ipo"):
        assert reference is not None
        chosen_ratio, rejected_ratio = chosen - reference[:pairs], rejected - reference[pairs:]
        h = chosen_ratio - rejected_ratio
        # DPO (eq. 7): -log sigmoid(beta * h); IPO (eq. 17): (h - 1/(2 tau))^2 with tau = --beta
        losses = -F.logsigmoid(beta * h) if kind == "sigmoid" else (h - 1 / (2 * beta)) ** 2
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    chosen_mean, rejected_mean = chosen / counts[:pairs], rejected / counts[pairs:]  # per-token averages
    if kind == "simpo":  # SimPO (eq. 6): -log sigmoid(beta/|y_w| log p(y_w) - beta/|y_l| log p(y_l) - gamma)
        losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)
    elif kind == "orpo":  # ORPO (eq. 6-7): L_SFT + lambda * -log sigmoid(log odds(y_w) - log odds(y_l))
        log_odds = (chosen_mean - _log1mexp(chosen_mean)) - (rejected_mean - _log1mexp(rejected_mean))
        losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return losses, beta * chosen_mean.detach(), beta * rejected_mean.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_logps(
    model: torch.nn.Module, batch: dict, window: bool = True, additive: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed answer log-probabilities, answer token counts), [2B] each: chosen and rejected in one forward (see
    PairCollator's two layouts; `additive`: the shared-prompt mask as eager attention takes it). With `window` (a
    model whose forward takes logits_to_keep) the LM head runs on the answers' window only, not the prompts."""
    keep: dict[str, Any] = {"logits_to_keep": len(batch["answer_window"])} if window else {}
    if "segments" in batch:  # the shared-prompt layout: its mask and positions
        keep.update(attention_mask=segment_mask(batch["segments"], additive), position_ids=batch["position_ids"])
    logits = model(input_ids=batch["input_ids"], use_cache=False, **keep).logits
    return answer_logps(logits, batch)


def cut_notes(report: dict[str, dict], max_length: int) -> list[str]:
    """Per split, the pairs cut to --max_length and those dropped (also without a cut: a template that trims
    makes two answers the same tokens)."""
    why = "an answer lost every token, or both are the same tokens"
    notes = []
    for split, r in report.items():
        said = [f"{r['truncated']} {split} pairs cut to --max_length {max_length}"] if r["truncated"] else []
        said += [f"{r['dropped']} {split} pairs dropped ({why})"] if r["dropped"] else []
        notes += [", ".join(said)] if said else []
    return notes


ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "chunked_attention"}  # what a mask rules


def separate_rows_reason(model: PreTrainedModel, max_length: int) -> str | None:
    """Why the shared-prompt layout's custom 4D mask would not compute what each answer's own row does, or None.
    It needs an attention that takes the mask as given (SDPA boolean, eager additive) and a forward that takes
    position ids; a sliding window the answers outgrow would be dropped with the model's own mask."""
    implementation = getattr(model.config, "_attn_implementation", None)
    takes = inspect.signature(type(model).forward).parameters
    if implementation not in ("sdpa", "eager") or not {"position_ids", "attention_mask"} <= set(takes):
        return f"{implementation} attention takes no custom mask"
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    recurrent = sorted({str(kind) for kind in kinds} - ATTENTION_LAYERS)
    if recurrent:  # a convolution's or a state space's state carries the chosen answer into the rejected one
        return f"the model's {', '.join(recurrent)} layers read the tokens before them whatever the mask says"
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if window and window < max_length:
        return f"the model's sliding window of {window} tokens is shorter than --max_length {max_length}"
    chunk = getattr(text, "attention_chunk_size", None)  # Llama 4's chunked attention, a window of its own
    if chunk and chunk < max_length:
        return f"the model's attention chunks of {chunk} tokens are shorter than --max_length {max_length}"
    return None


@TASKS.register
class DPOTask(PairRows, SFTTask):
    name = "dpo"
    summary = "preference tuning of a decoder on chosen/rejected pairs: DPO, IPO, SimPO or ORPO"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics: tuple[str, ...] = ("loss", "rewards/accuracies", "rewards/margins", "exact_match")
    lower_is_better = frozenset({"loss"})
    default_best_metric = "loss"
    default_packing = "none"
    streams_data = False  # pairs are stored rows (a stream would train on one sample record per source)
    tensor_parallel = context_parallel = False  # a pair's loss, beside a reference model
    embedding_noise = False  # NEFTune is an instruction-tuning method: not offered (nor tested) for preference pairs

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.reference: PreTrainedModel | None = None  # the frozen copy (full fine-tuning, live reference)
        self.placed = False  # whether the copy is where the policy is (on its device, or sharded as it is)
        self.data: ProcessedData | None = None  # what `process` returned; precomputing adds reference columns
        self.sums: torch.Tensor | None = None  # PAIR_METRICS summed over training pairs, and their count
        self.window = False  # whether the model's forward takes logits_to_keep (the LM head on the answers only)
        self.additive = False  # whether the shared-prompt mask is additive (eager attention) or boolean (SDPA)

    # ------------------------------------------------------------ options and data
    def check_options(self, cfg: Config) -> None:
        m = cfg.model
        if not m.model_name_or_path and not m.model_config:
            raise UserError("--task dpo needs a decoder to tune: --model_name_or_path <causal LM, e.g. an SFT model>")
        if m.model_name_or_path:  # an SFT LoRA output (an adapter, no config.json) gets its own line
            check_checkpoint(resolve_model_path(m), "--model_name_or_path")
        config = self.model_config(cfg)
        if not is_causal_lm(config):
            kind = ", ".join(config.architectures or [config.model_type])
            raise UserError(
                f"{m.model_name_or_path or m.model_config} is not a causal language model ({kind}); --task dpo "
                "tunes a decoder (…ForCausalLM); for an encoder, train a reward model with --task reward"
            )
        if TRAINERS[cfg.training.training_type].mesh(cfg, max(cfg.distributed.pipeline_parallel_size, 1)).pp > 1:
            raise UserError(
                "--task dpo takes a pair's loss over both answers at once, which a pipeline's last stage cannot; "
                "use --training_type accelerated"
            )
        refusal = self.sharding_refusal(cfg, sharding(cfg))
        if refusal:
            raise UserError(refusal)
        if cfg.checkpoint.metric_for_best_model == "exact_match" and not cfg.data.num_sample_prompts:
            raise UserError("--metric_for_best_model exact_match needs --num_sample_prompts N; or pick loss")
        ChatFormat.setup(load_tokenizer(m), cfg.data.chat_template)  # a bad template fails here

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        p = self.cfg.preference
        named = {"--chosen_column": p.chosen_column, "--rejected_column": p.rejected_column}
        if cfg.prompt_column:
            named["--prompt_column"] = cfg.prompt_column
        return {flag: (column, True) for flag, column in named.items()}

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        """Rows -> (prompt, chosen, rejected) -> two token rows each, checked; validation carved by pair; truncated
        pairs that lose an answer dropped and counted."""
        self.cfg, self.tokenizer, d, p = cfg, tokenizer, cfg.data, cfg.preference
        columns = {
            split: pair_columns(ds.column_names, d.prompt_column, p.chosen_column, p.rejected_column)
            for split, ds in raw.items()
        }
        raw = DatasetDict(raw)
        self.plain = len(raw["train"]) > 0 and is_plain(raw["train"][0], columns["train"])
        size = len(tokenizer)  # set up for plain pairs too: a checkpoint's embeddings count its tokens (review)
        self.chat = ChatFormat.setup(tokenizer, d.chat_template)
        self.added_tokens = len(tokenizer) - size
        pairs = {split: self._encode_pairs(ds, split, columns[split], d) for split, ds in raw.items()}
        if "validation" not in raw:
            train, validation = self._carve_indices(len(raw["train"]), d.validation_split_percentage, cfg.training.seed)
            for splits in (raw, pairs):
                splits["train"], splits["validation"] = (
                    splits["train"].select(train),
                    splits["train"].select(validation),
                )
            columns["validation"] = columns["train"]
        for split, limit in (
            ("train", d.max_train_samples),
            ("validation", d.max_eval_samples),
            ("test", d.max_eval_samples),
        ):
            if split in raw:
                raw[split], pairs[split] = first_rows(raw[split], limit), first_rows(pairs[split], limit)
        rows = {split: self._pair_rows(split, ds, d) for split, ds in pairs.items()}
        self._pair_prompts(raw["validation"], columns["validation"], cfg)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.data = ProcessedData(
            train=rows["train"],
            validation=rows["validation"],
            test=rows.get("test"),
            collator=PairCollator(pad if pad is not None else 0),
            prompts=self.prompts,
            references=self.references,
        )
        return self.data

    def _encode_pairs(self, ds: Dataset, split: str, columns: PairColumns, cfg: DataConfig) -> Dataset:
        """Both rows of every pair, every pair checked; cached by data, tokenizer, template and columns."""
        chat = self.chat
        assert chat is not None and self.tokenizer is not None  # both set by `process`

        def encode(batch: dict, indices: list[int]) -> dict:
            out: dict[str, list] = {name: [] for name in PAIR_FEATURES}
            for i, index in enumerate(indices):
                try:
                    encoded = encode_pair(chat, {c: batch[c][i] for c in batch}, columns)
                except ValueError as err:
                    raise UserError(f"{pair_place(cfg, split, index)}: {err}") from None
                for name, value in encoded.items():
                    out[name].append(value)
            return out

        key = cache_key(
            ds, self.tokenizer, *columns.names, columns.prompt, self.tokenizer.chat_template,
            self.tokenizer.special_tokens_map, "pairs-v4",  # v4: implicit string pairs as plain text
        )  # fmt: skip
        return cached_map(
            ds, encode, PAIR_FEATURES, cfg, f"pairs-{split}", key, f"Tokenizing {split} pairs", with_indices=True
        )

    def _pair_rows(self, split: str, pairs: Dataset, cfg: DataConfig) -> Dataset:
        """Pairs cut to --max_length; those left with no answer token on either side, or with equal sides (but
        under ORPO, whose SFT term still trains the chosen side), dropped and counted (all: an error)."""
        rows = {name: list(pairs[name]) for name in PAIR_FEATURES}
        assert self.cfg is not None  # set by `process`
        keep, cut = truncate_pairs(rows, cfg.max_length, distinct=self.cfg.preference.preference_loss != "orpo")
        dropped = len(pairs) - len(keep)
        self.report[split] = {"examples": len(pairs), "truncated": cut, "dropped": dropped}
        if not keep:
            longest = max(len(ids) for side in SIDES for ids in pairs[f"{side}_ids"])
            raise UserError(
                f"all {len(pairs)} {split} pairs lose an answer, or all that tells their answers apart, within "
                f"--max_length {cfg.max_length} (the longest "
                f"row is {longest} tokens); raise --max_length or shorten the prompts"
            )
        return Dataset.from_dict(
            {name: [rows[name][i] for i in keep] for name in PAIR_FEATURES}, features=PAIR_FEATURES
        )

    def _pair_prompts(self, validation: Dataset, columns: PairColumns, cfg: Config) -> None:
        """The prompts of the first validation pairs that leave room for --sample_max_new_tokens, with the chosen
        answer as the reference (exact_match)."""
        room = cfg.data.max_length - cfg.training.sample_max_new_tokens
        self.prompts, self.references, self.questions = [], [], []
        chat, tokenizer = self.chat, self.tokenizer
        assert chat is not None and tokenizer is not None  # set by `process`
        for row in validation:
            if len(self.prompts) == cfg.data.num_sample_prompts:
                break
            prompt, chosen, _ = to_pair(row, columns)
            plain = plain_pair(row, columns)
            if plain is not None:  # the prompt as training saw it (its BOS too: samples add no special tokens)
                ids, mask = plain_text(tokenizer, plain[0], plain[1], eos=False)
                text = str(tokenizer.decode(ids[: mask.index(1)]))
            else:
                text = chat.render(prompt, add_generation_prompt=True)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= room:
                self.prompts.append(text)
                self.references.append(chosen[0]["content"])
                self.questions.append(last_question([*prompt, *chosen]))
        check_prompts_fit(self.prompts, cfg)

    # ------------------------------------------------------------ the reference
    runs_in_pipeline = False  # a pair's loss needs both answers' log-probabilities at once

    def sharding_refusal(self, cfg: Config, shards: Sharding) -> str | None:
        """The precomputed reference needs whole weights (no ZeRO-3, no FSDP); the full-fine-tuning copy is sharded
        under FSDP2 (parallel.fsdp.place_like) but would be whole in every process under ZeRO-3."""
        p = cfg.preference
        if p.needs_reference and p.precompute_reference and (shards.zero_stage == 3 or shards.fsdp):
            where, instead = (
                ("FSDP", "the live reference is sharded as the policy") if shards.fsdp
                else ("ZeRO-3", "with --peft lora the live reference is the sharded base")
            )  # fmt: skip
            return (
                f"--task dpo under {where} with --precompute_reference true: the reference is computed from whole "
                f"weights; use ZeRO-1/2, or drop it ({instead})"
            )
        if self.keeps_model_copy(cfg) and shards.zero_stage == 3:
            return (
                "--task dpo under ZeRO-3 with full fine-tuning: the reference copy would be whole in every process; "
                "use --fsdp true (it shards the copy too), ZeRO-1/2, --peft lora, or --preference_loss simpo/orpo"
            )
        return None

    def keeps_model_copy(self, cfg: Config) -> bool:
        p = cfg.preference
        return p.needs_reference and not p.precompute_reference and cfg.model.peft == "none"

    def before_adapters(self, model: PreTrainedModel, cfg: Config, announce: bool) -> None:
        """The model as loaded is the reference: its log-probabilities once (--precompute_reference), or a frozen
        copy under full fine-tuning; with adapters, nothing (the reference is the base, adapters disabled)."""
        p = cfg.preference
        self.window = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        if turn_off_dropout(model) and announce:
            print("note: the model's dropout is off: the policy must score pairs as the reference does", flush=True)
        self._choose_layout(model, announce)
        if not p.needs_reference:
            return
        if p.precompute_reference:
            self._precompute(model, cfg, announce)
        elif cfg.model.peft == "none":
            self.reference = copy.deepcopy(model).requires_grad_(False).eval()
            if announce:
                print("reference model: a frozen copy of the starting weights", flush=True)

    def _choose_layout(self, model: PreTrainedModel, announce: bool) -> None:
        """The shared-prompt layout (each prompt computed once) where it computes what each answer's own row does;
        else each answer its own row."""
        assert self.data is not None and self.cfg is not None  # `process` ran
        self.additive = getattr(model.config, "_attn_implementation", None) == "eager"
        why = separate_rows_reason(model, self.cfg.data.max_length)
        collator = self.data.collator
        assert isinstance(collator, PairCollator)  # `process` made it
        collator.shared = why is None
        if announce and why:
            print(f"pairs: chosen and rejected as separate rows ({why})")

    @torch.no_grad()
    def _precompute(self, model: PreTrainedModel, cfg: Config, announce: bool) -> None:
        """The reference log-probabilities of every pair of every split, as two columns (every process computes all
        of them: no collective before training)."""
        assert self.data is not None  # `process` ran
        start = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        place, was_training = next(model.parameters()).device, model.training
        model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped `to`
        total = 0
        for split in ("train", "validation", "test"):
            ds = getattr(self.data, split)
            if ds is None:
                continue
            with torch.random.fork_rng(devices=[]):  # a loader draws its seed: adapters and dropout must not notice
                logps = self._reference_pass(model, ds, cfg, device)
            table = torch.cat(logps).tolist()
            for i, column in enumerate(REFERENCE_COLUMNS):
                ds = ds.add_column(column, [row[i] for row in table])
            setattr(self.data, split, ds)
            total += len(table)
        model.to(place).train(was_training)  # type: ignore[arg-type]
        if announce:
            print(
                f"reference log-probabilities of {total} pairs precomputed in {time.perf_counter() - start:.1f}s; "
                "no reference model is kept",
                flush=True,
            )

    def _reference_pass(self, model: PreTrainedModel, ds: Dataset, cfg: Config, device: torch.device) -> list:
        """[chosen, rejected] summed answer log-probabilities of every pair of `ds`, one [B, 2] tensor per batch."""
        assert self.data is not None  # `process` ran
        loader = DataLoader(ds, batch_size=cfg.training.per_device_eval_batch_size, collate_fn=self.data.collator)
        logps = []
        for batch in loader:
            with autocast_for(cfg.training.mixed_precision, device):
                values = self.logps(model, {k: v.to(device) for k, v in batch.items()})[0].float().cpu()
            pairs = len(values) // 2
            logps.append(torch.stack([values[:pairs], values[pairs:]], dim=1))
        return logps

    def logps(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """pair_logps with what this model takes (the LM head's window, the mask's kind)."""
        return pair_logps(model, batch, self.window, self.additive)

    @torch.no_grad()
    def reference_logps(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The reference's summed answer log-probabilities [2B]: precomputed, the frozen copy, or the policy's base
        with its adapters disabled (in eval mode, as the copy, so dropout does not enter it)."""
        if "ref_logps" in batch:
            return batch["ref_logps"]
        device = batch["input_ids"].device
        with autocast_for(self.cfg.training.mixed_precision, device):
            if self.reference is not None:
                if not self.placed:  # once: the trainer has placed the policy
                    place_like(self.reference, model, device)
                    self.placed = True
                logps = self.logps(self.reference, batch)[0]
                if isinstance(self.reference, FSDPModule):
                    self.reference.reshard()  # FSDP2 keeps its root gathered after a forward, for a backward
                return logps
            inner: Any = getattr(model, "module", model)  # DDP and DeepSpeed wrap it; a PeftModel inside
            with eval_mode(inner), inner.disable_adapter():
                return self.logps(inner, batch)[0]

    # ------------------------------------------------------------ loss and metrics
    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), len(batch["rows"]) // 2, device=batch["input_ids"].device)  # pairs, in either layout

    def pair_values(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair loss [B], the per-pair PAIR_METRICS [B, 7]) of one batch."""
        p = self.cfg.preference
        logps, counts = self.logps(model, batch)
        reference = self.reference_logps(model, batch) if p.needs_reference else None
        losses, chosen, rejected = preference_loss(
            p.preference_loss, p.strength, p.simpo_gamma, logps, counts, reference
        )
        pairs = len(losses)
        values = torch.stack(
            [
                *(chosen, rejected, chosen - rejected, (chosen > rejected).to(chosen)),
                *(logps[:pairs], logps[pairs:], (logps[:pairs] > logps[pairs:]).to(chosen)),
            ],
            dim=1,
        )
        return losses, values.detach().float()

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        losses, values = self.pair_values(model, batch)
        sums = torch.cat([values.double().sum(dim=0), values.new_full((1,), len(losses)).double()])
        if self.sums is not None and self.sums.device != sums.device:  # restored from a checkpoint on the CPU
            self.sums = self.sums.to(sums.device)
        self.sums = sums if self.sums is None else self.sums + sums  # stays on the device
        return losses.sum(), self.loss_count(batch)

    def pending_state(self, reduce_sum: Callable) -> list[float] | None:
        """The reward sums since the last logging step, over every process: a resumed run's first log covers the
        steps before the checkpoint too, as an uninterrupted run's does."""
        if self.sums is None:  # every process has stepped alike: all or none have sums
            return None
        return reduce_sum(self.sums.clone()).cpu().tolist()

    def restore_state(self, state: list[float], is_main: bool) -> None:
        # the main process holds every process's sums; the others start from zero, so the next sum adds them once
        self.sums = torch.tensor(state, dtype=torch.float64) * float(is_main)

    def train_metrics(self, reduce_sum: Callable, seconds: float) -> dict[str, float]:
        if self.sums is None:  # every process has stepped alike: all or none have sums
            return {}
        total = reduce_sum(self.sums.clone()).cpu().tolist()
        self.sums.zero_()
        pairs = max(total[-1], 1)
        return {**{name: total[i] / pairs for i, name in enumerate(PAIR_METRICS)}, "pairs_per_s": total[-1] / seconds}

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
        """The loss and PAIR_METRICS over every pair exactly once (gathered per pair); then the sample answers."""
        with eval_mode(model):
            start = time.perf_counter()
            sums, pairs = torch.zeros(1 + len(PAIR_METRICS), dtype=torch.float64), 0
            for batch in batches:
                batch = move(batch)
                with autocast():
                    losses, values = self.pair_values(model, batch)
                (rows,) = gather((torch.cat([losses.detach().float()[:, None], values], dim=1),))
                sums += rows.double().sum(dim=0).cpu()
                pairs += len(rows)
        means = (sums / max(pairs, 1)).tolist()
        result = {"loss": means[0], **dict(zip(PAIR_METRICS, means[1:], strict=True))}
        result.update(samples=pairs, runtime_s=round(time.perf_counter() - start, 3))
        if data.prompts and self.tokenizer is not None:
            with autocast():
                result.update(self.samples(getattr(model, "module", model), data))
        return result

    # ------------------------------------------------------------ summaries
    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        """The chat model's card: the language-model card without its evaluation (perplexity, which a preference
        run does not measure), then what it was preference-tuned on and how, its pair metrics and sample answers."""
        card = build_lm_model_card(
            output_dir,
            cfg,
            results,
            chat=not self.plain,  # plain-text pairs trained no chat template
            tuning=PREFERENCE_TUNED,
            perplexity=False,
            sections="\n".join(self._card_section(cfg, results)),
        )
        data: Any = card.data  # the ModelCardData build_lm_model_card made
        data.tags = [*(data.tags or []), "dpo", cfg.preference.preference_loss]
        return card

    def _card_section(self, cfg: Config, results: dict) -> list[str]:
        p, evaluation = cfg.preference, results.get("eval", {})
        reference = (
            "none (reference-free)"
            if not p.needs_reference
            else "precomputed once before training"
            if p.precompute_reference
            else "the base with adapters disabled"
            if cfg.model.peft != "none"
            else "a frozen copy of the starting model"
        )
        start = model_label(cfg.model.model_name_or_path or cfg.model.model_config)
        lines = [
            "",
            "## Preference tuning",
            "",
            f"Preference-tuned with cloudtrain (`--task dpo`) from `{start}` on `{dataset_info(cfg.data)[1]}`: "
            f"loss `{p.preference_loss}`, beta {p.strength}"
            + (f", gamma {p.simpo_gamma}" if p.preference_loss == "simpo" else "")
            + f"; reference: {reference}.",
        ]
        for key, split in SPLITS.items():
            metrics = results.get(key, {})
            if "rewards/accuracies" in metrics:
                lines.append(
                    f"\n{split.capitalize()}: loss {metrics['loss']:.4f}, pair accuracy "
                    f"{metrics['rewards/accuracies']:.3f}, reward margin {metrics['rewards/margins']:.4f} "
                    f"({metrics.get('samples', 0)} pairs)."
                )
        generations = evaluation.get("generations") or []
        if generations:
            lines += ["", "### Sample answers", "", "| question | chosen answer | answer |", "|:--|:--|:--|"]
            lines += [
                "| " + " | ".join(table_cell(g.get(key, "")) for key in ("question", "reference", "answer")) + " |"
                for g in generations
            ]
        return lines

    def describe_data(self, data: ProcessedData) -> str:
        parts = []
        for split, rows in (("train", data.train), ("validation", data.validation), ("test", data.test)):
            if rows is not None:
                answer = sum(sum(mask[1:]) for side in SIDES for mask in rows[f"{side}_mask"])
                parts.append(f"{len(rows)} {split} pairs ({answer} answer tokens)")
        notes = cut_notes(self.report, self.cfg.data.max_length)
        if self.cfg.data.num_sample_prompts and not data.prompts:  # every validation prompt is longer than the room
            notes.append(no_prompt_fits(self.cfg))
        assert self.chat is not None  # set by `process`
        p = self.cfg.preference
        how = "plain text (implicit prompts, no template)" if self.plain else f"template: {self.chat.source}"
        return f"data: {'; '.join(parts)}; {how}; loss {p.preference_loss}, beta {p.strength}" + "".join(
            f"\nnote: {n}" for n in notes
        )

    def inference_hint(self, output_dir: str) -> str:
        if self.plain:  # trained on plain text: the model continues a prompt, it was not tuned to chat
            return CausalLMTask.inference_hint(self, output_dir)
        return super().inference_hint(output_dir)

    def describe_metrics(self, metrics: dict) -> str:
        line = (
            f"loss {metrics['loss']:.4f} | pair accuracy {metrics['rewards/accuracies']:.3f} (the model alone prefers "
            f"the chosen answer in {metrics['logps/accuracies']:.3f}) | margin "
            f"{metrics['rewards/margins']:.4f} (chosen {metrics['rewards/chosen']:.4f}, rejected "
            f"{metrics['rewards/rejected']:.4f}; {metrics['samples']} pairs)"
        )
        if "exact_match" in metrics:
            line += f" | exact_match {metrics['exact_match']:.3f} ({len(metrics['generations'])} answers)"
        for g in metrics.get("generations", [])[:3]:
            line += f"\n  {shortened(g['question'])} -> {json.dumps(g['answer'], ensure_ascii=False)}"
            if "reference" in g:  # the chosen answer, which exact_match compares with
                line += f" (chosen {json.dumps(g['reference'], ensure_ascii=False)})"
        return line


def turn_off_dropout(model: torch.nn.Module) -> int:
    """Dropout off in every layer (how many had it): a policy scoring pairs with dropout, beside a reference that
    scores without, starts away from log 2 with noisy rewards. HF attention reads a float attribute, not a layer."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, count = 0.0, count + 1
        for name in ("attention_dropout", "dropout"):
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                count += 1
    return count
