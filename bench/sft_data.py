"""bench/sft_bench.py's data: Reuters R8 articles as instruction pairs, cut to fit, and their chat messages."""

import csv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
R8 = REPO / "data" / "reuters-r8"
QUESTION = "Which topic is this article about: acq, crude, earn, grain, interest, money-fx, ship or trade?\n\n"


def read_r8(path: Path, limit: int) -> list[tuple[str, str]]:
    """(category, text) of the first `limit` rows of an R8 .tab file (three header rows)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for i, row in enumerate(csv.reader(f, delimiter="\t")):
            if i < 3 or len(row) != 2 or not row[1].strip():
                continue
            rows.append((row[0], row[1]))
            if len(rows) == limit:
                break
    return rows


def to_pair(category: str, text: str, chat, max_length: int) -> dict:
    """The instruction pair, the article cut to its first words so the whole example fits in `max_length`."""
    words = text.split()
    n = len(words)
    while True:
        pair = {"prompt": QUESTION + " ".join(words[:n]), "completion": category}
        length = len(chat.encode(messages(pair))[0])
        if length <= max_length or n <= 1:
            return pair
        n = max(1, min(n - 1, int(n * max_length / length)))


def messages(pair: dict) -> list[dict]:
    return [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair["completion"]}]
