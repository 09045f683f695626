"""Extractive question answering (`--task question_answering`): a question and a context -> the answer's span.

Supports: SQuAD-style data (`question`, `context`, `answers` are read without options; else --text_column,
--text_pair_column and --label_column), answers as SQuAD records or plain texts, questions without an answer
(SQuAD 2.0: "no answer" is learnt and predicted), contexts longer than --max_length read in windows overlapping by
--doc_stride tokens; SQuAD's exact match and F1, and the loss; unlabelled evaluation splits (answers in
`<split>_predictions.jsonl`); `cloudtrain predict --text QUESTION --text_pair CONTEXT`; adapters, both trainers and
the Hub push as `--task classification`.
Does not support: generative answers (use --task sft), several answers per question, answers across windows.
"""

import shlex
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import AutoModelForQuestionAnswering, PretrainedConfig, PreTrainedTokenizerBase

from cloudtrain import invocation
from cloudtrain.answers import PADDED, best_answer, span_scores, squad_scores
from cloudtrain.config import Config
from cloudtrain.data.answer_spans import SQUAD_COLUMNS, process_answer_spans
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError
from cloudtrain.evaluation import eval_mode, pad_to_width
from cloudtrain.models.load import read_config
from cloudtrain.publish.classifier_card import CardKind, build_model_card
from cloudtrain.publish.saving import write_jsonl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import QUESTIONS, TASK_ROWS
from cloudtrain.tasks.classification import ClassificationTask

# its card: transformers 5 has no question-answering pipeline, so the snippet loads the model class and picks the
# best span of the context
CARD = CardKind(
    purpose="extractive question answering (the answer is a span of the context given with the question)",
    metrics=(("exact_match", "exact_match", "Exact match", None), ("f1", "f1", "F1", None)),
    pipeline=("question-answering", "Question Answering", "AutoPeftModelForQuestionAnswering"),
    labelled=False,
    model_class="AutoModelForQuestionAnswering",
    imports="import torch\n",
    inputs='inputs = tokenizer("{{ example_question }}", "{{ example_text }}", return_tensors="pt")',
    output="out = model(**inputs)\n"
    "outside = torch.tensor([part != 1 for part in inputs.sequence_ids()])  # the question and special tokens\n"
    "start = out.start_logits[0].masked_fill(outside, -1e4).argmax().item()\n"
    "end = out.end_logits[0].masked_fill(outside, -1e4).argmax().item()\n"
    'print(tokenizer.decode(inputs["input_ids"][0, start : end + 1]))',
)


@TASKS.register
class QuestionAnsweringTask(ClassificationTask):
    name = "question_answering"
    summary = "a question and a context -> the answer's span in the context"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    predicts = QUESTIONS
    metrics: tuple[str, ...] = ("f1", "exact_match", "loss")
    default_best_metric = "f1"
    auto_class = AutoModelForQuestionAnswering
    load_error = "could not load a question-answering model"
    peft_task_type = "QUESTION_ANS"
    head = "ForQuestionAnswering"
    nouns = ("questions", "answers")
    named_columns = SQUAD_COLUMNS

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        self.extras: dict = {}  # process() keeps the windows and contexts here: predict() is given no data

    def load_tokenizer(self, cfg: Config) -> PreTrainedTokenizerBase:
        """The model's tokenizer, padding on the right: the targets and the windows' offsets count from a row's
        first token (a decoder's tokenizer may pad on the left; the choice is saved with the model)."""
        tokenizer = super().load_tokenizer(cfg)
        tokenizer.padding_side = "right"
        return tokenizer

    def check_options(self, cfg: Config) -> None:
        if cfg.data.doc_stride >= cfg.data.max_length:
            raise UserError(
                f"--doc_stride {cfg.data.doc_stride} must be less than --max_length {cfg.data.max_length} (the windows "
                "overlap by that many tokens)"
            )
        super().check_options(cfg)

    def connect(self, cfg: Config) -> DatasetDict:
        """The raw splits, holding a question, a context and (in training) an answer column; a csv's read as written
        ('007' stays '007', a year's answer 1834 a text: it was refused as "holds int values"; found in audit)."""
        from cloudtrain.data.sources import check_columns, connect_data

        raw = connect_data(cfg.data, {}, [*SQUAD_COLUMNS.values(), cfg.data.label_column])
        check_columns(raw, self.columns(self.data_options(cfg, raw)))
        if self.data_options(cfg, raw).text_pair_column is None:
            raise UserError(
                "--task question_answering reads a context beside each question: the data has no 'context' column; "
                "pass --text_pair_column <name>"
            )
        return raw

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        data = self.data_options(cfg, raw)
        processed = process_answer_spans(raw, tokenizer, data, cfg.training.seed)
        self.extras = processed.extras
        return processed

    def build_config(self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
        config = read_config(cfg.model)
        config.num_labels = 2  # a start and an end score per token (a classifier checkpoint's count would not fit)
        config.problem_type = None
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
        return config

    def replaces_head(self, cfg: Config, data: ProcessedData, announce: bool) -> bool:
        return False  # a span head has no classes to disagree with: a checkpoint's own is kept, or a new one made

    def loss_count(self, batch: dict) -> torch.Tensor:
        return torch.full((), len(batch["start_positions"]), device=batch["start_positions"].device)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean of the start's and the end's cross-entropy, summed over windows (transformers' loss, summed)."""
        inputs = {k: v for k, v in batch.items() if k not in ("start_positions", "end_positions")}
        start, end = span_scores(model(**inputs), inputs)
        return _window_losses(start, end, batch).sum(), self.loss_count(batch)

    def _scores(self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast):
        """Per example id: its windows' (window id, start scores, end scores); the windows' losses where known."""
        assert self.cfg is not None
        width = self.cfg.data.max_length
        by_example: dict[int, list] = defaultdict(list)
        losses: list[torch.Tensor] = []
        with eval_mode(model):
            for batch in batches:
                batch = move(batch)
                windows = batch.pop("window")
                targets = {k: batch.pop(k) for k in ("start_positions", "end_positions") if k in batch}
                with autocast():
                    out = model(**batch)
                start, end = span_scores(out, batch)
                loss = _window_losses(start, end, targets) if targets else torch.zeros_like(start[:, 0])
                start, end, windows, loss = gather(
                    (pad_to_width(start, width, PADDED), pad_to_width(end, width, PADDED), windows, loss)
                )
                losses.append(loss.cpu())
                for w, s, e in zip(windows.tolist(), start.cpu(), end.cpu(), strict=True):
                    by_example[self.extras["windows"][w].example].append((w, s, e))
        return by_example, torch.cat(losses) if losses else torch.zeros(0)

    def _answers(self, by_example: dict[int, list]) -> dict[int, tuple[str, int, float]]:
        """Each example's best answer (text, first character, probability), by example id."""
        assert self.cfg is not None  # a task that trains was built with the run's options
        found = {}
        for example, scored in sorted(by_example.items()):
            context, _ = self.extras["examples"][example]
            windows = [self.extras["windows"][w] for w, _, _ in scored]
            found[example] = best_answer(
                windows,
                [s for _, s, _ in scored],
                [e for _, _, e in scored],
                context,
                self.cfg.data.max_answer_length,
                self.extras["allow_none"],
            )
        return found

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
        start = time.perf_counter()
        by_example, losses = self._scores(model, batches, gather, move, autocast)
        found = self._answers(by_example)
        references = [self.extras["examples"][example][1] for example in found]
        runtime = time.perf_counter() - start
        return {
            **squad_scores([text for text, _, _ in found.values()], references),
            "loss": losses.mean().item() if len(losses) else 0.0,
            "samples": len(found),
            "runtime_s": round(runtime, 3),
            "samples_per_s": round(len(found) / runtime, 2),
        }

    @torch.no_grad()
    def predict(
        self, model: torch.nn.Module, batches: Iterable[dict], gather: Callable, move: Callable, autocast: Callable
    ) -> tuple[list, list]:
        """Each question's answer (text, first character in the context) and its probability, in the split's order."""
        by_example, _ = self._scores(model, batches, gather, move, autocast)
        found = self._answers(by_example)
        return [(text, first) for text, first, _ in found.values()], [score for _, _, score in found.values()]

    def write_predictions(self, output_dir: Path, data: ProcessedData, split: str, predicted: tuple) -> None:
        rows = [
            {"question": question, "answer": text, "start": first, "score": round(score, 4)}
            for question, (text, first), score in zip(data.unlabelled_texts[split], *predicted, strict=True)
        ]
        write_jsonl(Path(output_dir) / f"{split}_predictions.jsonl", rows)

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        return build_model_card(output_dir, cfg, results, CARD)

    def describe_data(self, data: ProcessedData) -> str:
        said = self.data_summary(data, "windows of questions")
        cut, _ = data.extras.get("cut_answers", (0, 0))
        if cut:
            assert self.cfg is not None  # a task that processes data was built with the run's options
            d = self.cfg.data
            said += (
                f"\nnote: {cut} training answers lie whole in no window of --max_length {d.max_length} with "
                f"--doc_stride {d.doc_stride} (the overlap of its windows): they train as no answer; raise either"
            )
        return said

    def describe_metrics(self, metrics: dict) -> str:
        kinds = ""
        for kind in ("has_answer", "no_answer"):  # SQuAD 2.0: how each kind of question fared
            kinds += f" | {kind}_f1 {metrics[f'{kind}_f1']:.2f}" if f"{kind}_f1" in metrics else ""
        return (
            f"f1 {metrics['f1']:.2f} | exact_match {metrics['exact_match']:.2f}{kinds} | loss {metrics['loss']:.4f} "
            f"({metrics['samples']} questions)"
        )

    def inference_hint(self, output_dir: str) -> str:
        none = " --handle_impossible_answer true" if self.extras.get("allow_none") else ""  # as evaluation answered
        return (
            f'{invocation.command()} predict --model_dir {shlex.quote(output_dir)} --text "<question>" '
            f'--text_pair "<context>"{none}'
        )


def _window_losses(start: torch.Tensor, end: torch.Tensor, targets: dict) -> torch.Tensor:
    """Per window: the mean of the start's and the end's cross-entropy."""
    return (
        F.cross_entropy(start, targets["start_positions"].long(), reduction="none")
        + F.cross_entropy(end, targets["end_positions"].long(), reduction="none")
    ) / 2
