"""Turn `make sft`'s R8 topic questions (data/r8-sft, written by scripts/make_r8_sft.py) into preference pairs
for `make dpo`: the same prompt, the right topic chosen, a wrong topic rejected (drawn with a fixed seed). The
R8 train split gives train.jsonl; the held-back test split gives validation.jsonl (pair accuracy and
exact-answer accuracy are measured on it before and after). The texts are licensed for research use: written
under data/, never committed.

    python scripts/make_r8_dpo.py [--source data/r8-sft] [--dest data/r8-dpo] [--seed 0]
"""

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(ROOT / "data" / "r8-sft"))
    parser.add_argument("--dest", default=str(ROOT / "data" / "r8-dpo"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    source, dest = Path(args.source), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (source / f"{split}.jsonl").read_text().splitlines()]
        topics = sorted({row["completion"] for row in rows})
        with (dest / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                wrong = rng.choice([t for t in topics if t != row["completion"]])
                f.write(json.dumps({"prompt": row["prompt"], "chosen": row["completion"], "rejected": wrong}) + "\n")
        print(f"{dest / f'{split}.jsonl'}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
