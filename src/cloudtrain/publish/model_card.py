"""The model card (README.md) that goes to the Hub with a trained model: where each part is built.

- cloudtrain.publish.classifier_card: a text classifier's card (`build_model_card`);
- cloudtrain.publish.lm_card: a causal language model's card (`build_lm_model_card`), which a chat model's
  (SFT) and a preference-tuned model's (DPO) cards build on;
- cloudtrain.publish.card_metadata: the YAML metadata the Hub parses (base model, license, datasets, tags,
  model-index), and the data's name (`dataset_info`);
- cloudtrain.publish.card_model_files: what the saved files tell (labels, architecture, parameters, adapter);
- cloudtrain.publish.card_sections: what every card shares (hyperparameters, adapter table, compute, curves,
  framework versions, table cells).

A text-to-image run's card is cloudtrain.publish.diffusion_card. This module names the builders and helpers
the tasks and the Hub upload import.
"""

from cloudtrain.publish.card_metadata import DEFAULT_BASE_MODEL, SPLITS, base_model_info, dataset_info
from cloudtrain.publish.card_sections import hyperparameters, table_cell
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.publish.lm_card import build_lm_model_card

__all__ = [
    "DEFAULT_BASE_MODEL",
    "SPLITS",
    "base_model_info",
    "build_lm_model_card",
    "build_model_card",
    "dataset_info",
    "hyperparameters",
    "table_cell",
]
