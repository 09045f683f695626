"""Turn the Reuters R8 news (fetched by scripts/fetch_r8.py) into instruction/answer pairs for `make sft`.

Each article becomes a prompt/completion pair: "Which topic is this article about: acq, crude, ...?"
followed by the article's first --words words, answered by its topic. The R8 train split gives
train.jsonl; the test split gives validation.jsonl (held back: the before/after accuracy is measured
on it). The texts are licensed for research use: written under data/, never committed.

    python scripts/make_r8_sft.py [--words 32] [--dest data/r8-sft]
"""

import argparse
import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "data" / "reuters-r8"
SPLITS = {"train": "reuters-r8-train.tab", "validation": "reuters-r8-test.tab"}


def read_tab(path: Path) -> list[tuple[str, str]]:
    """(topic, text) rows of an Orange .tab file (three header rows: names, types, flags)."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    names = rows[0]
    topic, text = names.index("Category"), names.index("Text")
    return [(row[topic], row[text]) for row in rows[3:] if len(row) > max(topic, text)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=32, help="Words of each article kept in the prompt.")
    parser.add_argument("--dest", default=str(ROOT / "data" / "r8-sft"))
    args = parser.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    rows = {split: read_tab(SOURCE / name) for split, name in SPLITS.items()}
    topics = sorted({topic for topic, _ in rows["train"]})
    question = f"Which topic is this article about: {', '.join(topics[:-1])} or {topics[-1]}?"
    for split, pairs in rows.items():
        with (dest / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for topic, text in pairs:
                article = " ".join(text.split()[: args.words])
                f.write(json.dumps({"prompt": f"{question}\n\n{article}", "completion": topic}) + "\n")
        print(f"{dest / f'{split}.jsonl'}: {len(pairs)} pairs")


if __name__ == "__main__":
    main()
