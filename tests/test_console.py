"""What a run prints when its output goes to a file (`> run.log 2>&1`, SageMaker, Kubernetes): no progress bars,
each line whole, no library notices beside cloudtrain's own lines; in a terminal, or when asked, the bars."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ENTRY, REPO, topic_rows

from cloudtrain.errors import UserError
from cloudtrain.observe import console

# The switches a user may have set in the suite's environment: each test's child starts without them.
SWITCHES = (console.BARS, "TQDM_DISABLE", *console.LIBRARY_SWITCHES.values(), "PYTHONUNBUFFERED")
DEEPSPEED_NOTICE = "Setting accelerator to CPU"
LIBRARY_BARS = ("Generating train split", "Tokenizing", "Loading weights", "Writing model shards", "training:")


def logged(*args: str, timeout: int = 600, **env: str) -> tuple[int, str]:
    """The real entry script with stdout and stderr into one pipe, as `cloudtrain ... > run.log 2>&1` writes
    them (no PYTHONUNBUFFERED): its exit status and the bytes as a log file holds them (no newline translation)."""
    child = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    proc = subprocess.run(
        [sys.executable, str(ENTRY), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        env={**child, **env},
        cwd=REPO,
    )
    return proc.returncode, proc.stdout.decode()


def topic_files(folder: Path) -> tuple[Path, Path]:
    """train and validation csv files of the 3-topic task (conftest.TOPICS)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = folder / "train.csv", folder / "validation.csv"
    for path, (n, offset) in zip(files, ((20, 0), (4, 1)), strict=True):
        pd.DataFrame(topic_rows(n, offset)).to_csv(path, index=False)
    return files


@pytest.fixture(scope="module")
def eight_label_classifier(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny BERT with an 8-label classification head, as a classifier trained on R8 is saved."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    labels = ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}
    )
    out = tmp_path_factory.mktemp("r8-classifier")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def train_args(model_dir: str, folder: Path, *more: str) -> list[str]:
    train, validation = topic_files(folder / "data")
    return [
        "--model_name_or_path", model_dir, "--train_file", str(train), "--validation_file", str(validation),
        "--output_dir", str(folder / "out"), "--max_steps", "4", "--checkpointing_steps", "2",
        "--logging_steps", "1", "--per_device_train_batch_size", "8", *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, eight_label_classifier) -> tuple[Path, str]:
    """A classifier trained from the 8-label one on 3 topics, checkpointed at steps 2 and 4, into a log."""
    folder = tmp_path_factory.mktemp("logged")
    code, log = logged(*train_args(eight_label_classifier, folder))
    assert code == 0, log[-3000:]
    return folder / "out", log


# ---------------------------------------------------------------- a log file


@pytest.mark.slow  # one training run in a fresh interpreter, shared by four tests
def test_a_logged_run_has_no_progress_bars(logged_run):
    _, log = logged_run
    assert "\r" not in log  # every refresh of a bar starts with one
    for bar in LIBRARY_BARS:
        assert bar not in log, bar
    assert "step 4/4 | epoch" in log  # the progress a log needs


@pytest.mark.slow  # a training run in a fresh interpreter
def test_train_from_python_into_a_log_has_no_progress_bars(tmp_path, tiny_model_dir):
    """The command line decided the bars; a script calling cloudtrain.train() wrote them into its log (audit)."""
    from conftest import child_pythonpath

    args = train_args(tiny_model_dir, tmp_path, "--checkpointing_steps", "none")
    options = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)}
    script = f"import cloudtrain; cloudtrain.train({options!r})"
    child = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    proc = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=600, env={**child, "PYTHONPATH": child_pythonpath()}, cwd=REPO)  # fmt: skip
    log = proc.stdout.decode()
    assert proc.returncode == 0, log[-3000:]
    assert "\r" not in log and "step 4/4 | epoch" in log


def test_diffusers_bars_follow_the_others_into_a_log():
    """A text-to-image run into a log file held diffusers' "Loading pipeline components" bars (found in audit):
    diffusers reads no variable for them, so the run turns them off itself."""
    script = (
        "import sys; from cloudtrain.observe import console; console.setup(); console.follow_in_diffusers(); "
        "from diffusers.utils import logging; print(logging.is_progress_bar_enabled())"
    )
    for bars, shown in (("0", "False"), ("1", "True")):
        env = {**{k: v for k, v in os.environ.items() if k not in SWITCHES}, "CLOUDTRAIN_PROGRESS_BARS": bars}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
        assert proc.stdout.strip() == shown, proc.stderr[-2000:]


@pytest.mark.slow  # one training run in a fresh interpreter, shared by four tests
def test_each_checkpoint_line_is_a_line_of_its_own(logged_run):
    out, log = logged_run
    lines = log.splitlines()
    saved = [line for line in lines if "checkpoint saved to" in line]
    assert [line.split()[3] for line in saved] == [str(out / "checkpoints" / f"checkpoint-{s}") for s in (2, 4)]
    assert all(line.startswith("checkpoint saved to ") for line in saved), saved
    # in order with the step lines (stdout is line-buffered in a log: it was block-buffered)
    assert lines.index(saved[0]) > next(i for i, line in enumerate(lines) if line.startswith("step 2/4 "))


@pytest.mark.slow  # one training run in a fresh interpreter, shared by four tests
def test_a_replaced_head_is_said_once_in_cloudtrains_words(logged_run):
    _, log = logged_run
    assert "replacing the 8-label head of" in log and "new 3-label head" in log
    assert "num_labels" not in log and "incompatible" not in log  # transformers' own warning about the same


@pytest.mark.slow  # one training run in a fresh interpreter, shared by four tests
def test_predict_from_a_log_has_no_loading_bar_and_no_deepspeed_notice(logged_run):
    out, _ = logged_run
    code, log = logged("predict", "--model_dir", str(out), "--text", "heavy rain is expected tomorrow")
    assert code == 0, log
    assert "\r" not in log and "Loading weights" not in log and DEEPSPEED_NOTICE not in log
    assert json.loads(log.splitlines()[-1])["text"] == "heavy rain is expected tomorrow"


@pytest.mark.slow
def test_bars_asked_for_in_a_log_show_and_lines_still_start_their_own(tmp_path, tiny_model_dir):
    """CLOUDTRAIN_PROGRESS_BARS=1: the bars as in a terminal; a line printed while the training bar is shown
    clears it first instead of continuing its line (`...3.54s/it]checkpoint saved to ...`)."""
    code, log = logged(*train_args(tiny_model_dir, tmp_path), CLOUDTRAIN_PROGRESS_BARS="1")
    assert code == 0, log[-3000:]
    assert "\rtraining: " in log and "\rLoading weights: " in log
    saved = [m.start() for m in re.finditer("checkpoint saved to ", log)]
    assert len(saved) == 2
    assert {log[at - 1] for at in saved} <= {"\r", "\n"}, [log[at - 120 : at + 40] for at in saved]


def test_a_bad_switch_value_is_one_line():
    code, log = logged("--help", CLOUDTRAIN_PROGRESS_BARS="sometimes")
    assert code == 2
    assert log.strip() == (
        "error: CLOUDTRAIN_PROGRESS_BARS='sometimes': set it to 1 (progress bars), 0 (none), or leave it unset"
    )


# ---------------------------------------------------------------- the decision


def test_bars_show_in_a_terminal_only_unless_a_switch_says_otherwise(tmp_path):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal, open(tmp_path / "run.log", "w") as log:
        assert console.wanted({}, terminal) is True
        assert console.wanted({}, log) is False
        assert console.wanted({"CLOUDTRAIN_PROGRESS_BARS": "1"}, log) is True
        assert console.wanted({"CLOUDTRAIN_PROGRESS_BARS": "off"}, terminal) is False
        assert console.wanted({"TQDM_DISABLE": "1"}, terminal) is False  # tqdm's own switch
        assert console.wanted({"TQDM_DISABLE": "1", "CLOUDTRAIN_PROGRESS_BARS": "yes"}, log) is True
        with pytest.raises(UserError, match="CLOUDTRAIN_PROGRESS_BARS='2': set it to 1"):
            console.wanted({"CLOUDTRAIN_PROGRESS_BARS": "2"}, terminal)
    os.close(leader)


# ---------------------------------------------------------------- library notices


def run_python(code: str) -> str:
    """`code` in a fresh interpreter (src importable), stdout and stderr together."""
    child = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env={**child, "PYTHONPATH": str(REPO / "src")},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
def test_deepspeeds_cpu_notice_is_dropped_and_its_other_messages_kept():
    """Without a GPU DeepSpeed warns on import that it found none (the child of a test not marked gpu sees none);
    after console.setup() only that message is gone."""
    probe = (
        "import logging\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "print('accelerator', get_accelerator().device_name())\n"
        "logging.getLogger('DeepSpeed').warning('another DeepSpeed warning')\n"
    )
    assert DEEPSPEED_NOTICE in run_python(probe)  # what a user saw
    printed = run_python("from cloudtrain.observe import console\nconsole.setup()\n" + probe)
    assert DEEPSPEED_NOTICE not in printed
    assert "accelerator cpu" in printed and "another DeepSpeed warning" in printed


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
def test_grown_embeddings_start_at_the_old_rows_mean_without_transformers_notice(tiny_llama_dir):
    """grow_embeddings keeps transformers' mean resizing (new rows drawn around the old rows' mean, input and
    output), and its notice about that choice is not printed."""
    code = f"""
import torch
from transformers import AutoModelForCausalLM
from cloudtrain.models.load import grow_embeddings
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained({tiny_llama_dir!r}, dtype=torch.float32)
inputs, outputs = model.get_input_embeddings().weight.clone(), model.get_output_embeddings().weight.clone()
rows = inputs.shape[0]
grow_embeddings(model, rows + 3, pad_to_multiple_of=8)
grown_in, grown_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
assert grown_in.shape[0] == grown_out.shape[0] and grown_in.shape[0] % 8 == 0 and grown_in.shape[0] > rows
assert torch.equal(grown_in[:rows], inputs) and torch.equal(grown_out[:rows], outputs)
for new, old in ((grown_in[rows:], inputs), (grown_out[rows:], outputs)):
    spread = (new - old.mean(0)).abs().max().item()
    assert spread < 1e-3, spread  # random rows (mean_resizing=False) differ from the mean by ~ the init's 0.02
print('grown')
"""
    printed = run_python(code)
    assert "grown" in printed
    assert "multivariate normal" not in printed and "mean_resizing" not in printed, printed


@pytest.mark.slow
def test_sft_that_adds_chat_tokens_and_its_merge_print_no_library_notices(tmp_path, tiny_llama_dir):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in (("Who found the key?", "The poor boy."), ("Where did the king live?", "In a castle."))
        )
    )
    out = tmp_path / "out"
    code, log = logged(
        "--task", "sft", "--model_name_or_path", tiny_llama_dir, "--train_file", str(chats),
        "--output_dir", str(out), "--peft", "lora", "--max_steps", "2", "--per_device_train_batch_size", "2",
        "--max_length", "64", "--num_sample_prompts", "0", "--mixed_precision", "no",
    )  # fmt: skip
    assert code == 0, log[-3000:]
    assert "grew the embeddings from" in log
    assert "multivariate normal" not in log and "\r" not in log
    code, log = logged("merge", "--output_dir", str(out))
    assert code == 0, log[-3000:]
    assert DEEPSPEED_NOTICE not in log and "\r" not in log and "multivariate normal" not in log
    assert (out / "merged" / "config.json").is_file()


AGAIN = """
import os
import datasets.utils
from cloudtrain.observe import console

console.setup()  # a pipe: no bars
off = (datasets.utils.is_progress_bar_enabled(), os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS"))
os.environ["CLOUDTRAIN_PROGRESS_BARS"] = "1"
console.setup()  # the next run of this process asks for them
on = (datasets.utils.is_progress_bar_enabled(), os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS"))
print(off, on)
"""


def test_a_later_setup_in_the_same_process_takes_back_the_switches_it_set():
    """A notebook or an in-process caller runs more than once: the first run's choice must not stick."""
    env = {k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k and k != "TQDM_DISABLE"}
    done = subprocess.run([sys.executable, "-c", AGAIN], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(False, '1') (True, None)"


def test_accelerates_tied_weights_notice_is_kept_off_and_other_messages_are_not(caplog):
    """Every checkpoint of a model with tied weights printed "[RANK 0] Removed shared tensor {'lm_head.weight'}
    while saving ... check by verifying ..." (found in audit): by design, and loading ties them again."""
    import logging

    from cloudtrain.observe import console

    console.quiet_known_notices()
    logger = logging.getLogger("accelerate.utils.other")
    with caplog.at_level(logging.WARNING, logger="accelerate.utils.other"):
        logger.warning("[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but ...")
        logger.warning("another accelerate warning")
    assert [r.getMessage() for r in caplog.records] == ["another accelerate warning"]


PADDED_GPT2 = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
from cloudtrain.observe import console
if sys.argv[1] == "quiet":
    console.quiet_known_notices()
config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8, pad_token_id=0)
ids = torch.tensor([[5, 6, 7, 0]])  # a row padded at its end, as a language-model batch of cloudtrain's is
GPT2LMHeadModel(config)(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0]]))
"""


def test_transformers_padding_warning_is_kept_off_where_the_batches_pass_no_mask_by_design():
    """Every GPT-2-style language-model run warned "We strongly recommend passing in an attention_mask": its
    batches carry restarting position_ids and unlabelled padding instead (found in audit)."""
    said = {
        how: subprocess.run([sys.executable, "-c", PADDED_GPT2, how], capture_output=True, text=True, timeout=120)
        for how in ("loud", "quiet")
    }
    assert all(done.returncode == 0 for done in said.values()), said["loud"].stderr[-2000:]
    assert console.PADDING_NOTICE in said["loud"].stderr  # transformers says it where nothing keeps it off
    assert console.PADDING_NOTICE not in said["quiet"].stderr


def test_the_sagemaker_mlflow_plugins_warning_at_each_request_is_kept_off():
    """The plugin takes every tracking URI for an ARN: MLflow warned at each request to a server (found in audit).
    Resolved here through MLflow's own registry, with the plugin installed as the sagemaker extra installs it."""
    import logging

    import mlflow
    from mlflow.tracking.request_header.registry import resolve_request_headers

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mlflow.tracking.request_header.registry")
    earlier = list(logger.filters)  # this process may have quieted it already (an in-process run)
    for kept in earlier:
        logger.removeFilter(kept)
    logger.addHandler(handler)
    before = mlflow.get_tracking_uri()
    try:
        mlflow.set_tracking_uri("http://127.0.0.1:5931")
        resolve_request_headers()
        loud = list(records)
        console.quiet_known_notices()
        resolve_request_headers()
        logger.warning("another MLflow warning")
    finally:
        mlflow.set_tracking_uri(before)
        logger.removeHandler(handler)
        logger.filters[:] = earlier
    assert any(console.SAGEMAKER_ARN_NOTICE in message for message in loud)  # the plugin is there and warns
    assert records[len(loud) :] == ["another MLflow warning"]
