"""A Hugging Face decoder cut into pipeline stages that keep the checkpoint's parameter names.

Supports (by `config.model_type`): the Llama family (llama, mistral, qwen2, qwen3: `model.embed_tokens`,
`model.layers`, `model.norm`, `model.rotary_emb`) and GPT-2 (`transformer.wte/wpe/drop/h/ln_f`), with
the LM head `lm_head`. Stage 0 owns the embeddings, every stage its layers, the last stage the final
norm and the head. Each stage builds its causal mask (and rotary embeddings) from `position_ids` with
the same transformers helpers the whole model's forward calls, so packed documents stay apart exactly
as they do without a pipeline. Nothing is traced.

A stage's `state_dict` keys are the original checkpoint's (`model.layers.3.mlp...`): the stages'
dicts together are the model's, and `save_pretrained` of their union gives an ordinary checkpoint.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from cloudtrain.hardware import autocast


@dataclass(frozen=True)
class Family:
    root: str  # the decoder body's attribute on the *ForCausalLM
    embeddings: tuple[str, ...]  # what stage 0 owns, under `root`
    layers: str
    norm: str
    rotary: str | None  # computed by every stage (it holds no trained weights)


LLAMA = Family(root="model", embeddings=("embed_tokens",), layers="layers", norm="norm", rotary="rotary_emb")
GPT2 = Family(root="transformer", embeddings=("wte", "wpe", "drop"), layers="h", norm="ln_f", rotary=None)
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gpt2": GPT2}


def family_of(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def layer_prefix(config) -> str:
    """`model.layers` (Llama family) or `transformer.h` (GPT-2): what --pipeline_split_points name."""
    family = FAMILIES[config.model_type]
    return f"{family.root}.{family.layers}"


def balanced_split(n_layers: int, n_stages: int) -> list[range]:
    """Layer ranges per stage, balanced by count; the embeddings and the head each weigh about a layer, so
    the first and last stage get one layer fewer (n_layers + 2 units split evenly, the remainder to the
    middle stages, then one taken from each end)."""
    base, extra = divmod(n_layers + 2, n_stages)
    sizes = [base] * n_stages
    middle_first = sorted(range(n_stages), key=lambda s: abs(s - (n_stages - 1) / 2))
    for s in middle_first[:extra]:
        sizes[s] += 1
    sizes[0] -= 1
    sizes[-1] -= 1
    return _ranges(sizes)


def split_after(points: Sequence[int], n_layers: int) -> list[range]:
    """Layer ranges from the indices of the layers that end a stage (checked by the caller); the last stage
    holds what follows the last of them (at least the norm and head)."""
    bounds = [0, *(i + 1 for i in points), n_layers]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _ranges(sizes: list[int]) -> list[range]:
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def split_points_error(points: Sequence[str], prefix: str, n_layers: int, n_stages: int) -> str | None:
    """Why --pipeline_split_points cannot split this model into `n_stages`, or None."""
    if len(points) != n_stages - 1:
        return f"{len(points)} split point(s) give {len(points) + 1} stages, but the pipeline has {n_stages}"
    indices = []
    for point in points:
        head, _, index = point.rpartition(".")
        if head != prefix or not index.isdigit() or not int(index) < n_layers:
            return f"{point} is not a layer that can end a stage (name {prefix}.0 to {prefix}.{n_layers - 1})"
        indices.append(int(index))
    if indices != sorted(set(indices)):
        return f"{', '.join(points)} are not in increasing order"
    return None


def mask_kind(config, index: int) -> str:
    """Which causal mask layer `index` attends with, as the whole model's forward picks it."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None)
    return "sliding_attention" if sliding else "full_attention"


class Stage(nn.Module):
    """Layers `layer_ids` of `model` (+ the embeddings on the first stage, norm and head on the last).

    forward(input_ids or hidden states, position_ids) -> hidden states, or logits on the last stage (its normed
    hidden states where `head_in_loss`: the loss applies the head, --fused_cross_entropy).
    """

    def __init__(
        self, model: PreTrainedModel, index: int, layer_ids: range, first: bool, last: bool, precision: str = "no"
    ):
        super().__init__()
        self.index, self.first, self.last, self.precision = index, first, last, precision
        self.config = model.config
        self.family = family = FAMILIES[model.config.model_type]
        body = getattr(model, family.root)
        part = nn.Module()
        setattr(self, family.root, part)  # the same attribute path: the same parameter names
        if first:
            for name in family.embeddings:
                setattr(part, name, getattr(body, name))
        # keyed by the global index, so "model.layers.<i>." names survive
        layers = getattr(body, family.layers)
        setattr(part, family.layers, nn.ModuleDict({str(i): layers[i] for i in layer_ids}))
        if family.rotary:
            setattr(part, family.rotary, getattr(body, family.rotary))
        if last:
            setattr(part, family.norm, getattr(body, family.norm))
            self.lm_head = model.lm_head
        self.head_in_loss = False

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head on the last stage, as a transformers model names it (what --optim muon leaves to AdamW)."""
        return self.lm_head if self.last else None

    @property
    def body(self) -> Any:  # the decoder body's part: its submodules are the checkpoint's
        return getattr(self, self.family.root)

    def layers(self) -> nn.ModuleDict:
        return getattr(self.body, self.family.layers)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, x.device):  # the stage's own forward: the schedule calls it
            hidden = self._embed(x, position_ids) if self.first else x
            hidden = self._layers(hidden, position_ids)
            if self.last:
                hidden = getattr(self.body, self.family.norm)(hidden)
                if not self.head_in_loss:
                    hidden = self.lm_head(hidden)
        return hidden

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        body = self.body
        if self.family is GPT2:
            return body.drop(body.wte(input_ids) + body.wpe(position_ids))
        return body.embed_tokens(input_ids)

    def _layers(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        layers = self.layers()
        if not layers:
            return hidden
        mask_args: dict[str, Any] = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        kinds = {mask_kind(self.config, int(i)) for i in layers}
        masks = {
            kind: (create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)(
                **mask_args
            )
            for kind in kinds
        }
        extra = {}
        if self.family.rotary:
            extra["position_embeddings"] = getattr(self.body, self.family.rotary)(hidden, position_ids=position_ids)
        for i, layer in layers.items():
            hidden = layer(
                hidden, attention_mask=masks[mask_kind(self.config, int(i))], position_ids=position_ids, **extra
            )
        return hidden


def build_stages(
    model: PreTrainedModel, ranges: list[range], stage_ids: Sequence[int], precision: str = "no"
) -> list[Stage]:
    """This process's stages of `model`, cut at `ranges` (one per stage of the whole pipeline)."""
    last = len(ranges) - 1
    return [Stage(model, s, ranges[s], s == 0, s == last, precision) for s in stage_ids]


def tied(model: PreTrainedModel) -> bool:
    """Whether the head shares the input embedding matrix (GPT-2, many small Llama-family models)."""
    return model.lm_head.weight is model.get_input_embeddings().weight


def untie(stage: Stage) -> None:
    """Give a last stage that lives apart from stage 0 its own copy of the tied matrix; the trainer sums
    the two copies' gradients, so they stay equal."""
    stage.lm_head.weight = nn.Parameter(stage.lm_head.weight.detach().clone())


def release_others(model: PreTrainedModel, stages: list[Stage]) -> None:
    """Move every part of the model that no stage of this process holds (layers, and the embeddings, final norm
    and head of the stages elsewhere) to the meta device, freeing its memory; parameter-free parts (a rotary
    embedding every stage shares) stay."""
    owned = {id(p) for stage in stages for p in stage.parameters()}
    for module in model.modules():
        params = list(module.parameters())
        if params and params[0].device.type != "meta" and not any(id(p) in owned for p in params):
            module.to("meta")
