"""A text-to-image LoRA run published: pushed to the Hub (the local server of test_hub.py, the real client, the
application in a subprocess) in diffusers' LoRA format, with a card that names the base model and the prompts and
shows the validation grid; the pushed weights loaded into a diffusers pipeline by `load_lora_weights`, as the card
says; and the SageMaker job (tests/aws_server.py) training --task text_to_image from a channel of captioned images.
"""

import re

import pytest
import test_hub
import torch
from aws_server import container_environment, run_torchrun_driver
from huggingface_hub import ModelCard, constants
from t2i_fixtures import build_tiny_pipeline, captioned_folder
from test_hub import TOKEN, hub_env, run_app
from test_sagemaker import aws, launcher, run_output  # noqa: F401  (fixtures, taken by name)

hub, in_process = test_hub.hub, test_hub.in_process  # fixtures, taken by name

pytestmark = pytest.mark.slow
REPO_ID = "alice/squares-lora"
PROMPTS = ["a red square", "a blue square"]
LORA_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(autouse=True, scope="module")
def one_thread_here():
    """The pipelines run in this process too: these small convolutions are far slower on 2 shared threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i-publish") / "tiny-sd"))


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-publish-data") / "squares"))


def one_thread(env: dict) -> dict:
    return {**env, "OMP_NUM_THREADS": "1"}  # these small convolutions are far slower on 2 shared threads


@pytest.fixture(scope="module")
def pushed(hub, tiny_sd, squares, tmp_path_factory):
    """A short LoRA run with validation prompts, pushed to alice/squares-lora at the end."""
    out = tmp_path_factory.mktemp("pushed-t2i") / "model"
    result = run_app(
        one_thread(hub_env(hub, out.parent / "no-stored-token", TOKEN)),
        "--task", "text_to_image", "--model_name_or_path", tiny_sd, "--train_data_dir", squares,
        "--resolution", "16", "--peft", "lora", "--lora_r", "4", "--max_steps", "6",
        "--per_device_train_batch_size", "6", "--learning_rate", "5e-3", "--checkpointing_steps", "3",
        "--validation_prompts", "|".join(PROMPTS), "--validation_steps", "6", "--validation_inference_steps", "2",
        "--training_type", "basic", "--mixed_precision", "no", "--report_to", "none", "--output_dir", str(out),
        "--push_to_hub", "true", "--hub_model_id", REPO_ID,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return out, hub.history(REPO_ID)[-1]


def test_the_push_holds_the_lora_in_diffusers_format_and_the_grid_but_no_checkpoint(pushed):
    out, upload = pushed
    files = set(upload.files) - {".gitattributes"}
    assert LORA_FILE in files and upload.files[LORA_FILE] == (out / LORA_FILE).read_bytes()
    assert "README.md" in files
    grids = sorted(p for p in files if p.startswith("validation/"))  # the card shows the last one
    assert grids and grids[-1] == "validation/eval-step-000006.png"
    assert upload.files[grids[-1]] == (out / grids[-1]).read_bytes()
    assert (out / "checkpoints").is_dir()  # they exist locally, and stay there
    assert not [p for p in files if p.startswith(("checkpoints/", "last-checkpoint/"))]
    assert not {"model.safetensors", "adapter_model.safetensors", "model_index.json"} & files  # not a PEFT repo
    assert not [p for p in files if p.startswith(("tokenizer", "unet/"))]  # the base pipeline has them


def test_the_card_names_the_base_model_the_prompts_and_shows_the_grid(pushed, tiny_sd):
    _, upload = pushed
    card = ModelCard(upload.files["README.md"].decode())
    assert card.data.library_name == "diffusers"
    assert {"text-to-image", "diffusers", "lora"} <= set(card.data.tags)
    assert f"LoRA adaption weights for {tiny_sd}" in card.text
    (widget,) = card.data.widget
    assert widget["text"] == " | ".join(PROMPTS) and widget["output"]["url"] == "validation/eval-step-000006.png"
    assert f"(prompts: {', '.join(PROMPTS)})" in card.text
    assert "![validation](validation/eval-step-000006.png)" in card.text  # the file pushed beside it
    assert f'pipeline.load_lora_weights("{REPO_ID}")' in card.text
    assert TOKEN not in str(card)


@pytest.fixture
def diffusers_online(in_process, monkeypatch, tmp_path):
    """diffusers keeps its own copy of HF_HUB_OFFLINE (the suite runs offline); the Hub is the local server."""
    import diffusers.loaders.lora_base
    import diffusers.utils.hub_utils
    from huggingface_hub import hf_api

    for module in (diffusers.utils.hub_utils, diffusers.loaders.lora_base):  # each imported its own copy
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_api.api, "endpoint", in_process.url)  # the module's client, built before in_process ran
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return in_process


def draw(pipe, prompt: str) -> torch.Tensor:
    out = pipe(prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    return torch.from_numpy(out.images)


def test_the_cards_snippet_loads_the_pushed_lora_from_the_hub_and_it_changes_the_pipelines_output(
    pushed, tiny_sd, diffusers_online
):
    from diffusers import DiffusionPipeline

    out, upload = pushed
    card = ModelCard(upload.files["README.md"].decode())
    (snippet,) = re.findall(r"```python\n(.*?)```", card.text, re.DOTALL)
    scope: dict = {}
    exec(snippet, scope)  # as a user would paste it
    from_hub = scope["pipeline"]  # the base from its folder, the LoRA from alice/squares-lora through the Hub API
    assert scope["image"].size == (16, 16)

    base = DiffusionPipeline.from_pretrained(tiny_sd)
    base.set_progress_bar_config(disable=True)
    before = draw(base, PROMPTS[0])
    base.load_lora_weights(out)  # the run's own folder: what was pushed is what was trained
    assert (draw(from_hub, PROMPTS[0]) - before).abs().max() > 1e-3  # the LoRA changes the output
    torch.testing.assert_close(draw(from_hub, PROMPTS[0]), draw(base, PROMPTS[0]))


# ---------------------------------------------------------------- the SageMaker job


def test_a_sagemaker_job_trains_text_to_image_from_a_channel_of_captioned_images(
    aws,  # noqa: F811
    launcher,  # noqa: F811
    tiny_sd,
    squares,
    tmp_path,
    monkeypatch,
):
    """Launched as a user would (the captioned folder as the train channel, the pipeline folder as the model
    channel), then run like one instance with the SDK's torchrun driver."""
    from diffusers import DiffusionPipeline

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = launcher.JobSpec(
        instance_type="ml.g5.2xlarge",
        processes_per_host=1,
        base_job_name="cloudtrain-t2i",
        train=squares,
        hyperparameters={
            "task": "text_to_image",
            "model_name_or_path": tiny_sd,
            "resolution": 16,
            "peft": "lora",
            "lora_r": 4,
            "max_steps": 2,
            "per_device_train_batch_size": 3,
            "validation_prompts": PROMPTS[0],
            "validation_inference_steps": 2,
            "mixed_precision": "no",
        },
    )
    name = launcher.launch(spec, launcher.make_session())
    request = aws.request_for(name)
    assert {c["ChannelName"] for c in request["InputDataConfig"]} >= {"train", "model"}
    root = tmp_path / "opt-ml"
    env = container_environment(request, aws.client("s3"), root)
    job = run_torchrun_driver(env, root, root / "checkpoints")
    assert job.returncode == 0, run_output(job)
    assert "data: 6 training images" in job.stdout

    model_dir = root / "model"
    assert (model_dir / LORA_FILE).is_file() and (model_dir / "validation").is_dir()
    pipe = DiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(model_dir)  # what the job leaves in model.tar.gz loads as diffusers' LoRA
    assert draw(pipe, PROMPTS[0]).shape == (1, 16, 16, 3)


# ---------------------------------------------------------------- a Hub id as --model_name_or_path


def test_a_pipeline_on_the_hub_trains_by_its_id_and_the_card_names_the_id(hub, in_process, tiny_sd, squares, tmp_path):
    """The tiny pipeline uploaded to the local Hub server, then trained by its id: downloaded once into the Hub
    cache, the LoRA reloading into the same pipeline; the card's base_model is the id, not the cache folder."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("alice/tiny-sd")
    api.upload_folder(repo_id="alice/tiny-sd", folder_path=tiny_sd)
    out, cache = tmp_path / "model", tmp_path / "hf-cache"
    env = {**one_thread(hub_env(hub, tmp_path / "no-stored-token", TOKEN)), "HF_HUB_CACHE": str(cache)}
    args = ["--task", "text_to_image", "--model_name_or_path", "alice/tiny-sd", "--train_data_dir", squares]
    args += ["--resolution", "16", "--peft", "lora", "--lora_r", "4", "--max_steps", "2", "--training_type", "basic"]
    args += ["--mixed_precision", "no", "--report_to", "none", "--output_dir", str(out)]
    result = run_app(env, *args, "--push_to_hub", "true", "--hub_model_id", "alice/tiny-sd-lora")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / LORA_FILE).is_file() and list(cache.glob("models--alice--tiny-sd/snapshots/*/unet"))
    card = ModelCard(hub.history("alice/tiny-sd-lora")[-1].files["README.md"].decode())
    assert card.data.base_model == "alice/tiny-sd" and str(cache) not in card.text

    # (into a folder of its own: `out` holds the LoRA just trained, which a run there without
    # --overwrite_output_dir is refused to replace)
    missing = run_app(env, *[{"alice/tiny-sd": "alice/no-such-sd", str(out): f"{out}-2"}.get(a, a) for a in args])
    assert missing.returncode != 0
    (line,) = [x for x in missing.stderr.splitlines() if "alice/no-such-sd" in x]
    assert "could not be downloaded from the Hub" in line and "Traceback" not in missing.stderr
