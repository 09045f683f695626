"""Pushing a PEFT adapter (`--peft lora`) to the Hub: the repo files, the card, and loading the pushed repo
as the card's usage snippet says. Against the local Hub server of test_hub.py, the real client and the real
application (a subprocess: huggingface_hub reads HF_ENDPOINT at import time).
"""

import ast
import json
import re

import pytest
import test_hub
import torch
from conftest import lm_documents
from huggingface_hub import ModelCard, constants, hf_api
from test_hub import TOKEN, hub_env, run_app, train_args

from cloudtrain.cli import main
from cloudtrain.config import build_config, save_arguments
from cloudtrain.models import adapters
from cloudtrain.publish.card_metadata import DEFAULT_BASE_MODEL
from cloudtrain.publish.saving import adapter_config

hub, data_files, in_process = test_hub.hub, test_hub.data_files, test_hub.in_process  # fixtures, taken by name

ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}
MERGED_FILES = {
    "merged/args.json",  # how it was trained: predict and generate read its length, pairs and task there too
    "merged/config.json",
    "merged/model.safetensors",
    "merged/tokenizer.json",
    "merged/tokenizer_config.json",
}


def id2label_of(card: ModelCard) -> dict[int, str]:
    """The label names the card's usage snippet passes to from_pretrained (a Python dict literal)."""
    return ast.literal_eval(re.search(r"^id2label = (\{.*\})$", card.text, re.MULTILINE).group(1))


# ---------------------------------------------------------------- a LoRA classifier, pushed at the end


@pytest.fixture(scope="module")
def pushed_adapter(hub, tiny_model_dir, data_files, tmp_path_factory):
    """A short LoRA run with checkpoints and a merged model, pushed to alice/topics-lora."""
    out = tmp_path_factory.mktemp("pushed-adapter") / "model"
    result = run_app(
        hub_env(hub, out.parent / "no-stored-token", TOKEN),
        *train_args(
            tiny_model_dir,
            data_files,
            out,
            "--peft",
            "lora",
            "--lora_r",
            "4",
            "--merge_adapters",
            "true",
            "--checkpointing_steps",
            "2",
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "alice/topics-lora",
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, hub.history("alice/topics-lora")[-1]


@pytest.mark.slow
def test_an_adapter_push_uploads_the_adapter_its_labels_and_the_merged_model_but_no_checkpoint(pushed_adapter):
    out, upload = pushed_adapter
    assert (out / "checkpoints").is_dir()  # they exist locally, and stay there
    expected = (
        ADAPTER_FILES
        | MERGED_FILES
        | {
            "README.md",
            "labels.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "args.json",
            "train_results.json",
            "eval_results.json",
            "test_results.json",
            "compute_results.json",
        }
        | ({"training_curves.png"} if (out / "training_curves.png").exists() else set())
    )
    assert set(upload.files) - {".gitattributes"} == expected  # no top-level model.safetensors, no checkpoint
    for name in expected - {"args.json", "merged/args.json"}:
        assert upload.files[name] == (out / name).read_bytes(), name  # a local base: adapter_config.json as is
    for name in ("args.json", "merged/args.json"):  # the path options' last parts only
        assert json.loads(upload.files[name])["output_dir"] == out.name, name


@pytest.mark.slow
def test_the_adapter_card_names_peft_its_method_and_how_to_load_and_merge_it(pushed_adapter):
    out, upload = pushed_adapter
    card = ModelCard(upload.files["README.md"].decode())
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-classification"
    assert card.data.tags == ["text-classification", "cloudtrain", "lora", "peft"]
    assert card.data.base_model is None  # a local base directory, as for full models
    labels = json.loads((out / "labels.json").read_text())["id2label"]
    assert id2label_of(card) == {int(i): name for i, name in labels.items()}
    assert (
        'model = AutoPeftModelForSequenceClassification.from_pretrained("alice/topics-lora", num_labels=3, '
        "id2label=id2label)"
    ) in card.text
    assert "`model = model.merge_and_unload()`" in card.text
    assert 'folder = snapshot_download("alice/topics-lora", allow_patterns="merged/*")' in card.text
    assert 'merged = pipeline("text-classification", model=f"{folder}/merged")' in card.text
    for row in (
        "| method | lora |",
        "| r | 4 |",
        "| alpha | 32 |",
        "| dropout | 0.0 |",
        "| trained in full | classifier |",
    ):
        assert row in card.text, row
    assert re.search(r"^\| target modules \| [a-z_, ]+ \|$", card.text, re.MULTILINE)
    assert re.search(r"^\| trainable parameters \| [\d.]+K \|$", card.text, re.MULTILINE)
    assert "| lora_r |" not in card.text  # only in the adapter table


@pytest.mark.slow
def test_the_cards_snippets_run_as_written_against_the_hub_and_the_merged_model_predicts_the_same(
    pushed_adapter, in_process, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_api.api, "endpoint", in_process.url)  # the module's client, built before in_process ran
    card = ModelCard(pushed_adapter[1].files["README.md"].decode())
    adapter_snippet, merged_snippet = re.findall(r"```python\n(.*?)```", card.text, re.DOTALL)
    scope = {}
    exec(adapter_snippet, scope)  # the repo through the Hub API: adapter, tokenizer, base named in adapter_config
    assert capsys.readouterr().out.strip() in scope["id2label"].values()
    exec(merged_snippet, scope)
    model, tokenizer, merged = scope["model"], scope["tokenizer"], scope["merged"]
    inputs = tokenizer(["the striker scored twice", "bond yields climbed again"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits, merged_logits = model(**inputs).logits, merged.model(**inputs).logits
    assert model.config.id2label == scope["id2label"] == merged.model.config.id2label
    torch.testing.assert_close(logits, merged_logits, rtol=1e-5, atol=1e-5)
    assert merged("the striker scored twice")[0]["label"] == scope["id2label"][logits[0].argmax().item()]


# ---------------------------------------------------------------- the push command, the built-in base model


def test_push_command_names_the_builtin_base_by_its_hub_id_in_the_card_and_the_uploaded_adapter_config(
    in_process, tiny_model_dir, tmp_path, monkeypatch
):
    """The built-in model is a local copy of a Hub model: the uploaded adapter_config.json names the Hub id,
    so that the card's `AutoPeftModelFor...from_pretrained(repo)` loads on any machine; the local file, used
    offline here, keeps its path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "run"
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2, id2label={0: "a", 1: "b"})
    adapters.save(get_peft_model(base, LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS")), out)
    save_arguments(build_config({"peft": "lora", "lora_r": 2, "hub_model_id": "alice/builtin-lora"}), out / "args.json")
    (out / "train_results.json").write_text(
        json.dumps(
            {"global_step": 1, "epoch": 1.0, "train_loss": 0.7, "train_runtime_s": 1.0, "train_samples_per_s": 8.0}
        )
    )
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["push", "--output_dir", str(out)]) == 0

    upload = in_process.history("alice/builtin-lora")[-1]
    assert {"adapter_config.json", "adapter_model.safetensors", "labels.json", "README.md"} <= set(upload.added)
    assert "model.safetensors" not in upload.added
    assert json.loads(upload.added["adapter_config.json"])["base_model_name_or_path"] == DEFAULT_BASE_MODEL
    assert adapter_config(out)["base_model_name_or_path"] == tiny_model_dir
    card = ModelCard(upload.added["README.md"].decode())
    assert (card.data.base_model, card.data.license, card.data.library_name) == (
        DEFAULT_BASE_MODEL,
        "apache-2.0",
        "peft",
    )
    assert f"named in adapter_config.json ([{DEFAULT_BASE_MODEL}]" in card.text
    assert "snapshot_download" not in card.text  # nothing was merged


# ---------------------------------------------------------------- a causal LM, pushed at every save


@pytest.mark.slow
def test_every_save_pushes_each_adapter_and_the_repo_ends_with_the_final_one(hub, tiny_llama_dir, tmp_path):
    for split, n in (("train", 24), ("validation", 4)):
        (tmp_path / f"{split}.txt").write_text("\n".join(lm_documents(n, seed=n)) + "\n")
    out = tmp_path / "model"
    result = run_app(
        hub_env(hub, tmp_path / "no-stored-token", TOKEN),
        "--task",
        "causal_lm",
        "--peft",
        "lora",
        "--model_name_or_path",
        tiny_llama_dir,
        "--train_file",
        str(tmp_path / "train.txt"),
        "--validation_file",
        str(tmp_path / "validation.txt"),
        "--output_dir",
        str(out),
        "--max_length",
        "48",
        "--max_steps",
        "4",
        "--checkpointing_steps",
        "2",
        "--eval_strategy",
        "no",
        "--mixed_precision",
        "no",
        "--sample_max_new_tokens",
        "4",
        "--push_to_hub",
        "true",
        "--hub_model_id",
        "alice/tales-lora",
        "--hub_strategy",
        "every_save",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    commits = hub.history("alice/tales-lora")
    assert [c.summary for c in commits[:-1]] == [
        "initial commit",
        "Training in progress, step 2",
        "Training in progress, step 4",
    ]
    for save in commits[1:-1]:  # the adapter, no full weights, and no card (PEFT's blank one stays local)
        assert "adapter_model.safetensors" in save.added  # the files that did not change are not sent again
        assert ADAPTER_FILES | {"generation_config.json", "tokenizer.json"} <= set(save.files)
        assert not {"model.safetensors", "README.md"} & set(save.files), save.summary
    final = commits[-1].files
    assert not any(path.startswith(("last-checkpoint/", "checkpoints/", "merged/")) for path in final)
    assert "model.safetensors" not in final
    for name in ADAPTER_FILES | {"generation_config.json"}:
        assert final[name] == (out / name).read_bytes(), name
    card = ModelCard(final["README.md"].decode())
    assert card.data.library_name == "peft" and {"lora", "peft", "text-generation"} <= set(card.data.tags)
    assert 'model = AutoPeftModelForCausalLM.from_pretrained("alice/tales-lora")' in card.text
    assert "inputs = tokenizer(" in card.text and "pipeline(" not in card.text
