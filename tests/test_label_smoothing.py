"""--label_smoothing: the training loss of classification, token classification, seq2seq, causal LM and SFT equals
transformers' LabelSmoother (what Trainer's label_smoothing_factor applies) on real tiny models; evaluation's loss
stays the plain cross-entropy; bad values and tasks that do not read it are told in one line."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_each_refused
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)
from transformers.trainer_pt_utils import LabelSmoother

from cloudtrain.config import build_config
from cloudtrain.config.inert import inert_notes
from cloudtrain.data.packing import CausalLMCollator, causal_lm_forward, pack
from cloudtrain.data.processing import ProcessedData
from cloudtrain.tasks import build_task

EPSILON = 0.2


def smoothed_and_plain(task_name: str, model: torch.nn.Module, batch: dict, setup=None) -> tuple[float, float]:
    """The task's training loss per counted label, with --label_smoothing EPSILON and without."""
    losses = []
    for epsilon in (EPSILON, 0.0):
        task = build_task(build_config({"task": task_name, "label_smoothing": epsilon}))
        if setup:
            setup(task)
        total, count = task.loss(model, dict(batch))
        losses.append((total / count).item())
    return losses[0], losses[1]


def reference(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return LabelSmoother(epsilon=EPSILON)({"logits": logits}, labels).item()


def test_a_classifier_s_loss_is_transformers_label_smoothed_loss(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=5).eval()
    batch = {"input_ids": torch.randint(5, 1000, (6, 9)), "labels": torch.tensor([0, 1, 2, 3, 4, 2])}
    smoothed, plain = smoothed_and_plain("classification", model, batch)
    logits = model(input_ids=batch["input_ids"]).logits
    assert smoothed == pytest.approx(reference(logits, batch["labels"]), rel=1e-5)
    assert plain == pytest.approx(F.cross_entropy(logits, batch["labels"]).item(), rel=1e-5) and plain != smoothed


def test_a_token_classifier_smooths_counted_tokens_only(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=7).eval()
    labels = torch.randint(0, 7, (3, 8))
    labels[:, 0], labels[1, 5:] = -100, -100  # [CLS], later pieces of a word and padding count for nothing
    batch = {"input_ids": torch.randint(5, 1000, (3, 8)), "labels": labels}
    smoothed, _ = smoothed_and_plain("token_classification", model, batch)
    assert smoothed == pytest.approx(reference(model(input_ids=batch["input_ids"]).logits, labels), rel=1e-5)


def test_seq2seq_smooths_the_target_tokens(tiny_t5_dir):
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir).eval()
    labels = torch.randint(3, model.config.vocab_size, (4, 6))
    labels[2, 3:] = -100  # a shorter target's padding
    batch = {"input_ids": torch.randint(3, model.config.vocab_size, (4, 10)), "labels": labels}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])

    def decoder_ids(task) -> None:  # what build_config reads off the checkpoint in a run
        task.decoder_ids = (model.config.decoder_start_token_id, model.config.pad_token_id)

    smoothed, plain = smoothed_and_plain("seq2seq", model, batch, decoder_ids)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    assert smoothed == pytest.approx(reference(out.logits, labels), rel=1e-5)
    assert plain == pytest.approx(out.loss.item(), rel=1e-5)  # transformers' own loss, unsmoothed

    task = build_task(build_config({"task": "seq2seq", "label_smoothing": EPSILON, "max_target_length": 6}))
    decoder_ids(task)
    task.tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)  # evaluation decodes what it generates
    same = lambda x: x  # noqa: E731 (one process: gathering and moving change nothing)
    evaluated = task.evaluate(model, [dict(batch)], None, same, same, contextlib.nullcontext)
    assert evaluated["loss"] == pytest.approx(out.loss.item(), rel=1e-5)  # evaluation's loss is not smoothed


@pytest.mark.parametrize("task_name", ["causal_lm", "sft"])
def test_a_decoder_s_next_token_loss_over_packed_documents_is_transformers_shifted_one(task_name, tiny_llama_dir):
    """The plain logits path (the fused one equals it: tests/test_kernels.py), over bfd-packed documents."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    documents = [torch.randint(3, 200, (n,)).tolist() for n in (9, 30, 4, 17, 22)]
    batch = CausalLMCollator(0)(pack(documents, 40, "bfd"))
    smoothed, plain = smoothed_and_plain(task_name, model, batch)
    logits = causal_lm_forward(model, batch)
    expected = LabelSmoother(epsilon=EPSILON)({"logits": logits}, batch["labels"], shift_labels=True).item()
    assert smoothed == pytest.approx(expected, rel=1e-5) and plain != smoothed

    task = build_task(build_config({"task": task_name, "label_smoothing": EPSILON}))
    targets = torch.full_like(batch["labels"], -100)
    targets[:, :-1] = batch["labels"][:, 1:]  # a context-parallel slice's targets come shifted already
    total, count = task.loss(model, {**batch, "targets": targets})
    assert (total / count).item() == pytest.approx(smoothed, rel=1e-5)
    same = lambda x: x  # noqa: E731 (one process: gathering and moving change nothing)
    data = ProcessedData(train=None, validation=None, test=None, collator=None)  # no sample prompts
    evaluated = task.evaluate(model, [dict(batch)], data, same, same, contextlib.nullcontext)
    assert evaluated["loss"] == pytest.approx(plain, rel=1e-5)  # evaluation's loss is not smoothed


def test_bad_values_are_refused_and_other_tasks_are_told(tmp_path, capsys):
    out = tmp_path / "out"
    cases = {
        "one": ({"label_smoothing": "1", "output_dir": str(out)}, "--label_smoothing must be in [0, 1) (0: off"),
        "negative": ({"label_smoothing": "-0.1", "output_dir": str(out)}, "--label_smoothing must be in [0, 1)"),
    }
    assert_each_refused(cases, capsys, out)
    assert inert_notes(build_config({"task": "dpo", "label_smoothing": 0.1})) == [
        "--label_smoothing 0.1 has no effect on --task dpo; it counts for --task classification, "
        "token_classification, seq2seq, causal_lm or sft"
    ]
    assert inert_notes(build_config({"task": "seq2seq", "label_smoothing": 0.1})) == []
