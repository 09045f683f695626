"""The model card of a causal language model (`build_lm_model_card`) and the Hub commit message.

Output dirs are built by hand (config.json of a tiny Llama, results files, maybe a safetensors file and the
curves plot): no training, no Hub; the card goes through huggingface_hub's parser as the Hub would read it.
"""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from cloudtrain.config import build_config
from cloudtrain.publish.card_sections import table_cell
from cloudtrain.publish.hub import commit_message
from cloudtrain.publish.lm_card import build_lm_model_card

TOKEN = "hf_secret_token_for_the_card_test"
TRAIN = {
    "global_step": 10,
    "epoch": 1.0,
    "train_loss": 3.5,
    "train_runtime_s": 3.0,
    "train_samples": 50,
    "train_samples_per_s": 16.67,
    "train_tokens_per_s": 1234.5,
}
GENERATIONS = [
    {"prompt": "Once upon a time", "continuation": " there was a cat."},
    {"prompt": "a | b\nc", "continuation": " <b>bold</b> \\| x\r\ny|"},
    {"prompt": 'She said "hi"', "continuation": ""},
]


def lm_results(test: bool = True) -> dict:
    results = {
        "train": dict(TRAIN),
        "eval": {
            "loss": 3.2,
            "perplexity": 24.53253,
            "tokens": 1000,
            "samples": 8,
            "runtime_s": 1.0,
            "tokens_per_s": 1000.0,
            "generations": [dict(g) for g in GENERATIONS],
        },
    }
    if test:
        results["test"] = {
            "loss": 3.3,
            "perplexity": 27.1126,
            "tokens": 900,
            "samples": 7,
            "runtime_s": 0.9,
            "tokens_per_s": 1000.0,
            "generations": [{"prompt": "test prompt", "continuation": "not on the card"}],
        }
    return results


@pytest.fixture
def lm_output_dir(tmp_path) -> Path:
    """What a finished causal-LM run leaves: a causal LM's config.json, args.json and the results files."""
    out = tmp_path / "run"
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(out)
    results = lm_results()
    (out / "args.json").write_text(json.dumps({"task": "causal_lm"}))
    for name, metrics in results.items():
        (out / f"{name}_results.json").write_text(json.dumps(metrics))
    return out


def lm_config(tmp_path: Path, **options):
    tokenizer_dir = tmp_path / "my-tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    values = {"task": "causal_lm", "push_to_hub": True, "hub_model_id": "alice/tiny-lm", "hub_token": TOKEN}
    if "model_name_or_path" not in options:
        values |= {"model_config": "llama-8m", "tokenizer_name_or_path": str(tokenizer_dir)}
    return build_config(values | options)


def reparsed(card: ModelCard, tmp_path: Path) -> ModelCard:
    """The card as the Hub reads it: saved as README.md and parsed back."""
    card.save(tmp_path / "README.md")
    return ModelCard.load(tmp_path / "README.md")


def model_index(card: ModelCard) -> dict[tuple[str, str], tuple[float, str]]:
    """{(split, metric type): (value, metric name)}, checking every result is a text-generation one."""
    assert {(r.task_type, r.task_name) for r in card.data.eval_results} == {("text-generation", "Text Generation")}
    return {(r.dataset_split, r.metric_type): (r.metric_value, r.metric_name) for r in card.data.eval_results}


def cells(line: str) -> list[str]:
    """The cells of a markdown table row as GitHub-flavoured markdown splits it: at `|` not escaped by `\\`."""
    parts, cell, i = [], "", 0
    assert line.startswith("|") and line.endswith("|"), line
    line = line[1:-1]
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            cell += line[i : i + 2]
            i += 2
            continue
        if line[i] == "|":
            parts.append(cell.strip())
            cell = ""
        else:
            cell += line[i]
        i += 1
    return parts + [cell.strip()]


def table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `heading`, header row and separator left out."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return rows


# ---------------------------------------------------------------- metadata


def test_card_of_a_model_trained_from_scratch_has_text_generation_metadata(lm_output_dir, tmp_path):
    cfg = lm_config(tmp_path, dataset_name="roneneldan/TinyStories")
    card = reparsed(build_lm_model_card(lm_output_dir, cfg, lm_results()), tmp_path)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["text-generation", "cloudtrain"]
    assert data["datasets"] == ["roneneldan/TinyStories"]
    assert "base_model" not in data and "license" not in data  # from scratch: no base model, no license known
    assert model_index(card) == {
        ("validation", "perplexity"): (24.5325, "Perplexity"),
        ("validation", "loss"): (3.2, "Loss"),
        ("test", "perplexity"): (27.1126, "Perplexity"),
        ("test", "loss"): (3.3, "Loss"),
    }
    assert {r.dataset_type for r in card.data.eval_results} == {"roneneldan/TinyStories"}
    assert "trained from scratch from the llama-8m configuration" in card.text
    assert "`LlamaForCausalLM`" in card.text
    assert "fine-tuned" not in card.text and "classification" not in card.text.lower()
    assert TOKEN not in str(card)


def test_card_of_continued_pretraining_names_the_hub_base_model(lm_output_dir, tmp_path):
    cfg = lm_config(
        tmp_path,
        model_name_or_path="HuggingFaceTB/SmolLM2-135M",
        dataset_name="wikitext",
        dataset_config="wikitext-2-raw-v1",
        hub_revision="experiments",
    )
    card = reparsed(build_lm_model_card(lm_output_dir, cfg, lm_results(test=False)), tmp_path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M" and card.data.license is None
    assert (
        "trained by continued pretraining of "
        "[HuggingFaceTB/SmolLM2-135M](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)"
    ) in card.text
    assert "from scratch" not in card.text
    assert set(model_index(card)) == {("validation", "perplexity"), ("validation", "loss")}
    assert {(r.dataset_name, r.dataset_config) for r in card.data.eval_results} == {
        ("wikitext (wikitext-2-raw-v1)", "wikitext-2-raw-v1")
    }
    assert 'pipeline("text-generation", model="alice/tiny-lm", revision="experiments")' in card.text


def test_a_local_base_model_and_local_data_are_not_named_as_hub_repos(lm_output_dir, tmp_path):
    base = tmp_path / "private-base-lm"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: mit\n---\n# my base\n")
    train = tmp_path / "corpus" / "train.txt"
    train.parent.mkdir()
    train.write_text("one document\n")
    cfg = lm_config(tmp_path, model_name_or_path=str(base), train_file=str(train))
    card = reparsed(build_lm_model_card(lm_output_dir, cfg, lm_results()), tmp_path)
    data = card.data.to_dict()
    assert "base_model" not in data and "datasets" not in data
    assert data["license"] == "mit"  # stated by the local base model's own card
    assert "continued pretraining of a local base model" in card.text
    assert "on train.txt with cloudtrain" in card.text
    assert {r.dataset_type for r in card.data.eval_results} == {"train.txt"}
    assert str(tmp_path) not in str(card)  # local paths show only their last part


def test_a_config_file_names_the_configuration_by_file_name(lm_output_dir, tmp_path):
    config_file = tmp_path / "configs" / "llama-tiny.json"
    config_file.parent.mkdir()
    config_file.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    cfg = lm_config(tmp_path, model_config=str(config_file))
    card = build_lm_model_card(lm_output_dir, cfg, lm_results())
    assert "trained from scratch from the llama-tiny.json configuration" in card.text
    assert "| model_config | llama-tiny.json |" in card.text
    assert card.data.base_model is None
    assert str(tmp_path) not in str(card)


def test_an_infinite_perplexity_stays_out_of_the_metadata_but_shows_in_the_table(lm_output_dir, tmp_path):
    results = lm_results()
    results["test"].update(loss=800.0, perplexity=float("inf"))
    card = reparsed(build_lm_model_card(lm_output_dir, lm_config(tmp_path), results), tmp_path)
    assert ("test", "perplexity") not in model_index(card)
    assert model_index(card)[("test", "loss")] == (800.0, "Loss")
    assert ["test", "900", "800.0000", "inf"] in table(card.text, "### Evaluation results")


# ---------------------------------------------------------------- body


def test_body_has_usage_hyperparameters_and_result_tables(lm_output_dir, tmp_path):
    cfg = lm_config(tmp_path, learning_rate=3e-4, max_length=256, packing="bfd", sample_max_new_tokens=16)
    card = build_lm_model_card(lm_output_dir, cfg, lm_results())
    text = card.text
    assert 'generator = pipeline("text-generation", model="alice/tiny-lm")' in text
    assert 'print(generator("Once upon a time", max_new_tokens=16)[0]["generated_text"])' in text
    hyper = dict(table(text, "### Training hyperparameters"))
    assert hyper["learning_rate"] == "0.0003" and hyper["max_length"] == "256" and hyper["packing"] == "bfd"
    assert hyper["task"] == "causal_lm" and hyper["tokenizer_name_or_path"] == "my-tokenizer"
    assert not {"label_column", "text_pair_column", "hub_model_id", "hub_token", "push_to_hub"} & set(hyper)
    assert table(text, "### Training results") == [["10", "1.0", "3.5000", "3.0", "1234.5"]]
    assert table(text, "### Evaluation results") == [
        ["validation", "1000", "3.2000", "24.53"],
        ["test", "900", "3.3000", "27.11"],
    ]
    assert "- Perplexity: 24.53\n- Loss: 3.2000" in text  # the headline: the validation set
    assert "training_curves.png" not in text
    assert re.search(r"^- transformers \S+$", text, re.M) and re.search(r"^- torch \S+$", text, re.M)


def test_sample_generations_of_the_validation_set_are_an_escaped_table(lm_output_dir, tmp_path):
    card = build_lm_model_card(lm_output_dir, lm_config(tmp_path), lm_results())
    rows = table(card.text, "### Sample generations")
    assert len(rows) == len(GENERATIONS) and all(len(row) == 2 for row in rows)  # no cell split, no row broken
    assert rows[0] == ["Once upon a time", "there was a cat."]
    assert rows[1] == ["a \\| b<br>c", "&lt;b&gt;bold&lt;/b&gt; \\\\\\| x<br>y\\|"]
    assert rows[2] == ['She said "hi"', ""]
    assert "not on the card" not in card.text  # the test split's generations are not shown


def test_no_generations_no_test_split_and_a_curves_plot(lm_output_dir, tmp_path):
    (lm_output_dir / "training_curves.png").write_bytes(b"\x89PNG")
    results = lm_results(test=False)
    del results["eval"]["generations"]
    card = build_lm_model_card(lm_output_dir, lm_config(tmp_path), results)
    assert "Sample generations" not in card.text
    assert "![Training curves](training_curves.png)" in card.text
    assert table(card.text, "### Evaluation results") == [["validation", "1000", "3.2000", "24.53"]]
    assert 'generator("Once upon a time", max_new_tokens=32)' in card.text


def test_the_usage_prompt_is_a_valid_python_string(lm_output_dir, tmp_path):
    results = lm_results()
    results["eval"]["generations"] = [{"prompt": 'He said "stop"\nand \\left', "continuation": "."}]
    card = build_lm_model_card(lm_output_dir, lm_config(tmp_path), results)
    line = next(line for line in card.text.splitlines() if line.startswith("print(generator("))
    call = line[len("print(generator(") : line.index(", max_new_tokens")]
    assert eval(call) == 'He said "stop"\nand \\left'  # a string literal, nothing else


def test_the_parameter_count_comes_from_the_safetensors_files(lm_output_dir, tmp_path):
    save_file(
        {"embed.weight": torch.zeros(1000, 64), "norm.weight": torch.zeros(64)},
        str(lm_output_dir / "model-00001-of-00002.safetensors"),
    )
    save_file({"lm_head.weight": torch.zeros(1000, 64)}, str(lm_output_dir / "model-00002-of-00002.safetensors"))
    card = build_lm_model_card(lm_output_dir, lm_config(tmp_path), lm_results())
    assert "(`LlamaForCausalLM`, 128.1K parameters)" in card.text


def test_table_cell_escapes_what_would_break_a_markdown_table():
    assert table_cell("a|b") == "a\\|b"
    assert table_cell("x\ny\r\nz\r") == "x<br>y<br>z"
    assert table_cell("<i>&") == "&lt;i&gt;&amp;"
    assert table_cell("\\|") == "\\\\\\|"  # an escaped backslash, then an escaped pipe
    assert cells("| " + table_cell("a\\|b|c\\") + " | two |") == ["a\\\\\\|b\\|c\\\\", "two"]


# ---------------------------------------------------------------- commit message


def test_commit_message_names_accuracy_for_a_classifier_and_perplexity_for_a_language_model():
    classifier = {
        "train": {"global_step": 40},
        "eval": {"accuracy": 0.91234, "loss": 0.3},
        "test": {"accuracy": 0.8, "loss": 0.4},
    }
    assert (
        commit_message(classifier)
        == "Upload model trained with cloudtrain (40 steps, eval accuracy 0.9123, test accuracy 0.8000)"
    )
    assert (
        commit_message(lm_results())
        == "Upload model trained with cloudtrain (10 steps, eval perplexity 24.53, test perplexity 27.11)"
    )
    assert (
        commit_message(lm_results(test=False))
        == "Upload model trained with cloudtrain (10 steps, eval perplexity 24.53)"
    )
    assert commit_message({"train": {"global_step": 5}}) == "Upload model trained with cloudtrain (5 steps)"


def test_a_system_prompt_shows_in_the_chat_usage_only_where_training_used_it(lm_output_dir, tmp_path):
    """SFT puts --system_prompt before each conversation; DPO's pairs are encoded without it."""
    for task, shown in (("sft", True), ("dpo", False)):
        cfg = lm_config(tmp_path, task=task, system_prompt="You are terse.")
        text = str(build_lm_model_card(lm_output_dir, cfg, lm_results(), chat=True))
        assert ('"content": "You are terse."' in text) is shown, task
