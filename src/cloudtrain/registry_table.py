"""What the command line needs to know about each task and trainer, without importing them.

`--help`, the choices of --task, --training_type and --metric_for_best_model, and every refusal of a bad
option read these rows; importing the classes themselves pulls in transformers, datasets and
torch.distributed (about 6 s of CPU). The registry (cloudtrain.registry) checks each class against its row
when it registers, and tests/test_registry.py checks the rows against the classes, so the two
can't drift. Rows are in the order --help lists them, which is the order the packages register them.
"""

from typing import NamedTuple

# What one record of a task that streams (--streaming true, `cloudtrain preprocess`) encodes to: its class's
# `stream_records` (cloudtrain.tasks.base).
DOCUMENT = "document"  # one document: its tokens
EXAMPLES = "examples"  # several examples, each with its answer mask, cut at --max_length and packed whole

# What `cloudtrain predict` gives a saved model of the task (Row.predicts; None: predict refuses it, `generate` or
# the diffusers pipeline is its way in).
TEXTS = "texts"  # a text, or a text pair where the run read a --text_pair_column
QUESTIONS = "questions"  # a question and its context
PROMPT_ANSWERS = "prompt_answers"  # a prompt and an answer: through the saved chat template where the run had one


# the column options of the tasks that read texts and labels from columns (a pair's second text: refused by the
# tasks of one text, which read it to say so)
TEXT_COLUMNS = ("text_column", "text_pair_column", "label_column")
# what every task of texts reads (text_to_image reads images and cuts its captions at the text encoders' length)
TEXT_OPTIONS = ("max_length", "validation_split_percentage")


class Row(NamedTuple):
    """One registered class as the parser sees it: `metrics`, `default_best_metric`, `stream_records` (None
    for a task that does not stream), `reads_options` (its Task.reads_options) and `predicts` (what `cloudtrain
    predict` gives its saved model), `tensor_parallel` and `context_parallel` (its Task's: whether the task takes
    those sizes) are tasks' only."""

    module: str
    summary: str
    metrics: tuple[str, ...] = ()
    default_best_metric: str | None = None
    stream_records: str | None = None
    reads_options: tuple[str, ...] = ()
    predicts: str | None = None
    tensor_parallel: bool = False
    context_parallel: bool = False


TASK_ROWS: dict[str, Row] = {
    "classification": Row(
        "cloudtrain.tasks.classification",
        "text -> label",
        ("accuracy", "macro_f1", "loss"),
        "accuracy",
        reads_options=(*TEXT_OPTIONS, *TEXT_COLUMNS, "label_smoothing"),
        predicts=TEXTS,
    ),
    "multi_label": Row(
        "cloudtrain.tasks.multi_label",
        "text -> any number of labels",
        ("micro_f1", "macro_f1", "subset_accuracy", "loss"),
        "micro_f1",
        reads_options=(*TEXT_OPTIONS, *TEXT_COLUMNS, "label_separator"),
        predicts=TEXTS,
    ),
    "regression": Row(
        "cloudtrain.tasks.regression",
        "text -> a number",
        ("loss", "rmse", "mae", "pearson", "spearman"),
        "loss",
        reads_options=(*TEXT_OPTIONS, *TEXT_COLUMNS),
        predicts=TEXTS,
    ),
    "token_classification": Row(
        "cloudtrain.tasks.token_classification",
        "a tag per word: named entities, parts of speech",
        ("f1", "precision", "recall", "accuracy", "loss"),
        "f1",
        reads_options=(*TEXT_OPTIONS, *TEXT_COLUMNS, "label_smoothing"),
        predicts=TEXTS,
    ),
    "question_answering": Row(
        "cloudtrain.tasks.question_answering",
        "a question and a context -> the answer's span in the context",
        ("f1", "exact_match", "loss"),
        "f1",
        reads_options=(*TEXT_OPTIONS, *TEXT_COLUMNS, "doc_stride", "max_answer_length"),
        predicts=QUESTIONS,
    ),
    "seq2seq": Row(
        "cloudtrain.tasks.seq2seq",
        "a source text -> a target text (summaries, translations) with an encoder-decoder",
        ("rougeL", "rouge1", "rouge2", "rougeLsum", "bleu", "loss"),
        "rougeL",
        reads_options=(
            *TEXT_OPTIONS,
            *TEXT_COLUMNS,
            "label_smoothing",
            "max_target_length",
            "source_prefix",
            "generation_num_beams",
            "rouge_stemmer",
            "source_lang",
            "target_lang",
        ),
    ),
    "causal_lm": Row(
        "cloudtrain.tasks.causal_lm",
        "continued pretraining, or pretraining from scratch, of a decoder on raw text",
        ("loss", "perplexity"),
        "loss",
        DOCUMENT,
        reads_options=(
            *TEXT_OPTIONS,
            "text_column",
            "packing",
            "label_smoothing",
            "sample_prompts",
            "num_sample_prompts",
            "sample_max_new_tokens",
        ),
        tensor_parallel=True,
        context_parallel=True,
    ),
    "sft": Row(
        "cloudtrain.tasks.sft",
        "supervised fine-tuning of a decoder on conversations or prompt/completion pairs, with a chat template",
        ("loss", "perplexity", "exact_match"),
        "loss",
        EXAMPLES,
        reads_options=(
            *TEXT_OPTIONS,
            "packing",
            "chat_template",
            "prompt_column",
            "messages_column",
            "completion_column",
            "system_prompt",
            "train_on_prompt",
            "label_smoothing",
            "sample_prompts",
            "num_sample_prompts",
            "sample_max_new_tokens",
        ),
        tensor_parallel=True,
        context_parallel=True,
    ),
    "dpo": Row(
        "cloudtrain.tasks.dpo",
        "preference tuning of a decoder on chosen/rejected pairs: DPO, IPO, SimPO or ORPO",
        ("loss", "rewards/accuracies", "rewards/margins", "exact_match"),
        "loss",
        reads_options=(
            *TEXT_OPTIONS,
            "chat_template",
            "prompt_column",
            "chosen_column",
            "rejected_column",
            "num_sample_prompts",
            "sample_max_new_tokens",
            "preference_loss",
            "beta",
            "simpo_gamma",
            "precompute_reference",
        ),
    ),
    "reward": Row(
        "cloudtrain.tasks.reward",
        "a reward model: one score per text, trained on chosen/rejected pairs (Bradley-Terry)",
        ("loss", "accuracy", "margin"),
        "accuracy",
        reads_options=(
            *TEXT_OPTIONS,
            "chat_template",
            "prompt_column",
            "chosen_column",
            "rejected_column",
            "margin_column",
        ),
        predicts=PROMPT_ANSWERS,
    ),
    "text_to_image": Row(
        "cloudtrain.tasks.text_to_image",
        "captioned images (or DreamBooth) -> a diffusers text-to-image pipeline (LoRA or full)",
        ("loss",),
        "loss",
        reads_options=("images",),
    ),
}


def predict_input(task: str | None) -> str | None:
    """What `cloudtrain predict` gives a saved model of `task` (its row's `predicts`); None for a task without one
    or a name no task has."""
    row = TASK_ROWS.get(task or "")
    return row.predicts if row else None


# The tasks that stream, by what a record encodes to: `cloudtrain preprocess`'s --task choices and its checks.
STREAMING: dict[str, str] = {name: row.stream_records for name, row in TASK_ROWS.items() if row.stream_records}

TRAINER_ROWS: dict[str, Row] = {
    "basic": Row("cloudtrain.training.basic", "plain PyTorch loop"),
    "accelerated": Row("cloudtrain.training.accelerated", "Hugging Face accelerate (DDP, DeepSpeed, FSDP)"),
    "pipeline": Row(
        "cloudtrain.training.pipeline",
        "decoder layers split into stages across processes (torch.distributed.pipelining), under torchrun",
    ),
}
