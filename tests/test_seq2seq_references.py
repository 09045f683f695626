"""Several references per row: BLEU and ROUGE against hand-computed values (and sacreBLEU, rouge_score's
score_multi)."""

import math
import random

import pytest
import sacrebleu
from rouge_score import rouge_scorer

from cloudtrain.metrics.text_overlap import bleu, closest_length, rouge


def test_bleu_of_several_references_equals_the_definition():
    # row 1: "the cat sat on the mat" against two references of 6 and 7 words
    #   1-grams 5/6 (the x2, cat, on, mat; "sat" in neither), 2-grams 3/5 (the cat, on the, the mat),
    #   3-grams 1/4 (on the mat), 4-grams 0/3; length 6, the closest reference 6: no brevity penalty
    # row 2: "a b c d e" against references of 7 and 6 words holding it: every n-gram matches (5/5 4/4 3/3 2/2),
    #   length 5, the closest reference 6
    predictions = ["the cat sat on the mat", "a b c d e"]
    references = [["the cat is on the mat", "there is a cat on the mat"], ["a b c d e f g", "a b c d e f"]]
    alone = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / (2 * 3)) ** (1 / 4)  # the empty 4-gram order smoothed: 1 / (2 * 3)
    assert bleu(predictions[:1], references[:1]) == pytest.approx(alone, abs=1e-9)
    assert bleu(predictions[1:], references[1:]) == pytest.approx(100 * math.exp(1 - 6 / 5), abs=1e-9)
    corpus = 100 * math.exp(1 - 12 / 11) * (10 / 11 * 7 / 9 * 4 / 7 * 2 / 5) ** (1 / 4)  # lengths 11 against 6 + 6
    assert bleu(predictions, references) == pytest.approx(corpus, abs=1e-9)
    # two references as close (4 and 6 words around 5): the shorter counts, so no brevity penalty
    assert closest_length(5, [6, 4]) == 4 == closest_length(5, [4, 6])
    assert bleu(["a b c d e"], [["a b c d e f", "a b c d"]]) == pytest.approx(100)
    for ours, refs in ((alone, references[:1]), (corpus, references)):
        streams = [list(stream) for stream in zip(*refs, strict=True)]
        assert sacrebleu.corpus_bleu(predictions[: len(refs)], streams).score == pytest.approx(ours, abs=1e-9)


def test_bleu_and_rouge_of_several_references_equal_the_reference_packages():
    rng = random.Random(2)
    words = 'the cat sat on a mat . , 3.5 dog\'s "quoted" x-ray (big) over! Yes? CAT'.split()

    def text(least: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(least, 12)))

    predictions = [text(0) for _ in range(200)]
    references = [[text(1) for _ in range(3)] for _ in range(200)]
    streams = [list(stream) for stream in zip(*references, strict=True)]
    for size in (200, 30, 2):
        theirs = sacrebleu.corpus_bleu(predictions[:size], [s[:size] for s in streams]).score
        assert bleu(predictions[:size], references[:size]) == pytest.approx(theirs, abs=1e-9)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    ours = rouge(predictions, references)
    for name in ("rouge1", "rouge2", "rougeL"):
        best = [scorer.score_multi(refs, p)[name].fmeasure for p, refs in zip(predictions, references, strict=True)]
        assert ours[name] == pytest.approx(100 * sum(best) / len(best), abs=1e-9), name


def test_rouge_takes_each_metrics_best_reference():
    # "a b c d" against "a b": rouge1 F 2/3 (P 2/4, R 2/2), rouge2 F 1/2 (ab of 3 bigrams; 1 of 1), LCS 2: 2/3
    # against "d c b a x": rouge1 F 8/9 (P 4/4, R 4/5), rouge2 0, LCS 1: F 2/9
    scores = rouge(["a b c d"], [["a b", "d c b a x"]])
    assert scores == pytest.approx({"rouge1": 800 / 9, "rouge2": 50.0, "rougeL": 200 / 3, "rougeLsum": 200 / 3})
    # one reference in a list scores as that reference alone (bit for bit)
    predictions, targets = ["red cat runs", "a dog"], ["the red cat", "a big dog sleeps"]
    assert rouge(predictions, [[t] for t in targets]) == rouge(predictions, targets)
    assert bleu(predictions, [[t] for t in targets]) == bleu(predictions, targets)
