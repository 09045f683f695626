"""Compile DeepSpeed's async I/O op (ZeRO-Infinity's --offload_* nvme) into torch's extension cache, ahead of a run.

DeepSpeed compiles it on first use otherwise, minutes into a run (3 minutes on 2 idle cores, more under load).
Where libaio is not installed the op cannot be built and the application refuses --offload_* nvme in one line;
this says so and exits 0 (nothing else needs the op). Already compiled: returns at once.
"""

import contextlib
import io
import time

from deepspeed.ops.op_builder import AsyncIOBuilder

from cloudtrain.parallel.distributed import aio_built


def main() -> None:
    if aio_built():
        print("deepspeed-ops: DeepSpeed's async I/O op is already compiled")
        return
    with contextlib.redirect_stdout(io.StringIO()):
        compatible = AsyncIOBuilder().is_compatible(verbose=False)
    if not compatible:
        print("deepspeed-ops: libaio is not installed, so --offload_* nvme is refused (apt-get install libaio-dev)")
        return
    print("deepspeed-ops: compiling DeepSpeed's async I/O op for --offload_* nvme, once (minutes) ...", flush=True)
    start = time.monotonic()
    AsyncIOBuilder().load(verbose=False)
    print(f"deepspeed-ops: compiled in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
