"""--peft lora|dora|qlora: what trains, what is saved, reloading, merging, refusals, exact resume under
real launches (1 and 2 processes, DDP and ZeRO), and a LoRA run on the real MiniLM and R8."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import CUDA_AVAILABLE, ENTRY, REPO, assert_each_refused, lm_documents
from peft import PeftModel
from safetensors.torch import load_file
from test_distributed import launch, torchrun
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.generate import check_model_dir, generate_texts, load
from cloudtrain.models.adapters import load_adapter_model
from cloudtrain.pipeline import build_run, run_training
from cloudtrain.predict import predict

TEXTS = ["the striker scored twice", "the bank raised interest rates", "snow closed the mountain roads"]


def lm_corpus(folder):
    for split, n, seed in (("train", 48, 0), ("validation", 8, 1)):
        (folder / f"{split}.txt").write_text("\n".join(lm_documents(n, seed)) + "\n")
    return folder


def chat_file(folder):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what comes after {i}?"},
                {"role": "assistant", "content": str(i + 1)},
            ]
        }
        for i in range(40)
    ]
    path = folder / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def case_options(case: str, tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs) -> dict:
    """A few-step in-process run per task: a classifier, a causal LM and SFT whose template grows the vocabulary
    (GPT-2, tied embeddings: the embeddings train in full next to the adapters)."""
    common = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 4,
        "learning_rate": 1e-2,
        "logging_steps": 2,
        "mixed_precision": "no",
        "training_type": "basic",
        "per_device_train_batch_size": 4,
        "lora_r": 4,
        "lora_dropout": 0.0,
    }
    if case.startswith("classification"):  # an encoder, and a decoder that pads with EOS (GPT-2)
        return {
            **common,
            "peft": "lora",
            "model_name_or_path": tiny_gpt2_dir if "gpt2" in case else tiny_model_dir,
            "train_file": str(topic_csvs["train"]),
            "validation_file": str(topic_csvs["validation"]),
        }
    if case == "causal_lm-dora":
        corpus = lm_corpus(tmp_path)
        return {
            **common,
            "peft": "dora",
            "task": "causal_lm",
            "model_name_or_path": tiny_llama_dir,
            "train_file": str(corpus / "train.txt"),
            "validation_file": str(corpus / "validation.txt"),
            "max_length": 32,
            "sample_max_new_tokens": 4,
        }
    return {
        **common,
        "peft": "lora",
        "task": "sft",
        "model_name_or_path": tiny_gpt2_dir,
        "chat_template": "chatml",
        "train_file": str(chat_file(tmp_path)),
        "max_length": 32,
        "sample_max_new_tokens": 4,
    }


@pytest.mark.parametrize("case", ["classification-lora", "classification-gpt2-lora", "causal_lm-dora", "sft-lora"])
def test_only_adapters_train_and_the_saved_adapter_reloads_merges_and_predicts_the_same(
    case, tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs
):
    options = case_options(case, tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs)
    run = build_run(build_config(options))
    model, out = run.model, tmp_path / "out"
    assert isinstance(model, PeftModel)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert run.run_log.run_info["trainable_parameters"] == model.get_nb_trainable_parameters()[0]
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    run.trainer.fit()

    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], initial[name]) for name in initial if name not in trainable)  # base bitwise
    assert all(".lora_" in name or "modules_to_save" in name or "lora_magnitude" in name for name in trainable)
    changed = {name for name in trainable if not torch.equal(after[name], initial[name])}
    assert any("lora_B" in name for name in changed)
    if case.startswith("classification"):
        assert any("classifier" in name or "score" in name for name in changed)  # the new head trains in full
    if case == "sft-lora":
        assert any("wte.modules_to_save" in name for name in changed)  # the grown vocabulary's embeddings

    run.trainer.save_model(out)
    run.tokenizer.save_pretrained(out)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert not (out / "README.md").exists()  # PEFT's empty card, naming this machine's base path (audit)
    model.eval()
    if case.startswith("classification"):
        inputs = run.tokenizer(TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            probs = model(**inputs).logits.softmax(-1)
        reloaded = predict(str(out), TEXTS)
        assert [r["label"] for r in reloaded] == [model.config.id2label[i] for i in probs.argmax(-1).tolist()]
        assert [r["score"] for r in reloaded] == [round(p, 4) for p in probs.max(-1).values.tolist()]
    else:
        prompts = ["Once upon a time", "The frog said"]
        before = generate_texts(model, run.tokenizer, prompts, max_new_tokens=6)
        again, tokenizer = load(str(out), torch.device("cpu"))
        assert generate_texts(again, tokenizer, prompts, max_new_tokens=6) == before

    from cloudtrain.models.adapters import merge

    merged_dir = merge(out)
    auto = AutoModelForSequenceClassification if case.startswith("classification") else AutoModelForCausalLM
    merged = auto.from_pretrained(merged_dir).eval()
    ids = AutoTokenizer.from_pretrained(merged_dir)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, model(**ids).logits, rtol=1e-4, atol=1e-5)


def test_bad_adapter_options_are_refused_in_one_line_before_loading(
    tiny_model_dir, tiny_llama_dir, topic_csvs, tmp_path, capsys, monkeypatch
):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", no_loading)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    out = tmp_path / "out"
    base = {"model_name_or_path": tiny_model_dir, "train_file": str(topic_csvs["train"]), "output_dir": str(out)}
    cases = {
        "bad target": ({**base, "peft": "lora", "lora_target_modules": "q_proj"}, "q_proj is not a module of"),
        "not a linear layer": (
            {**base, "peft": "lora", "lora_target_modules": "query,LayerNorm"},
            "LayerNorm is not a linear or embedding layer of",
        ),
        "from scratch": (
            {
                "task": "causal_lm",
                "model_config": "llama-8m",
                "tokenizer_name_or_path": tiny_llama_dir,
                "train_file": str(topic_csvs["train"]),
                "output_dir": str(out),
                "peft": "lora",
            },
            "train it in full first, then pass it as --model_name_or_path",
        ),
        "merge without adapters": ({**base, "merge_adapters": "true"}, "--merge_adapters true needs adapters"),
        "only the new head": (  # found in audit: refused once the model had loaded, naming q_proj,v_proj
            {**base, "peft": "lora", "lora_target_modules": "classifier"},
            "these layers train in full in this run (classifier: new or resized), so no adapter is left; name "
            "other layers (dense,key,query,value) or all-linear",
        ),
        "only a grown vocabulary": (  # chatml's tokens: the embeddings and the head train in full
            {
                **base,
                "task": "sft",
                "model_name_or_path": tiny_llama_dir,
                "peft": "lora",
                "lora_target_modules": "lm_head,embed_tokens",
            },  # fmt: skip
            "--lora_target_modules lm_head,embed_tokens: these layers train in full in this run",
        ),
        "all-linear and names": (
            {**base, "peft": "lora", "lora_target_modules": "all-linear,query"},
            "all-linear names every linear layer and stands alone",
        ),
        "rank": ({**base, "peft": "lora", "lora_r": 0}, "--lora_r must be at least 1"),
        "dropout": ({**base, "peft": "lora", "lora_dropout": 1}, "--lora_dropout must be in [0, 1)"),
    }
    if not CUDA_AVAILABLE:
        cases["qlora on cpu"] = ({**base, "peft": "qlora"}, "needs a CUDA GPU; use --peft lora (or dora)")
    assert_each_refused(cases, capsys, out)


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
def test_merge_predict_and_generate_refuse_the_wrong_directory_in_one_line(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "base_model_name_or_path": "x"}))
    (adapter / "merged").mkdir()
    (adapter / "merged" / "my-weights.safetensors").write_text("a user's own merge")  # no manifest lists it
    cases = [
        (["merge", "--output_dir", str(tmp_path)], "holds no adapter (adapter_config.json)"),
        (["merge", "--model_dir", str(tmp_path)], f"--model_dir {tmp_path} holds no adapter"),  # the flag typed
        (["merge", "--model_dir", str(tmp_path / "gone")], f"--model_dir {tmp_path / 'gone'} does not exist"),
        (["merge", "--output_dir", str(adapter)], "merged is not one cloudtrain wrote, and merge would replace it"),
        (["predict", "--model_dir", str(adapter), "--text", "hi"], "write texts with it through the generate command"),
    ]
    for argv, message in cases:
        result = subprocess.run([sys.executable, str(ENTRY), *argv], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert message in result.stderr.strip().splitlines()[-1], result.stderr
    assert (adapter / "merged" / "my-weights.safetensors").read_text() == "a user's own merge"
    check_model_dir(str(adapter))  # generate takes a causal-LM adapter ...
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS"}))
    with pytest.raises(UserError, match="use the predict command"):  # ... and not a classifier's
        check_model_dir(str(adapter))


def test_an_adapter_given_as_the_model_to_train_is_pointed_to_its_merge(tmp_path):
    """It was "has no config.json; give a folder written by save_pretrained" (found in audit)."""
    from cloudtrain.models.load import check_checkpoint

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "base_model_name_or_path": "x"}))
    with pytest.raises(UserError) as refused:
        check_checkpoint(adapter, "--model_name_or_path")
    assert str(refused.value) == (
        f"--model_name_or_path {adapter} holds an adapter, not a model: give its merge with the base (cloudtrain "
        f"merge --model_dir {adapter} writes {adapter / 'merged'})"
    )
    (adapter / "merged").mkdir()
    (adapter / "merged" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=f"holds an adapter, not a model: give {adapter / 'merged'}, its merge$"):
        check_checkpoint(adapter, "--model_name_or_path")


def test_a_users_file_inside_cloudtrains_merged_folder_is_never_deleted(tmp_path):
    """merge (and a run over the folder) replaced a merged/ of its own whole, with the GGUF export the user had
    written into it (found in audit): refused in one line naming it."""
    import argparse

    from cloudtrain.commands import merge
    from cloudtrain.publish.output_dir import claim, record

    adapter = {"task_type": "CAUSAL_LM", "base_model_name_or_path": "x"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    (tmp_path / "merged").mkdir()
    for name in ("model.safetensors", "tokenizer.json", "args.json", "modeling_x.py", "serve.py", "model-q4.gguf"):
        (tmp_path / "merged" / name).write_text(name)
    # a remote-code model's own code, which save_pretrained copies, is cloudtrain's; another .py is the user's
    (tmp_path / "merged" / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_x.XModel"}}))
    record(tmp_path, ["adapter_config.json", "merged"])
    args = argparse.Namespace(output_dir=str(tmp_path))
    with pytest.raises(UserError) as refused:
        merge.check_options(args)
    assert str(refused.value) == (
        f"--output_dir {tmp_path} holds merged/model-q4.gguf, merged/serve.py, which cloudtrain did not write and "
        "merge would delete with the merged/ it replaces: move them elsewhere, then merge again"
    )
    with pytest.raises(UserError, match="holds merged/model-q4.gguf, merged/serve.py, which cloudtrain did not write"):
        claim(tmp_path)
    (tmp_path / "merged" / "model-q4.gguf").unlink()
    (tmp_path / "merged" / "serve.py").unlink()
    merge.check_options(args)
    claim(tmp_path)


def test_an_adapter_whose_base_model_was_moved_says_so_and_how_to_point_it_elsewhere(tmp_path):
    """predict, merge and generate load the base its config names; a folder gone since training was "Repo id must
    be in the form 'repo_name' or 'namespace/repo_name'" (taken for a Hub id)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    gone = tmp_path / "base-model"
    config = {"task_type": "SEQ_CLS", "base_model_name_or_path": str(gone)}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as refused:
        load_adapter_model(adapter)
    assert str(refused.value) == (
        f"the adapter in {adapter} was trained on {gone}, which is no longer there: put the base model back, or set "
        f"base_model_name_or_path in {adapter}/adapter_config.json to a copy of it (a folder or Hub id)"
    )


def test_a_damaged_adapter_folder_is_one_line(tmp_path, tiny_model_dir, monkeypatch):
    """A hand-edited adapter_config.json or labels.json with a typo was json's traceback in predict, merge and
    generate; a folder without the weights was "Repo id must be a string"; a Hub base neither cached nor reachable
    was a minute of retries (found in audit)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"task_type": "SEQ_CLS", base_model_name_or_path: 1}')
    with pytest.raises(UserError, match=r"adapter_config.json is not valid JSON \(line 1, column 26: Expecting"):
        load_adapter_model(adapter)
    config = {"task_type": "SEQ_CLS", "base_model_name_or_path": tiny_model_dir, "peft_type": "LORA"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"^{adapter} holds adapter_config.json but not the adapter's weights"):
        load_adapter_model(adapter)
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "labels.json").write_text("{bad")
    with pytest.raises(UserError, match="labels.json is not valid JSON"):
        load_adapter_model(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "someorg/gone"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UserError, match="base_model_name_or_path in .*adapter_config.json someorg/gone: no cached copy"
    ):
        load_adapter_model(adapter)
    (adapter / "labels.json").unlink()
    shutil.copytree(tiny_model_dir, tmp_path / "bertcopy")  # a folder named relatively is no Hub id (review)
    monkeypatch.chdir(tmp_path)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "bertcopy"}))
    with pytest.raises(UserError) as refused:  # the empty weights file, read once the base has loaded
        load_adapter_model(adapter)
    assert "could not load the adapter" in str(refused.value) and "no cached copy" not in str(refused.value)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": None}))
    with pytest.raises(UserError, match=r"adapter_config.json names no peft_type \(LORA, ...\): restore the file"):
        load_adapter_model(adapter)  # (PEFT's KeyError once the base had loaded)


# ---------------------------------------------------------------- real launches


def cls_args(tiny_model_dir, topic_csvs, out, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        "--model_name_or_path",
        tiny_model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--output_dir",
        str(out),
        "--peft",
        "lora",
        "--lora_r",
        "4",
        "--lora_dropout",
        "0.1",
        "--learning_rate",
        "5e-3",
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "2",
        "--mixed_precision",
        "no",
        "--eval_strategy",
        "no",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_resume_from_an_adapter_checkpoint_is_exact(processes, tiny_model_dir, topic_csvs, tmp_path):
    """The checkpoint holds only the adapter and head (and their optimizer state); resuming from it mid-epoch
    ends with the same adapter, bitwise, as the run that never stopped."""
    common = ["--max_steps", "9", "--checkpointing_steps", "4"]
    straight = tmp_path / "straight"
    launch(torchrun(processes), *cls_args(tiny_model_dir, topic_csvs, straight, *common))
    checkpoint = straight / "checkpoints" / "checkpoint-4"
    stored = load_file(checkpoint / "model.safetensors")
    assert stored and all(".lora_" in k or "modules_to_save" in k for k in stored), sorted(stored)[:5]
    resumed = launch(
        torchrun(processes),
        *cls_args(
            tiny_model_dir, topic_csvs, tmp_path / "resumed", *common, "--resume_from_checkpoint", str(checkpoint)
        ),
    )
    assert "at step 4" in resumed.stdout
    a = load_file(straight / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])  # ZeRO-1 and ZeRO-2 share a path; ZeRO-3 also gathers and merges
def test_lora_under_zero_on_two_processes_trains_saves_and_resumes(stage, tiny_llama_dir, tmp_path):
    """... and merges: under ZeRO-3 the main process's merge built the base inside DeepSpeed's partitioned init and
    waited for the other process until the collective timeout (found in audit)."""
    corpus = lm_corpus(tmp_path)
    out = tmp_path / "out"
    args = [
        str(ENTRY),
        "--task",
        "causal_lm",
        "--model_name_or_path",
        tiny_llama_dir,
        "--peft",
        "lora",
        "--lora_r",
        "4",
        "--train_file",
        str(corpus / "train.txt"),
        "--validation_file",
        str(corpus / "validation.txt"),
        "--max_length",
        "32",
        "--learning_rate",
        "1e-2",
        "--logging_steps",
        "1",
        "--mixed_precision",
        "no",
        "--eval_strategy",
        "no",
        "--sample_max_new_tokens",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--zero_stage",
        str(stage),
        "--max_steps",
        "4",
        "--checkpointing_steps",
        "2",
        "--output_dir",
        str(out),
        "--merge_adapters",
        "true",
        "--collective_timeout",
        "120",
    ]
    result = launch(torchrun(2), *args)
    assert f"ZeRO-{stage}" in result.stdout and "trainable" in result.stdout
    assert (out / "merged" / "model.safetensors").is_file() and "could not load the adapter" not in result.stdout
    first = load_file(out / "adapter_model.safetensors")
    assert first and all("lora_" in k for k in first)
    assert any(float(v.abs().max()) > 0 for k, v in first.items() if "lora_B" in k)  # it trained
    resumed = launch(
        torchrun(2),
        *args,
        "--overwrite_output_dir",
        "true",
        "--resume_from_checkpoint",
        str(out / "checkpoints" / "checkpoint-2"),
    )
    assert "at step 2" in resumed.stdout
    again = load_file(out / "adapter_model.safetensors")
    for k in first:
        torch.testing.assert_close(again[k], first[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_lora_on_minilm_learns_r8_well_above_the_majority_class(tmp_path):
    out = tmp_path / "r8"
    result = subprocess.run(
        [
            sys.executable,
            str(ENTRY),
            "--peft",
            "lora",
            "--max_train_samples",
            "256",
            "--max_eval_samples",
            "128",
            "--max_length",
            "64",
            "--num_train_epochs",
            "2",
            "--learning_rate",
            "2e-3",
            "--output_dir",
            str(out),
            "--eval_strategy",
            "no",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    per_label = [sum(row) for row in results["confusion_matrix"]]  # rows: the true labels
    majority = max(per_label) / sum(per_label)
    assert results["accuracy"] > majority + 0.2, (results["accuracy"], majority)
    assert (out / "adapter_model.safetensors").stat().st_size < 5e6  # megabytes, not the 90 MB model


@pytest.mark.gpu
def test_lora_under_fsdp2_trains_and_saves_the_adapter(tiny_llama_dir, tmp_path):
    corpus = lm_corpus(tmp_path)
    out = tmp_path / "fsdp"
    n = min(2, torch.cuda.device_count())
    result = launch(
        torchrun(n),
        str(ENTRY),
        "--task",
        "causal_lm",
        "--model_name_or_path",
        tiny_llama_dir,
        "--peft",
        "lora",
        "--fsdp",
        "true",
        "--mixed_precision",
        "bf16",
        "--train_file",
        str(corpus / "train.txt"),
        "--max_length",
        "32",
        "--learning_rate",
        "1e-2",
        "--max_steps",
        "20",
        "--logging_steps",
        "5",
        "--eval_strategy",
        "no",
        "--checkpointing_steps",
        "10",
        "--output_dir",
        str(out),
    )
    assert "FSDP" in result.stdout and "trainable" in result.stdout and "checkpoint-10" in result.stdout
    losses = [
        json.loads(line)["train/loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in line
    ]
    assert losses[-1] < losses[0]
    assert all("lora_" in k for k in load_file(out / "adapter_model.safetensors"))


@pytest.mark.gpu
def test_qlora_trains_a_tiny_llama_and_the_loss_falls(tiny_llama_dir, tmp_path):
    corpus = lm_corpus(tmp_path)
    out = tmp_path / "qlora"
    run_training(
        build_config(
            {
                "task": "causal_lm",
                "model_name_or_path": tiny_llama_dir,
                "peft": "qlora",
                "train_file": str(corpus / "train.txt"),
                "validation_file": str(corpus / "validation.txt"),
                "max_length": 32,
                "learning_rate": 1e-2,
                "max_steps": 30,
                "logging_steps": 5,
                "mixed_precision": "bf16",
                "output_dir": str(out),
                "eval_strategy": "no",
            }
        )
    )
    losses = [
        json.loads(line)["train/loss"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "train/loss" in line
    ]
    assert losses[-1] < losses[0]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_llama_dir


@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_a_bf16_run_keeps_the_frozen_base_in_bf16_and_trains_fp32_adapters(training_type, tiny_llama_dir, tmp_path):
    corpus = lm_corpus(tmp_path)
    run = build_run(
        build_config(
            {
                "task": "causal_lm",
                "model_name_or_path": tiny_llama_dir,
                "peft": "lora",
                "mixed_precision": "bf16",
                "training_type": training_type,
                "train_file": str(corpus / "train.txt"),
                "max_length": 32,
                "max_steps": 2,
                "num_sample_prompts": 0,
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    frozen = {p.dtype for p in run.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in run.model.parameters() if p.requires_grad} == {torch.float32}
    result = run.trainer.fit()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.train_loss))
    assert {p.dtype for p in run.model.parameters() if p.requires_grad} == {torch.float32}


def test_overwriting_a_full_model_with_an_adapter_leaves_no_old_weights_beside_it(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    out = tmp_path / "out"
    options = {
        "model_name_or_path": tiny_model_dir,
        "train_file": str(topic_csvs["train"]),
        "max_steps": 1,
        "output_dir": str(out),
        "training_type": "basic",
        "eval_strategy": "no",
        "checkpointing_steps": "1",
    }
    run_training(build_config(options))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # a LoRA on the word embeddings too: merging it stopped on the wrapped layer's missing num_embeddings (audit)
    lora = {"peft": "lora", "lora_target_modules": "query,word_embeddings"}
    run_training(build_config({**options, **lora, "overwrite_output_dir": True, "merge_adapters": True}))
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "model.safetensors").is_file()
    assert (out / "merged" / "args.json").read_bytes() == (out / "args.json").read_bytes()  # predict's max_length
    (tmp_path / "new").touch()
    readable = (tmp_path / "new").stat().st_mode & 0o777  # safetensors writes 0600: the weights read like the rest
    files = [f for folder in (out, out / "merged") for f in folder.iterdir() if f.is_file()]
    assert {f.stat().st_mode & 0o777 for f in files} == {readable}
    assert f"wrote {out / 'merged'}: the adapter merged into a copy of {tiny_model_dir}" in capsys.readouterr().out
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert (out / "checkpoints").is_dir()  # this run's checkpoints (the earlier run's were deleted at its start)


def test_the_head_and_whatever_sits_outside_the_pretrained_body_train_in_full():
    """DistilBERT's pre_classifier is as new as its classifier: frozen, it would stay random."""
    from transformers import DistilBertConfig

    from cloudtrain.tasks.classification import ClassificationTask

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(DistilBertConfig(n_layers=1))
    assert ClassificationTask().train_in_full(model) == ["pre_classifier", "classifier"]


def test_dotted_target_modules_are_matched_as_peft_matches_them(tiny_model_dir):
    from cloudtrain.models.adapters import check_target_modules

    cfg = build_config(
        {"model_name_or_path": tiny_model_dir, "peft": "lora", "lora_target_modules": "attention.self.query,value"}
    )
    check_target_modules(cfg, AutoModelForSequenceClassification)  # no error


def test_an_adapter_run_refuses_the_base_models_own_directory_and_a_checkpoint_of_other_settings(
    tiny_model_dir, topic_csvs, tmp_path
):
    options = {"model_name_or_path": tiny_model_dir, "train_file": str(topic_csvs["train"]), "peft": "lora"}
    with pytest.raises(UserError, match="is the input model's folder"):
        build_run(build_config({**options, "output_dir": tiny_model_dir, "overwrite_output_dir": True}))
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    state = {
        "format": "cloudtrain-checkpoint/1",
        "trainer": "BasicTrainer",
        "num_processes": 1,
        "state": {"global_step": 3},
    }
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match="trained every weight, this run asks for --peft lora --lora_r 16"):
        build_run(
            build_config({**options, "output_dir": str(tmp_path / "run"), "resume_from_checkpoint": str(checkpoint)})
        )


@pytest.mark.parametrize("training_type", ["basic", "accelerated"])
def test_sft_lora_in_bf16_with_a_grown_vocabulary_generates_its_samples(
    training_type, tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs
):
    """The new embeddings train in fp32 next to a bf16 base (a Llama: chatml grows its vocabulary): the evaluation's
    sample generations run under the same autocast as the step (else their matmuls mix float and bfloat16)."""
    options = case_options("sft-lora", tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs)
    options.update(model_name_or_path=tiny_llama_dir, mixed_precision="bf16", training_type=training_type, max_steps=1)
    results = run_training(build_config(options))
    assert results["eval"]["generations"] and all("answer" in g for g in results["eval"]["generations"])


def test_a_target_that_trains_in_full_gets_no_adapter(tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir,
                                                      topic_csvs, capsys):  # fmt: skip
    """chatml grows a Llama's vocabulary, so its embeddings and head train in full: --lora_target_modules lm_head
    crashed in PEFT ("modules_to_save cannot be applied to modules of type ...lora.layer.Linear"; audit)."""
    options = case_options("sft-lora", tmp_path, tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir, topic_csvs)
    options.update(model_name_or_path=tiny_llama_dir, max_steps=1, lora_target_modules="q_proj,lm_head")
    model = build_run(build_config(options)).model
    assert "note: lm_head train(s) in full in this run (new or resized), so no adapter goes on them" in (
        capsys.readouterr().out
    )
    names = [name for name, _ in model.named_parameters()]
    assert any("q_proj.lora_A" in n for n in names) and not any("lm_head.lora_A" in n for n in names)
    options.update(lora_target_modules="lm_head,embed_tokens")
    with pytest.raises(UserError, match="^--lora_target_modules lm_head,embed_tokens: these layers train in full"):
        build_run(build_config(options))


def test_bitsandbytes_cpu_kernel_warning_stays_off_stderr(caplog):
    """bitsandbytes logs it at import on CPUs with AVX512-BF16 (peft imports it wherever it is installed); the
    same logger's warning, emitted here whether or not bitsandbytes is installed, reaches no handler."""
    import logging

    import cloudtrain  # noqa: F401  (what every entry point imports first)

    with caplog.at_level(logging.WARNING):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
        logging.getLogger("bitsandbytes.other").warning("a warning of another bitsandbytes module")
    assert [r.getMessage() for r in caplog.records] == ["a warning of another bitsandbytes module"]


@pytest.mark.slow  # fresh training runs: the full suite's, not the fast tier's
def test_a_merge_that_fails_leaves_the_trained_adapter_published(
    tiny_model_dir, topic_csvs, tmp_path, capsys, monkeypatch
):
    """An unforeseen error in --merge_adapters (one was a LoRA on the embeddings) stopped the run after training,
    its adapter left in the hidden staging folder: the adapter is published and the warning says how to merge."""
    from cloudtrain.models import adapters

    def broken(*args, **kwargs):
        raise AttributeError("'Embedding' object has no attribute 'num_embeddings'")

    monkeypatch.setattr(adapters, "merge", broken)
    out = tmp_path / "out"
    options = {"model_name_or_path": tiny_model_dir, "train_file": str(topic_csvs["train"]), "max_steps": 1}
    options |= {"output_dir": str(out), "training_type": "basic", "eval_strategy": "no", "peft": "lora"}
    run_training(build_config({**options, "merge_adapters": True}))
    assert (out / "adapter_model.safetensors").is_file() and not (out / "merged").exists()
    printed = capsys.readouterr().out
    assert "warning: merging failed: AttributeError: 'Embedding' object" in printed
    assert "the adapter is saved (`cloudtrain merge` merges it)" in printed
