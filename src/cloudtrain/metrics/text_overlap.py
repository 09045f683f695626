"""How close generated texts are to their references: ROUGE (summaries) and BLEU (translations), as percentages.

ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum are F1 scores per example, averaged: the words are rouge_score's
(lower-cased runs of letters and digits, no stemming), except that letters outside ASCII count as letters too
(rouge_score drops them, so a summary in Greek scores 0). ROUGE-Lsum is the summary-level LCS over sentences
(`sentences`: lines, and breaks after . ! or ? before a space, or after 。！？), as rouge_score scores texts of one
sentence a line. With `porter_stemmer()` words of more than three letters are stemmed first, as rouge_score's
use_stemmer=True (what transformers' run_summarization.py reports). BLEU is corpus BLEU over the whole split as
sacreBLEU computes it by default: its 13a tokenization, n-grams up to 4, the brevity penalty over the corpus,
exponential smoothing of empty orders. tests/test_seq2seq.py checks both against those packages.

A row may have several references (a list of texts): ROUGE takes, per metric, the best F1 over them (rouge_score's
score_multi); BLEU clips each n-gram's count by its most in any one reference and measures the brevity penalty
against the reference length closest to the generation's (the shorter on a tie), as sacreBLEU and the original
BLEU do. A row of one text scores exactly as a list of that text alone.
"""

import functools
import math
import operator
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from cloudtrain.errors import UserError

Stemmer = Callable[[str], str]
References = str | Sequence[str]  # a row's reference, or its several references


def _all(reference: References) -> Sequence[str]:
    return [reference] if isinstance(reference, str) else reference


_WORD = re.compile(r"[^\W_]+")  # letters and digits, any script
# a sentence ends at a line break, at . ! ? (and any closing quotes or brackets) before white space, or at a full
# stop of a script written without spaces (Chinese and Japanese 。！？)
_SENTENCE_END = re.compile(r"\n|(?<=[.!?])[\"'”’)\]]*\s+|(?<=[。！？])[」』”’）]*\s*")


def rouge_words(text: str, stem: Stemmer | None = None) -> list[str]:
    words = _WORD.findall(text.lower())
    return [stem(word) if len(word) > 3 else word for word in words] if stem else words


def porter_stemmer() -> Stemmer:
    """NLTK's Porter stemmer (rouge_score's), or a UserError saying how to install it."""
    try:
        from nltk.stem.porter import PorterStemmer
    except ImportError:
        raise UserError("--rouge_stemmer true needs NLTK's Porter stemmer: pip install nltk") from None
    return functools.lru_cache(maxsize=1 << 16)(PorterStemmer().stem)  # summaries repeat their words


def _ngrams(words: Sequence[str], n: int) -> Counter:
    return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def _f1(overlap: int, predicted: int, reference: int) -> float:
    if not overlap:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _lcs_rows(a: Sequence[str], b: Sequence[str]) -> Iterator[list[int]]:
    """The rows of the longest-common-subsequence table of `a` against `b`, one per word of `a` (after a row of 0s):
    row i, column j is the LCS length of a[:i] and b[:j]."""
    previous = [0] * (len(b) + 1)
    yield previous
    for x in a:
        row = [0]
        for j, y in enumerate(b):
            row.append(previous[j] + 1 if x == y else max(previous[j + 1], row[j]))
        yield row
        previous = row


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    """The length of the longest common subsequence (one row of the table kept at a time)."""
    return deque(_lcs_rows(a, b), maxlen=1)[0][-1]


def _lcs_positions(a: Sequence[str], b: Sequence[str]) -> set[int]:
    """The positions in `a` of one longest common subsequence with `b`: read back from the end of the full table,
    dropping a word of `a` where both ways keep the length (rouge_score's choice, which the union below depends on)."""
    table = list(_lcs_rows(a, b))
    i, j, found = len(a), len(b), set()
    while i and j:
        if a[i - 1] == b[j - 1]:
            i, j = i - 1, j - 1
            found.add(i)
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return found


def sentences(text: str, stem: Stemmer | None = None) -> list[list[str]]:
    """The words of each sentence of `text` (empty sentences left out)."""
    return [words for part in _SENTENCE_END.split(text) if (words := rouge_words(part, stem))]


def _summary_lcs(predicted: list[list[str]], reference: list[list[str]]) -> float:
    """ROUGE-Lsum F1: for each reference sentence, the union of its words in an LCS with each predicted sentence;
    a word counts as often as it occurs on both sides, at most."""
    left_p = Counter(word for sentence in predicted for word in sentence)
    left_r = Counter(word for sentence in reference for word in sentence)
    size_p, size_r = sum(left_p.values()), sum(left_r.values())
    hits = 0
    for sentence in reference:
        union = set().union(*(_lcs_positions(sentence, other) for other in predicted))
        for word in (sentence[i] for i in sorted(union)):
            if left_p[word] > 0 and left_r[word] > 0:
                hits, left_p[word], left_r[word] = hits + 1, left_p[word] - 1, left_r[word] - 1
    return _f1(hits, size_p, size_r)


def rouge_pair(prediction: str, reference: str, stem: Stemmer | None = None) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F1 of one prediction against its reference, each in [0, 1]."""
    pred, ref = rouge_words(prediction, stem), rouge_words(reference, stem)
    scores = {}
    for n in (1, 2):
        p, r = _ngrams(pred, n), _ngrams(ref, n)
        scores[f"rouge{n}"] = _f1(sum((p & r).values()), sum(p.values()), sum(r.values()))
    scores["rougeL"] = _f1(_lcs(pred, ref), len(pred), len(ref))
    scores["rougeLsum"] = _summary_lcs(sentences(prediction, stem), sentences(reference, stem))
    return scores


def rouge_best(prediction: str, references: References, stem: Stemmer | None = None) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F1 of one prediction against its best reference, per metric (rouge_score's score_multi:
    each metric's best may come from a different reference)."""
    scores = [rouge_pair(prediction, reference, stem) for reference in _all(references)]
    return {name: max(score[name] for score in scores) for name in scores[0]}


def rouge(
    predictions: Sequence[str], references: Sequence[References], stem: Stemmer | None = None
) -> dict[str, float]:
    """The mean ROUGE-1/2/L/Lsum F1 over the examples, in percent (0 for none); a row's references: one text, or a
    list (its best per metric); `stem`: porter_stemmer() or none."""
    totals = Counter({"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "rougeLsum": 0.0})
    for prediction, reference in zip(predictions, references, strict=True):
        totals.update(rouge_best(prediction, reference, stem))
    return {name: 100 * total / max(len(predictions), 1) for name, total in totals.items()}


# mteval-v13a's tokenization, as sacreBLEU applies it: punctuation and symbols split off, periods and commas
# except between digits, a dash after a digit
_13A_RULES = [
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),
]
_ENTITIES = {"&quot;": '"', "&amp;": "&", "&lt;": "<", "&gt;": ">"}


def bleu_words(text: str) -> list[str]:
    text = text.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in text:
        for entity, char in _ENTITIES.items():
            text = text.replace(entity, char)
    text = f" {text} "
    for rule, replacement in _13A_RULES:
        text = rule.sub(replacement, text)
    return text.split()


def closest_length(predicted: int, lengths: Iterable[int]) -> int:
    """The reference length the brevity penalty measures against: the closest to the prediction's, the shorter of
    two as close (sacreBLEU's, and the original BLEU's)."""
    return min(lengths, key=lambda length: (abs(length - predicted), length))


def bleu(predictions: Sequence[str], references: Sequence[References], order: int = 4) -> float:
    """Corpus BLEU of the predictions against their references (one text, or a list: each n-gram's count clipped
    by its most in any one of them), in percent."""
    matches, totals = [0] * order, [0] * order
    predicted_length = reference_length = 0
    for prediction, reference in zip(predictions, references, strict=True):
        pred, refs = bleu_words(prediction), [bleu_words(text) for text in _all(reference)]
        predicted_length += len(pred)
        reference_length += closest_length(len(pred), (len(ref) for ref in refs))
        for n in range(1, order + 1):
            most = functools.reduce(operator.or_, (_ngrams(ref, n) for ref in refs))  # per n-gram: its max count
            matches[n - 1] += sum((_ngrams(pred, n) & most).values())
            totals[n - 1] += max(len(pred) - n + 1, 0)
    if not any(matches):  # no word in common anywhere (an untrained model): 0, not a smoothed guess
        return 0.0
    log_precision, halvings = 0.0, 1.0
    for matched, total in zip(matches, totals, strict=True):
        if not total:
            return 0.0  # a corpus shorter than `order` words has no n-grams of that order
        if not matched:  # exponential smoothing: each order without a match counts half the one before
            halvings *= 2
        log_precision += math.log((matched or 1 / halvings) / total)
    brevity = 1.0 if predicted_length > reference_length else math.exp(1 - reference_length / predicted_length)
    return 100 * brevity * math.exp(log_precision / order)
