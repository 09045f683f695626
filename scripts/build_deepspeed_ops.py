"""Compile DeepSpeed's ops into torch's extension cache ahead of a run: the async I/O op (ZeRO-Infinity's
--offload_* nvme; it loads the pinned-memory op with it) and, with --for_tests, the shared-memory comm op that
every DeepSpeed launch on CPU loads.

DeepSpeed compiles them on first use otherwise, minutes into a run (async I/O: 3 minutes on 2 idle cores, more
under load). Each is loaded exactly as a run loads it: torch writes the op's build.ninja and ninja rebuilds only
what differs from the cache, so an up-to-date op costs seconds and a stale one (compiled by another checkout: the
build names its venv's absolute source paths) is compiled again here rather than inside a run. Where libaio is not
installed the async I/O op cannot be built and the application refuses --offload_* nvme in one line; this says so
and goes on (nothing else needs the op).

    python scripts/build_deepspeed_ops.py [--for_tests]

--for_tests builds what the test suite's launches load, where they load it: with no GPU visible (the suite's
launches hide it, and DeepSpeed then picks its CPU builders) into the venv's own extension cache,
`<venv>/torch_extensions` (tests/conftest.py points the suite there; docs/testing.md says why).
"""

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path


def suite_extensions_dir() -> Path | None:
    """The test suite's extension cache (tests/conftest.py sets the same): the venv's, None outside a venv."""
    return Path(sys.prefix) / "torch_extensions" if sys.prefix != sys.base_prefix else None


def load(builder_name: str) -> None:
    """Load one op as a run does (compiling what is stale) and say whether it had to compile."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    from cloudtrain.parallel.distributed import clear_stale_build_locks

    builder = get_accelerator().create_op_builder(builder_name)
    with contextlib.redirect_stdout(io.StringIO()):  # its verbose compatibility report goes to stdout
        compatible = builder is not None and builder.is_compatible(verbose=False)
    if not compatible:
        if builder_name == "AsyncIOBuilder":
            print("deepspeed-ops: libaio is not installed, so --offload_* nvme is refused (apt-get install libaio-dev)")
        return
    library = Path(_get_build_directory(builder.NAME, verbose=False)) / f"{builder.NAME}.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    print(f"deepspeed-ops: {builder.NAME} into {library.parent.parent} ...", flush=True)
    clear_stale_build_locks()
    start = time.monotonic()
    builder.load(verbose=False)
    took = time.monotonic() - start
    compiled = not library.exists() or library.stat().st_mtime_ns != before
    print(f"deepspeed-ops: {builder.NAME} {'compiled' if compiled else 'already up to date'} ({took:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--for_tests", action="store_true", help="build what the test suite's launches load")
    args = parser.parse_args()
    builders = ["AsyncIOBuilder"]
    if args.for_tests:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the launches' environment
        folder = suite_extensions_dir()
        if folder is not None:
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(folder))
        builders.append("ShareMemCommBuilder")
    for name in builders:
        load(name)


if __name__ == "__main__":
    main()
