#!/usr/bin/env bash
# Everything GPU-specific in one prepared run, on a GPU machine that reaches no package registry (the
# project's lent H100: torch 2.11 and some packages installed, the rest carried as wheels).
#
# Here, once:   scripts/gpu_wheels.sh                             (about 36 MB; ignored by git)
#               python bench/lm_corpus.py                           (data/grimm/grimm-tales.tab: bench/gpu.py's corpus)
# There:        scripts/gpu_session.sh [tier|bench|all]             (carry .gpu-wheels and data/grimm; default tier)
#
#   tier   scripts/gpu_check.py: versions and device, the gpu tier, bench/gpu.py's defaults for 40 steps
#          (issue 29's checks; meant to take under 8 minutes on one H100). TIER_S, WORKERS, CHECK_BENCH_S and
#          CHECK_VARIANTS (bench/gpu.py's --variants) size it to the device time left
#   bench  bench/gpu.py on the 515M preset and then the 1.04B shape, within BENCH_S seconds: the variants that
#          say most first (BENCH_VARIANTS, BENCH_VARIANTS_1B: others; "all": every one; BENCH_STEPS: timed steps)
#          (issue 30's figures and issue 29's planner comparison)
#   all    both, in that order (in one 600 s command only with small sizes: prefer one call per stage)
#
# DEADLINE_S (570) bounds the whole command below the device tool's 600 s: each stage's limits are cut to the time
# left, and what a stage measured is copied to $OUT as soon as it ends (a command killed at the tool's limit
# returns nothing written after that).
# Everything is written to outputs/gpu-session, the benchmarks' .json and .md straight to $OUT where it is set;
# after each stage the versions and the check's report.md are copied there with one archive of the rest (the logs,
# the check's JSON and junit; the device tool's $OUT returns at most 8 files). Each stage ends inside its own time
# limit, so what it measured comes back.
set -uo pipefail
STAGE=${1:-tier}
DEADLINE_S=${DEADLINE_S:-570}
left() { echo $((DEADLINE_S - SECONDS)); }  # seconds this command has before its deadline
publish() {  # what came so far, to $OUT: a later stage cut off by the tool's limit cannot take it with it
  [ -n "$RESULTS" ] || return 0
  for f in versions.txt check/report.md; do
    [ -f "$OUT/$f" ] && cp "$OUT/$f" "$RESULTS/$(echo "$f" | tr / -)"
  done
  tar -czf "$RESULTS/gpu-session.tgz" -C "$OUT" .
}
RESULTS=${OUT:-}
OUT=outputs/gpu-session
BENCH_S=${BENCH_S:-420}
# the defaults against the floor, then what each default choice is worth, then the options not yet measured
BENCH_VARIANTS=${BENCH_VARIANTS:-defaults,plain,no_liger_kernels,hf_trainer,compile_layers,flex_attention}
BENCH_VARIANTS_1B=${BENCH_VARIANTS_1B:-defaults,plain,no_liger_kernels}
[ -f data/grimm/grimm-tales.tab ] || { echo "error: no data/grimm/grimm-tales.tab (bench/gpu.py's corpus; that" \
  "machine cannot download it): run python bench/lm_corpus.py here and carry data/grimm"; exit 2; }
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
  # TIER_S bounds the tier (pytest is interrupted and still reports), CHECK_BENCH_S the short benchmark after it
  # the outer limit stays under the device tool's 600 s a command; gpu_check writes its report after the tier too
  TIER_S=${TIER_S:-300} CHECK_BENCH_S=${CHECK_BENCH_S:-150}
  limit=$((TIER_S + CHECK_BENCH_S + 240)); [ "$limit" -gt $(($(left) - 20)) ] && limit=$(($(left) - 20))
  timeout "$limit" "$PY" scripts/gpu_check.py --out "$OUT/check" --workers "${WORKERS:-6}" \
    --tier_timeout "$TIER_S" --steps 40 --bench_budget_s "$CHECK_BENCH_S" \
    --bench_variants "${CHECK_VARIANTS:-defaults}" >"$OUT/check.log" 2>&1 || status=1
  tail -n 40 "$OUT/check.log"
  publish
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  half=$((BENCH_S / 2)); room=$((($(left) - 150) / 2))  # each half's run + 60 s grace, and the copy after it
  [ "$half" -gt "$room" ] && half=$room
  [ "$half" -lt 60 ] && { echo "error: $(left) s left before DEADLINE_S: too little for the benchmarks"; exit 1; }
  # each variant's figures are written as it ends, straight to $OUT where it is set: a cut run keeps them
  BENCH_OUT=${RESULTS:-$OUT}
  bench=(--steps "${BENCH_STEPS:-50}" --budget_s "$half")
  timeout $((half + 60)) "$PY" bench/gpu.py "${bench[@]}" --variants "$BENCH_VARIANTS" \
    --out "$BENCH_OUT/gpu-600m.json" >"$OUT/bench-600m.log" 2>&1 || status=1
  # the 1.04B Llama shape of issues 29 and 30 (hidden 2048, 16 layers, 32 heads, 8 KV heads, 8192 MLP, a
  # 32,000-token vocabulary: a config.json keeps its own), as tests/test_planner_fsdp.py fits it
  "$PY" -c 'import json, sys; c = json.load(open("src/cloudtrain/model_presets/llama-600m.json"))
c.update(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
         intermediate_size=8192, vocab_size=32000)
json.dump(c, open(sys.argv[1], "w"))' /tmp/llama-1.04b.json
  timeout $((half + 60)) "$PY" bench/gpu.py --preset /tmp/llama-1.04b.json "${bench[@]}" \
    --variants "$BENCH_VARIANTS_1B" --out "$BENCH_OUT/gpu-1b.json" \
    >"$OUT/bench-1b.log" 2>&1 || status=1
  tail -n 30 "$OUT/bench-600m.log" "$OUT/bench-1b.log"
  publish
fi
exit $status
