"""What the cards' hyperparameter table lists (the core options, and the others where they differ from their
default), and a DPO card built on the language-model card's own options (`tuning`, `perplexity=False`).

Output dirs are built by hand as in test_lm_card: no training, no Hub; cards go through huggingface_hub's parser.
"""

import dataclasses
import json

from test_lm_card import TRAIN, lm_output_dir, reparsed, table  # noqa: F401 (the fixture)

from cloudtrain.config import ImagesConfig, build_config
from cloudtrain.publish.card_sections import CORE_OPTIONS
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.tasks import build_task

IMAGE_OPTIONS = {f.name for f in dataclasses.fields(ImagesConfig)}
STREAMING_OPTIONS = {"streaming", "stream_buffer", "stream_validation_docs", "mixture_exhausted", "max_tokens"}
PAIRS = [{"question": "Who found the golden key?", "reference": "The poor boy.", "answer": "A | boy"}]


def dpo_results() -> dict:
    evaluation = {"loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.2, "samples": 8}
    return {
        "train": dict(TRAIN),
        "eval": evaluation | {"generations": [dict(g) for g in PAIRS]},
        "test": dict(evaluation),
    }


def test_a_dpo_card_lists_its_options_not_image_or_streaming_ones_and_no_perplexity(lm_output_dir, tmp_path):  # noqa: F811
    base = tmp_path / "tiny-chat"
    base.mkdir()
    (tmp_path / "pairs.jsonl").touch()
    cfg = build_config(
        {
            "task": "dpo",
            "model_name_or_path": str(base),
            "train_file": str(tmp_path / "pairs.jsonl"),
            "beta": 0.2,
            "max_steps": 6,
            "push_to_hub": True,
            "hub_model_id": "alice/tiny-dpo",
        }
    )
    card = reparsed(build_task(cfg).model_card(lm_output_dir, cfg, dpo_results()), tmp_path)
    hyper = dict(table(card.text, "### Training hyperparameters"))
    assert not (IMAGE_OPTIONS | STREAMING_OPTIONS) & set(hyper), hyper
    assert hyper["task"] == "dpo" and hyper["beta"] == "0.2" and hyper["max_steps"] == "6"
    assert hyper["model_name_or_path"] == "tiny-chat"  # a local path by its last part
    assert {"learning_rate", "per_device_train_batch_size", "seed", "mixed_precision", "peft"} <= set(hyper)
    assert "num_train_epochs" not in hyper  # --max_steps overrides it
    assert "preference_loss" not in hyper and "label_column" not in hyper  # at their default
    # the language-model card told how it was tuned, and left its perplexity evaluation out
    assert "preference-tuned (on chosen/rejected pairs) from a local base model" in card.text
    assert "supervised" not in card.text and "erplexity" not in card.text
    assert "### Evaluation results" not in card.text and not card.data.eval_results and not card.data.metrics
    assert card.text.count("### Sample answers") == 1  # DPO's own, with the chosen answers
    assert "| Who found the golden key? | The poor boy. | A \\| boy |" in card.text
    assert '"content": "Who found the golden key?"' in card.text  # the usage snippet asks a real question
    assert "Validation: loss 0.6100, pair accuracy 0.750" in card.text and "Test: loss 0.6100" in card.text
    assert {"dpo", "sigmoid"} <= set(card.data.tags)
    # DPO's section among the results, before the footer
    assert card.text.index("### Training results") < card.text.index("## Preference tuning")
    assert card.text.index("### Sample answers") < card.text.index("## Framework versions")
    assert str(tmp_path) not in card.text


def classifier_dir(tmp_path):
    out = tmp_path / "classifier"
    out.mkdir()
    config = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "finance", "1": "sports"}}
    (out / "config.json").write_text(json.dumps(config))
    return out


def classifier_results() -> dict:
    train = {"global_step": 4, "epoch": 2.0, "train_loss": 0.5, "train_runtime_s": 1.0, "train_samples_per_s": 9.0}
    return {"train": train, "eval": {"accuracy": 0.9, "macro_f1": 0.8, "loss": 0.3, "samples": 10}}


def test_a_classification_card_keeps_its_core_options_at_their_default(tmp_path):
    options = {"push_to_hub": True, "hub_model_id": "alice/topics", "weight_decay": 0.05, "text_column": "body"}
    card = build_model_card(classifier_dir(tmp_path), build_config(options), classifier_results())
    hyper = dict(table(card.text, "### Training hyperparameters"))
    # the built-in model: model_name_or_path unset (the card names the base model above); --max_steps unset too
    assert set(CORE_OPTIONS) - {"model_name_or_path", "max_steps"} <= set(hyper), hyper
    assert hyper["task"] == "classification" and hyper["learning_rate"] == "0.0001" and hyper["seed"] == "42"
    assert hyper["per_device_train_batch_size"] == "16" and hyper["num_train_epochs"] == "2.0"
    assert hyper["peft"] == "none"
    assert hyper["weight_decay"] == "0.05" and hyper["text_column"] == "body"  # set by the user
    assert not {"warmup_ratio", "label_column", "max_length", "packing", "beta"} & set(hyper)  # defaults
    assert not (IMAGE_OPTIONS | STREAMING_OPTIONS) & set(hyper)
    assert not {"hub_model_id", "push_to_hub"} & set(hyper)


def test_a_streamed_hub_dataset_is_linked_by_its_repo_id():
    from cloudtrain.config.data import DataConfig
    from cloudtrain.publish.card_metadata import dataset_info

    assert dataset_info(DataConfig(train_file="hf://datasets/alice/corpus@v1/data/*.jsonl")) == (
        "alice/corpus",
        "alice/corpus",
    )
    assert dataset_info(DataConfig(train_file="web.jsonl,hf://datasets/alice/corpus"))[0] is None  # a mixture
    # a config file's list of sources: the card named the built-in Reuters data for them (found in audit)
    listed = DataConfig(datasets=[{"path": "web/*.jsonl", "weight": 2}, {"path": "books.jsonl"}])
    assert dataset_info(listed)[0] is None and "Reuters" not in dataset_info(listed)[1]
    assert dataset_info(DataConfig(datasets=[{"path": "hf://datasets/alice/corpus"}]))[0] == "alice/corpus"
    # a presigned URL's query (its signature) is no part of the name (found in review)
    signed = "https://b.s3.amazonaws.com/k.jsonl?X-Amz-Signature=abc123&X-Amz-Credential=x"
    assert dataset_info(DataConfig(train_file=signed)) == (None, "k.jsonl")
