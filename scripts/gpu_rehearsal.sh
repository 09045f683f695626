#!/usr/bin/env bash
# Rehearse the lent GPU machine on this CPU machine before spending device time: a Python 3.12 venv holding only
# the packages that machine has (../shared/notes/FACTS.md, "The GPU machine"), the carried wheelhouse installed
# beside them as scripts/gpu_session.sh installs it there, then every cloudtrain module imported and the gpu
# tier's test modules run (their gpu tests skip here; the rest of those modules runs). A module that imports
# something the machine lacks, or a launched child that loses the wheelhouse, fails here instead of there.
#
#   scripts/gpu_wheels.sh                             (once)
#   scripts/gpu_rehearsal.sh                          (first run builds the venv: ~4 GB, a few minutes)
#
# GPU_SIM_VENV: where the venv lives (default /work/venv-gpusim, outside the checkout). Non-zero exit when a module
# fails to import or a test fails; tests that need the default model or deepspeed, neither of which that
# machine has, are not part of the gpu tier and are deselected.
set -uo pipefail
VENV=${GPU_SIM_VENV:-/work/venv-gpusim}
if [ -z "${PY312:-}" ]; then  # the first python3.12 that runs (a pyenv shim may name a version it does not enable)
  for candidate in $(command -v python3.12) /root/.pyenv/versions/3.12*/bin/python3.12; do
    "$candidate" -V >/dev/null 2>&1 && { PY312=$candidate; break; }
  done
fi
[ -d .gpu-wheels ] || { echo "error: no .gpu-wheels here; build it with scripts/gpu_wheels.sh"; exit 2; }
[ -n "${PY312:-}" ] || { echo "error: no python3.12 found; set PY312 to one"; exit 2; }

if [ ! -x "$VENV/bin/python" ]; then  # what the GPU machine has installed, with their dependencies
  "$PY312" -m venv "$VENV" && "$VENV/bin/pip" install -q torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 \
    huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 peft pyarrow pandas matplotlib pytest \
    pytest-xdist pytest-timeout || exit 1
fi
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu-wheels/*.whl || exit 1
cp -r .gpu-wheels/site/. "$SITE/"
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1

# every module imported with the optional extras absent (tests/test_packaging.py), then the gpu tier's modules
"$VENV/bin/python" -c 'import transformers; print("transformers", transformers.__version__, transformers.__file__)'
"$VENV/bin/python" -m pytest tests/test_packaging.py::test_every_module_imports_without_the_optional_extras \
  $(grep -lw 'mark\.gpu' tests/test_*.py) -q -p no:cacheprovider -n 2 --timeout 900 \
  --deselect tests/test_fsdp.py::test_each_refusal_is_one_line \
  --deselect "tests/test_peft.py::test_lora_under_zero_on_two_processes_trains_saves_and_resumes" \
  --deselect tests/test_peft.py::test_lora_on_minilm_learns_r8_well_above_the_majority_class
