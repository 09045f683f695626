#!/usr/bin/env bash
# Everything GPU-specific in one prepared run, on a GPU machine that reaches no package registry (the
# project's lent H100: torch 2.11 and some packages installed, the rest carried as wheels).
#
# Here, once:   scripts/gpu_wheels.sh                             (about 36 MB; ignored by git)
#               make data/grimm/train.txt                           (the Grimm tales bench/gpu.py trains on)
# There:        scripts/gpu_session.sh [tier|bench|all]             (carry .gpu-wheels and data/grimm)
#
#   tier   scripts/gpu_check.py: versions and device, the gpu tier, bench/gpu.py's defaults for 40 steps
#          (issue 29's checks; under 8 minutes on one H100)
#   bench  bench/gpu.py, every variant on the 515M preset and then the 1.04B shape, within BENCH_S seconds
#          (issue 30's figures and issue 29's planner comparison)
#   all    both, in that order
#
# Everything is written to outputs/gpu-session; at the end the reports (versions, the check's report.md, the
# benchmarks' .md) are copied to $OUT with one archive of all logs and JSON (the device tool's $OUT returns at
# most 8 files). Each stage ends inside its own time limit, so what it measured comes back.
set -uo pipefail
STAGE=${1:-all}
RESULTS=${OUT:-}
OUT=outputs/gpu-session
BENCH_S=${BENCH_S:-420}
rm -rf "$OUT"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

PY=${PY:-python3}
SITE=${GPU_SITE:-/tmp/site}  # where the wheelhouse is installed (GPU_SITE: elsewhere, e.g. to rehearse it on CPU)
if [ -d .gpu-wheels ]; then  # the carried wheelhouse, installed beside the machine's own torch
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .gpu-wheels/*.whl || exit 1
  cp -r .gpu-wheels/site/. "$SITE/"
  export PYTHONPATH=$SITE:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; "$PY" -c \
  'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'
} 2>&1 | tee "$OUT/versions.txt"

status=0
if [ "$STAGE" = tier ] || [ "$STAGE" = all ]; then
  # gpu_check.py writes report.md/.json, the tier's junit and the bench JSON into one folder (one level down)
  timeout 520 "$PY" scripts/gpu_check.py --out "$OUT/check" --workers 4 --steps 40 --bench_budget_s 150 \
    >"$OUT/check.log" 2>&1 || status=1
  tail -n 40 "$OUT/check.log"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  half=$((BENCH_S / 2))
  timeout $((half + 60)) "$PY" bench/gpu.py --budget_s "$half" --out "$OUT/gpu-600m.json" \
    >"$OUT/bench-600m.log" 2>&1 || status=1
  # the 1.04B Llama shape of issues 29 and 30 (hidden 2048, 16 layers, 32 heads, 8 KV heads, 8192 MLP, a
  # 32,000-token vocabulary: a config.json keeps its own), as tests/test_planner_fsdp.py fits it
  "$PY" -c 'import json, sys; c = json.load(open("src/cloudtrain/model_presets/llama-600m.json"))
c.update(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
         intermediate_size=8192, vocab_size=32000)
json.dump(c, open(sys.argv[1], "w"))' /tmp/llama-1.04b.json
  timeout $((half + 60)) "$PY" bench/gpu.py --preset /tmp/llama-1.04b.json --budget_s "$half" \
    --out "$OUT/gpu-1b.json" \
    >"$OUT/bench-1b.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench-600m.log" "$OUT/bench-1b.log"
fi
if [ -n "$RESULTS" ]; then
  for f in versions.txt check/report.md gpu-600m.md gpu-1b.md; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$RESULTS/$(echo "$f" | tr / -)"
  done
  tar -czf "$RESULTS/gpu-session.tgz" -C "$OUT" .
fi
exit $status
