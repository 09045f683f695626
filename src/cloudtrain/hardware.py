"""What this machine computes fast: the choices behind the `auto` defaults, and the CPU allocator.

`--mixed_precision auto` trains in bf16 where the device computes it natively (CUDA GPUs from Ampere
on; CPUs with AVX512-BF16 or AMX) and in fp32 elsewhere, where emulated bf16 would be slower.
On the 2-core AVX512-BF16 CPU of bench/, bf16 autocast trained MiniLM 1.7-2.2x faster than fp32 at
the same accuracy (bench/results/latest.md).
"""

import contextlib
import ctypes
import functools
import os
import sys

import torch

# For tests only: "1" or "0" makes `native_bf16("cpu")` answer as on a CPU with or without native bf16, so the
# suite can be run as on the other kind of CPU (`make test-other-cpu`). Children of a run inherit it.
FORCE_CPU_BF16 = "CLOUDTRAIN_TEST_CPU_BF16"


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` ("cuda" or "cpu") runs bf16 matrix products in hardware."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    forced = os.environ.get(FORCE_CPU_BF16, "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"{FORCE_CPU_BF16}={forced!r}: set it to 1 (native bf16), 0 (none), or leave it unset")
    return forced == "1" if forced else cpu_has_bf16()


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products in hardware, whatever FORCE_CPU_BF16 says."""
    try:  # oneDNN's own check (AVX512-BF16 or AMX), the one PyTorch's CPU kernels dispatch on
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(requested: str) -> str:
    """`requested` itself, or for auto: the launcher's precision if its config set one, else bf16
    where the training device computes it natively, else no (fp32)."""
    if requested != "auto":
        return requested
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher != "no":
        return launcher
    return "bf16" if native_bf16("cuda" if torch.cuda.is_available() else "cpu") else "no"


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the OS; True if applied.

    By default glibc serves blocks of over 32 MiB (an embedding's gradient) with mmap and unmaps
    them on free, and trims the heap; each training step then page-faults tens of MiB back in.
    bench/ measured 16-37 thousand page faults and up to 70 ms of system time per CPU step without
    this, about none with it. For CPU training; a preloaded jemalloc/tcmalloc ignores it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl)
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The training step's autocast for a resolved --mixed_precision (no autocast for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul or attention kernel of `tensor` runs in: autocast's where it is on for its device (fp32
    master weights, 16-bit compute), else the tensor's own. For code that switches autocast off, or that picks a
    kernel by dtype, to do the cast autocast would do."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype
