"""Entities in a sequence of word tags, and the entity-level scores of `--task token_classification`.

Tags are IOB2 (B-PER I-PER O), IOB1, IOBES/BILOU (S-, E-, U-, L-) or plain IO (a tag without a prefix, such as
PER, is an I- tag). Where an entity starts and ends follows conlleval's rules, as seqeval's default mode does: an
I- tag after O or after another type starts an entity, so a model's imperfect sequences still score. An entity is
right when its type and both its ends match; precision, recall and F1 count entities over the whole split (micro),
and each type has its own F1.
"""

PREFIXES = {"B": "B", "I": "I", "E": "E", "S": "S", "L": "E", "U": "S"}  # BILOU read as IOBES


def split_tag(tag: str) -> tuple[str, str]:
    """(prefix, type): "B-PER" -> ("B", "PER"), "O" -> ("O", ""), "PER" -> ("I", "PER")."""
    if tag == "O":
        return "O", ""
    prefix, dash, kind = tag.partition("-")
    if dash and prefix in PREFIXES and kind:
        return PREFIXES[prefix], kind
    return "I", tag


def entity_spans(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first word, one past the last word) of each entity of `tags`, in order."""
    spans: list[tuple[str, int, int]] = []
    start, previous, previous_kind = -1, "O", ""
    for i, tag in enumerate([*tags, "O"]):  # the extra O closes an entity at the end
        prefix, kind = split_tag(tag)
        # conlleval's endOfChunk; its startOfChunk then holds for any tag but O, so an ended entity is followed by
        # a new one exactly when this tag is not O
        if start >= 0 and (previous in ("E", "S") or prefix in ("B", "S", "O") or previous_kind != kind):
            spans.append((previous_kind, start, i))
            start = -1
        if start < 0 and prefix != "O":
            start = i
        previous, previous_kind = prefix, kind
    return spans


def scored_entities(tags: list[str | None], scores: list[float]) -> list[tuple[str, int, int, float]]:
    """(type, first word, one past the last word, the mean probability of its tagged words' tags) of each entity; a
    word without a tag (None: it had no token to predict from) is passed over, as evaluation leaves it out, so it
    may sit inside an entity."""
    tagged = [i for i, tag in enumerate(tags) if tag is not None]
    found = []
    for kind, a, b in entity_spans([tag for tag in tags if tag is not None]):
        inside = tagged[a:b]
        found.append((kind, inside[0], inside[-1] + 1, round(sum(scores[i] for i in inside) / len(inside), 4)))
    return found


def entity_scores(references: list[list[str]], predictions: list[list[str]]) -> dict:
    """Entity-level micro precision, recall and F1, the share of words tagged right, and the F1 of each type found
    or expected, over rows of tags (each prediction as long as its reference)."""
    right: dict[str, int] = {}
    found: dict[str, int] = {}
    expected: dict[str, int] = {}
    words = correct = 0
    for reference, prediction in zip(references, predictions, strict=True):
        gold, guessed = set(entity_spans(reference)), set(entity_spans(prediction))
        for counts, spans in ((expected, gold), (found, guessed), (right, gold & guessed)):
            for kind, _, _ in spans:
                counts[kind] = counts.get(kind, 0) + 1
        words += len(reference)
        correct += sum(r == p for r, p in zip(reference, prediction, strict=True))
    tp, n_found, n_expected = sum(right.values()), sum(found.values()), sum(expected.values())
    kinds = sorted(set(found) | set(expected))
    return {
        "precision": tp / n_found if n_found else 0.0,
        "recall": tp / n_expected if n_expected else 0.0,
        "f1": 2 * tp / (n_found + n_expected) if n_found + n_expected else 0.0,
        "accuracy": correct / words if words else 0.0,
        "entity_f1": {
            kind: round(2 * right.get(kind, 0) / (found.get(kind, 0) + expected.get(kind, 0)), 4) for kind in kinds
        },
    }
