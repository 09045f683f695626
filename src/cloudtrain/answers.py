"""Answers from a question-answering model's start and end scores, and SQuAD's exact match and F1.

A context longer than --max_length is read in windows (cloudtrain.data.answer_spans); the answer is the best span
over all windows of an example: the highest start + end score among the spans that lie in the context, end at or
after their start and are at most --max_answer_length tokens long. Where the data has questions without an answer
(SQuAD 2.0), "no answer" (the empty string) wins when its score (the first token's start + end score, the lowest
over the windows) beats the best span's. Scores are reported as the span's probability within its window.

The metrics follow SQuAD's evaluation script: answers are compared after lower-casing and removing punctuation,
articles (a, an, the) and extra whitespace; an example scores the best over its reference answers.
"""

import collections
import re
import string
from dataclasses import dataclass

import numpy as np
import torch

PADDED = -1e4  # the score of a padded position: below any real token's
ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = set(string.punctuation)


@dataclass
class Window:
    """One window of an example's context: its tokens' character offsets into the context, [tokens, 2] ((-1, -1) for
    a token outside the context: the question, special tokens)."""

    example: int
    offsets: np.ndarray


def best_answer(
    windows: list[Window],
    start_scores: list[torch.Tensor],
    end_scores: list[torch.Tensor],
    context: str,
    max_answer_length: int,
    allow_none: bool,
    candidates: int = 20,
) -> tuple[str, int, float]:
    """(answer text, its first character in `context` (-1 for no answer), its probability within its window)
    over an example's windows and their [tokens] scores."""
    best: tuple[float, str, int, float] = (-float("inf"), "", -1, 0.0)
    none: tuple[float, float] = (float("inf"), 0.0)  # the lowest score of no answer over the windows, its probability
    for window, start, end in zip(windows, start_scores, end_scores, strict=True):
        start, end = start[: len(window.offsets)].float(), end[: len(window.offsets)].float()
        probability = torch.softmax(start, 0)[:, None] * torch.softmax(end, 0)[None, :]
        none = min(none, ((start[0] + end[0]).item(), probability[0, 0].item()))
        for i in torch.topk(start, min(candidates, len(start))).indices.tolist():
            for j in torch.topk(end, min(candidates, len(end))).indices.tolist():
                first, last = window.offsets[i], window.offsets[j]
                if first[0] < 0 or last[0] < 0 or j < i or j - i + 1 > max_answer_length:
                    continue
                score = (start[i] + end[j]).item()
                if score > best[0]:
                    span = context[first[0] : last[1]]  # a byte-level BPE token's offsets take its leading space
                    if not span.strip():  # a token of whitespace alone ("\n\n") is no answer
                        continue
                    lead = len(span) - len(span.lstrip())
                    best = (score, span.strip(), int(first[0]) + lead, probability[i, j].item())
    if allow_none and none[0] > best[0]:
        return "", -1, none[1]
    return best[1], best[2], best[3]


def span_scores(out, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A question-answering model's start and end scores in float32, a padded position's at PADDED: out of the
    softmax, so that a window's loss and probabilities do not depend on the batch it was padded in."""
    start, end = out.start_logits.float(), out.end_logits.float()
    if "attention_mask" in inputs:
        padded = inputs["attention_mask"] == 0
        start, end = start.masked_fill(padded, PADDED), end.masked_fill(padded, PADDED)
    return start, end


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    predicted, referenced = normalize(prediction).split(), normalize(reference).split()
    if not predicted or not referenced:  # "no answer" on either side: right only if both are
        return float(predicted == referenced)
    common = sum((collections.Counter(predicted) & collections.Counter(referenced)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(referenced)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: list[str], references: list[list[str]]) -> dict:
    """Exact match and F1 in percent, each example scored against its best reference ([] or references that
    normalise to nothing: ""). Where some questions have no answer ([]: SQuAD 2.0), also each kind's own,
    has_answer_* and no_answer_* with their counts, as SQuAD 2.0's script reports HasAns and NoAns."""
    kinds: dict[str, list[tuple[float, float]]] = {"has_answer": [], "no_answer": []}
    for prediction, answers in zip(predictions, references, strict=True):
        kind = "has_answer" if answers else "no_answer"  # the script's grouping: by the raw list
        answers = [answer for answer in answers if normalize(answer)] or [""]
        exact = max(float(normalize(prediction) == normalize(answer)) for answer in answers)
        kinds[kind].append((exact, max(token_f1(prediction, answer) for answer in answers)))
    scores = _percent(kinds["has_answer"] + kinds["no_answer"], "")
    if kinds["no_answer"]:
        for kind, scored in kinds.items():
            if scored:
                scores |= _percent(scored, f"{kind}_") | {f"{kind}_total": len(scored)}
    return scores


def _percent(scored: list[tuple[float, float]], prefix: str) -> dict[str, float]:
    n = len(scored)
    return {
        f"{prefix}exact_match": 100 * sum(e for e, _ in scored) / n if n else 0.0,
        f"{prefix}f1": 100 * sum(f for _, f in scored) / n if n else 0.0,
    }
