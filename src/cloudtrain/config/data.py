"""Options of the data: where it comes from, its columns and how it becomes rows."""

import math
import os
from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError, refuse_first

MAX_LOADER_WORKERS = max(64, 4 * (os.cpu_count() or 1))  # each is a process

PACKING = ("auto", "none", "wrapped", "bfd")
MIXTURE_EXHAUSTED = ("restart", "drop", "stop")
ON_BAD_DATA = ("skip", "stop")


@dataclass
class DataConfig(OnlyFields):
    dataset_name: str | None = opt(
        None,
        "Hub dataset name, or a directory written by datasets.save_to_disk. "
        "Default (with no --train_file either): the built-in Reuters R8 news topics.",
    )
    dataset_config: str | None = opt(None, "Hub dataset configuration name.")
    train_file: str | None = opt(
        None,
        "Training data: a csv/tsv/json/jsonl/parquet file, a folder of such files, or a save_to_disk directory.",
        path=True,
    )
    validation_file: str | None = opt(None, "Validation data, same formats as --train_file.", path=True)
    test_file: str | None = opt(None, "Test data, same formats as --train_file.", path=True)
    text_column: str = opt(
        "text", "Column holding the text (--task causal_lm also reads .txt files: one document per line)."
    )
    text_pair_column: str | None = opt(None, "Column holding the second text of sentence-pair tasks.")
    label_column: str = opt(
        "label",
        "Column holding the label: a class (strings or integers) for classification, a number for regression, a "
        "list or separated text for multi_label, a tag per word for token_classification (default there: "
        "ner_tags), SQuAD answers for question_answering (answers), the target text for seq2seq (summary).",
    )
    label_separator: str = opt(
        ",", "--task multi_label: what separates a row's labels in a text column (a column of lists needs none)."
    )
    doc_stride: int = opt(
        64,
        "--task question_answering: a context longer than --max_length is read in windows that overlap by this "
        "many tokens.",
    )
    max_answer_length: int = opt(30, "--task question_answering: the longest answer predicted, in tokens.")
    max_target_length: int = opt(
        128,
        "--task seq2seq: truncate targets to this many tokens (--max_length truncates the sources); evaluation and "
        "predictions generate up to this many.",
    )
    rouge_stemmer: bool = opt(
        False,
        "--task seq2seq: stem words (NLTK's Porter stemmer, pip install nltk) before ROUGE counts them, as "
        "transformers' run_summarization.py does (rouge_score's use_stemmer=True); off: words as written.",
    )
    generation_num_beams: int = opt(
        1,
        "--task seq2seq: beams of the generations that evaluation scores and predictions write (1: greedy; more: "
        "beam search under the checkpoint's saved length penalty and length rules, as transformers' "
        "Seq2SeqTrainer; 4 is usual for summaries; evaluation takes about as many times longer).",
    )
    source_lang: str | None = opt(
        None,
        "--task seq2seq: with a 'translation' column of {language: text} records (WMT's), the language to translate "
        "from (its key: en).",
    )
    target_lang: str | None = opt(None, "--task seq2seq: with a 'translation' column, the language to translate to.")
    source_prefix: str = opt(
        "",
        '--task seq2seq: text put before every source, as T5 expects ("summarize: ", "translate English to German: ").',
    )
    max_length: int = opt(
        128,
        "Classification, regression, reward, seq2seq sources: truncate inputs to this many tokens (words past it in "
        "token_classification are neither trained nor scored). Causal LM: the block size (tokens per training "
        "row); longer documents are split. question_answering: the window size (with --doc_stride).",
    )
    packing: str = opt(
        "auto",
        "Language-model rows: wrapped (concatenate all documents and cut into blocks), bfd "
        "(best-fit-decreasing bins of whole documents or examples, each attending only to "
        "itself) or none (one per row, padded); auto: wrapped for causal_lm, none for sft.",
        PACKING,
    )
    sample_prompts: list = opt(
        [],
        "Causal LM and SFT: prompts whose greedy continuations (SFT: answers) are printed "
        "and logged at each evaluation, separated by '|' (default: taken from "
        "--num_sample_prompts validation examples).",
        separator="|",
    )
    num_sample_prompts: int = opt(
        3,
        "Causal LM, SFT and DPO: how many validation examples give the sample prompts "
        "(SFT and DPO also report exact_match, the share of answers equal to the reference).",
    )
    messages_column: str | None = opt(
        None,
        "SFT: column of conversations, lists of {role, content} (ShareGPT "
        "{from, value} too). Default: detected (messages, conversations; else "
        "prompt/completion; else instruction/input/output).",
    )
    prompt_column: str | None = opt(
        None,
        "SFT: column of prompts (with --completion_column); DPO and reward: the pairs' shared prompt. Default: prompt.",
    )
    completion_column: str | None = opt(None, "SFT: column of completions (with --prompt_column; default: completion).")
    system_prompt: str | None = opt(None, "SFT: a system message put first in every example that has none.")
    chat_template: str | None = opt(
        None,
        "SFT, DPO and reward: the chat template, when not the tokenizer's own: a shipped name "
        "(chatml, zephyr) or a Jinja file. Default: the tokenizer's, else chatml.",
    )
    train_on_prompt: bool = opt(
        False,
        "SFT: also train on prompt tokens (system, user turns and the template's "
        "headers); by default only assistant tokens are in the loss. Evaluation measures the answers either way.",
    )
    validation_split_percentage: float = opt(10.0, "Percent of train carved out for validation when there is none.")
    max_train_samples: int | None = opt(
        None,
        "Use at most this many training examples (quick runs): rows of a classifier's data, documents for "
        "causal_lm (before packing cuts them into rows), conversations or pairs for sft, dpo and reward, images.",
    )
    max_eval_samples: int | None = opt(
        None, "Use at most this many validation and test examples (quick runs), counted as --max_train_samples."
    )
    cache_dir: str | None = opt(
        None,
        "Where processed datasets are cached (default: $CLOUDTRAIN_CACHE/processed, else "
        "~/.cache/cloudtrain/processed). The data files as read go to the datasets library's cache "
        "($HF_DATASETS_CACHE, else ~/.cache/huggingface/datasets), a copy per version of a file.",
        path=True,
    )
    group_by_length: bool = opt(
        False,
        "Batch training examples of similar length together (less padding); the "
        "order is still drawn from the seed and the epoch alone.",
    )
    dataloader_num_workers: int = opt(
        0,
        "Worker processes that load and collate batches (0: in the training process, enough for tokenized rows: "
        "the host prepares the next batch while the GPU computes; 2-4 where reading or collating is slow, as "
        "for images).",
    )
    dataloader_pin_memory: bool = opt(
        True,
        "On CUDA: batches in page-locked memory, so their copies to the GPU run beside the computation without "
        "the host waiting for them (ignored without a GPU).",
    )
    streaming: bool = opt(
        False,
        "Causal LM and SFT: read, tokenize and pack the training data on the fly instead of tokenizing it all "
        "before the first step (corpora larger than memory, weighted mixtures); needs --max_steps or "
        "--max_tokens. --train_file then takes one or more sources separated by commas (files, folders, globs, "
        "s3://bucket/prefix, hf://datasets/<owner>/<name>[/glob]; see docs/streaming.md), and --dataset_name X "
        "means hf://datasets/X.",
    )
    train_weights: list = opt(
        [], "Streaming: the sampling weight of each --train_file source, in order (default: equal weights)."
    )
    datasets: list = opt(
        [],
        "Streaming: the training sources as a list in a config file, each a mapping with path, and optionally "
        "format, weight and columns (a mapping of the task's column names to the source's).",
        separator="\n",
        path=True,
        mappings=True,
    )
    mixture_exhausted: str = opt(
        "restart",
        "Streaming: what happens when a source runs out: restart it (a new pass), drop it (the other weights "
        "renormalised; training ends when all are dropped), or stop training.",
        MIXTURE_EXHAUSTED,
    )
    max_tokens: int | None = opt(
        None,
        "Streaming: the token budget: train for ceil(max_tokens / (global batch rows x --max_length)) steps "
        "(row slots, padding included; exact for --packing wrapped).",
    )
    stream_buffer: int = opt(
        256, "Streaming: documents packed together (bfd within this bounded buffer; wrapped cuts each buffer)."
    )
    stream_buffer_mb: float = opt(
        4,
        "Streaming: a buffer also ends once its documents reach this many MiB in their files (tokenized, a buffer "
        "takes 50-120x its text in memory, per loader worker); 0: no cap.",
    )
    stream_validation_docs: int = opt(
        64, "Streaming without --validation_file: the first documents of the mixture held out for validation."
    )
    on_bad_data: str = opt(
        "skip",
        "Streaming: a corrupted record or file met mid-stream is skipped with a warning and counted (skip), or "
        "ends the run with one line naming it (stop).",
        ON_BAD_DATA,
    )

    def check(self) -> None:
        """The data options' values and combinations, streaming's and question answering's included: no I/O."""
        refuse_first(
            [
                (
                    self.dataset_name and self.train_file,
                    "--dataset_name and --train_file both name the training data; give one of them",
                ),
                (
                    self.text_pair_column and self.text_pair_column == self.text_column,
                    "--text_pair_column must differ from --text_column",
                ),
                (
                    self.label_column in (self.text_column, self.text_pair_column),
                    "--label_column must differ from the text columns",
                ),
                (not self.label_separator, "--label_separator must not be empty"),
                (self.max_length < 2, "--max_length must be at least 2"),
                (
                    not 0 < self.validation_split_percentage < 100,
                    "--validation_split_percentage must be above 0 and below 100",
                ),
                (
                    self.max_train_samples is not None and self.max_train_samples < 1,
                    "--max_train_samples must be at least 1",
                ),
                (
                    self.max_eval_samples is not None and self.max_eval_samples < 1,
                    "--max_eval_samples must be at least 1",
                ),
                (self.dataloader_num_workers < 0, "--dataloader_num_workers must not be negative"),
                (
                    self.dataloader_num_workers > MAX_LOADER_WORKERS,
                    f"--dataloader_num_workers {self.dataloader_num_workers} is more than {MAX_LOADER_WORKERS} (4 x "
                    "this machine's CPUs, at least 64): each is a process; give fewer",
                ),
                (self.num_sample_prompts < 0, "--num_sample_prompts must not be negative (0: no sample generations)"),
            ]
        )
        if self.doc_stride < 0:
            raise UserError("--doc_stride must be at least 0")
        if self.max_answer_length < 1:
            raise UserError("--max_answer_length must be at least 1")
        if self.max_target_length < 1:
            raise UserError("--max_target_length must be at least 1")
        if self.generation_num_beams < 1:
            raise UserError("--generation_num_beams must be at least 1 (1: greedy)")
        if self.stream_buffer < 1:
            raise UserError("--stream_buffer must be at least 1 document")
        if not 0 <= self.stream_buffer_mb < math.inf:
            raise UserError("--stream_buffer_mb must be 0 (no cap) or more MiB")
        if self.streaming and self.stream_validation_docs < 1:
            raise UserError(
                "--stream_validation_docs must be at least 1: a stream without --validation_file validates on the "
                "documents it holds out; give --validation_file to hold none out"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError("--max_tokens must be at least 1")
        if not self.streaming:
            for name in ("train_weights", "datasets", "max_tokens"):
                if getattr(self, name):
                    raise UserError(f"--{name} needs --streaming true")
