#!/usr/bin/env bash
# The wheelhouse to carry to the lent GPU machine (../shared/notes/FACTS.md, "The GPU machine"): the shared tool's
# packages plus those cloudtrain's gpu tier imports there and the machine lacks: xxhash (datasets), requests and
# its dependencies (evaluate, diffusers), diffusers, liger-kernel (--fused_cross_entropy and --liger_kernels). scripts/gpu_rehearsal.sh checks the result on CPU.
#   scripts/gpu_wheels.sh [DEST]     (default .gpu-wheels; EXTRA="pkg==v ..." adds more)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="xxhash==4.1.0 requests==2.34.2 charset-normalizer urllib3==2.8.0 certifi diffusers==0.42.1 liger-kernel==0.8.5 ${EXTRA:-}" \
  exec ../shared/tools/gpu-wheelhouse.sh "${1:-.gpu-wheels}"
