"""Options of preference tuning (`--task dpo`, `--task reward`): the loss, its constants, the reference, the columns."""

from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
# --beta when not given: each loss's paper default (see the help of --beta)
DEFAULT_BETA = {"sigmoid": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
REFERENCE_FREE = frozenset({"simpo", "orpo"})


@dataclass
class PreferenceConfig(OnlyFields):
    preference_loss: str = opt(
        "sigmoid",
        "DPO: the preference loss. sigmoid: DPO (Rafailov et al. 2023, arXiv:2305.18290); ipo: IPO's squared "
        "loss (Azar et al. 2023, arXiv:2310.12036); simpo: SimPO, reference-free, length-normalised, with a "
        "target margin (Meng et al. 2024, arXiv:2405.14734); orpo: ORPO, reference-free, the odds-ratio loss "
        "plus the SFT loss on the chosen answer (Hong et al. 2024, arXiv:2403.07691).",
        PREFERENCE_LOSSES,
    )
    beta: float | None = opt(
        None,
        "DPO: the loss's strength. sigmoid: beta, the KL penalty's weight (paper: 0.1); ipo: tau, the "
        "regularisation (0.1, as TRL); simpo: beta, the reward scale (2.0, the SimPO repository's setting); "
        "orpo: lambda, the odds-ratio term's weight (0.1, the ORPO paper). Default: the loss's value above.",
    )
    simpo_gamma: float = opt(
        1.0,
        "DPO with --preference_loss simpo: gamma, the target reward margin (the SimPO repository's "
        "gamma/beta ratio 0.5 at beta 2.0).",
    )
    precompute_reference: bool = opt(
        False,
        "DPO (sigmoid, ipo): compute the reference log-probabilities in one pass before training and keep no "
        "reference model during it (a frozen copy under full fine-tuning, the adapters disabled under --peft).",
    )
    chosen_column: str = opt("chosen", "DPO and reward: the column of preferred answers (text, or messages).")
    rejected_column: str = opt("rejected", "DPO and reward: the column of dispreferred answers (text, or messages).")
    margin_column: str | None = opt(
        None, "Reward: an optional column of margins, subtracted inside the Bradley-Terry loss (Llama 2's)."
    )

    @property
    def strength(self) -> float:
        """--beta, or the loss's paper default."""
        return self.beta if self.beta is not None else DEFAULT_BETA[self.preference_loss]

    @property
    def pair_columns(self) -> tuple[str, str]:
        return self.chosen_column, self.rejected_column

    @property
    def needs_reference(self) -> bool:
        return self.preference_loss not in REFERENCE_FREE

    def check(self) -> None:
        if self.beta is not None and self.beta <= 0:
            raise UserError("--beta must be positive")
        if self.simpo_gamma < 0:
            raise UserError("--simpo_gamma must not be negative")
        if self.chosen_column == self.rejected_column:
            raise UserError("--chosen_column and --rejected_column must differ")
