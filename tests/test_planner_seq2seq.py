"""The memory planner on encoder-decoders (T5, BART): the facts of both stacks; what autograd keeps for the backward
pass of a real forward, encoder over the source and decoder over the target (with cross-attention), within 10% of
the estimate for T5 (ReLU and gated) and BART, in fp32 and under bf16 autocast; `plan --task seq2seq` end to end
(logits over the target, FSDP2 rows with both stacks' layers, --max_target_length in the launch command); a BART
classifier."""

import pytest
import torch
from test_planner import BY_KEY, plan_args
from transformers import AutoConfig, AutoModelForSeq2SeqLM, BartConfig, T5Config

from cloudtrain import planning
from cloudtrain.config import Config, ModelConfig
from cloudtrain.models import adapters
from cloudtrain.planning import GIB, Candidate, Setup
from cloudtrain.planning.known_models import KNOWN_MODELS
from cloudtrain.planning.memory import target_length

VOCAB = 4000
T5 = dict(d_model=128, d_kv=32, d_ff=512, num_heads=4, num_layers=2, dropout_rate=0.1)
SHAPES = {
    "t5": T5,  # the original T5's ReLU MLP, dropout everywhere (its rate is also the MLP's and the attention's)
    "flan-t5": {**T5, "feed_forward_proj": "gated-gelu"},
    "t5-3b": {**T5, "d_model": 64, "d_ff": 1024, "num_heads": 8},  # heads x d_kv wider than d_model
}


def config(kind: str, layers: int = 2, **extra):
    if kind in SHAPES:
        return T5Config(vocab_size=VOCAB, **{**SHAPES[kind], **extra})
    bart = dict(  # bart-base's shape, scaled down: post-norm layers, learned positions, GELU MLP
        d_model=128,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        max_position_embeddings=512,
        dropout=0.1,
        activation_dropout=0.1,
        attention_dropout=0.0,
    )
    return BartConfig(vocab_size=VOCAB, **{**bart, "encoder_layers": layers, "decoder_layers": layers, **extra})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq-configs")
    made = {}
    for kind, cfg in {**{k: config(k) for k in SHAPES}, "bart": config("bart")}.items():
        cfg.save_pretrained(root / kind)
        made[kind] = str(root / kind)
    config("bart", decoder_layers=1, encoder_layers=3).save_pretrained(root / "bart-3-1")  # more encoder layers
    made["bart-3-1"] = str(root / "bart-3-1")
    return made


def kept_for_backward(model, run) -> int:
    """Bytes autograd keeps at the end of `run()`'s forward pass, less the weights and their casts (weight-shaped)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        cast = t.dim() == 2 and (tuple(t.shape) in shapes or tuple(t.shape)[::-1] in shapes)
        if storage.data_ptr() not in weights and not cast:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def cuda_like_dropout(x, p=0.5, training=True, inplace=False):
    """Dropout keeping a 1-byte mask, as CUDA's fused kernel does (CPU's F.dropout keeps a float one)."""
    return torch.native_dropout(x, p, True)[0] if training and p > 0 else x


def measured(folder: str, precision: str, peft: str, checkpointing: bool, source: int, target: int, b: int = 3):
    """(encoder, whole model) bytes kept for backward, rows padded as batches are. The base in bf16 with adapters
    (as training loads it), fp32 under autocast otherwise; "bf16-weights": every weight bf16 and no autocast, as
    DeepSpeed's bf16 engine runs ZeRO. T5's relative position bias is frozen and its attention
    dropout off: with either, CPU's sdpa falls back to a math kernel keeping the s x s matrix, where CUDA's fused
    kernels take the bias's gradient and draw the dropout inside."""
    half = (precision == "bf16" and peft != "none") or precision == "bf16-weights"
    model = AutoModelForSeq2SeqLM.from_config(
        AutoConfig.from_pretrained(folder), dtype=torch.bfloat16 if half else None
    )
    for name, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in name)
    for module in model.modules():  # T5's attention dropout: CPU's sdpa would also fall back to the math kernel
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "dropout", None), float):
            module.dropout = 0.0
    if peft != "none":
        cfg = Config(model=ModelConfig(peft=peft))
        model = adapters.attach(model, cfg, "SEQ_2_SEQ_LM", planning.task_for("seq2seq").train_in_full(model))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    src, tgt = torch.randint(5, VOCAB, (b, source)), torch.randint(5, VOCAB, (b, target))
    src_mask, tgt_mask = torch.ones(b, source, dtype=torch.long), torch.ones(b, target, dtype=torch.long)
    src_mask[0, source * 4 // 5 :], tgt_mask[0, target * 3 // 4 :] = 0, 0
    inputs = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)

    def forward(whole: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if whole:
                return model(**inputs)
            return model.get_encoder()(input_ids=src, attention_mask=src_mask)

    return kept_for_backward(model, lambda: forward(False)), kept_for_backward(model, lambda: forward(True))


CASES = [  # kind, precision, peft, checkpointing, source, target
    *((kind, precision, "none", False, 100, 40) for kind in ("t5", "flan-t5", "t5-3b", "bart") for precision in
      ("no", "bf16")),
    ("bart-3-1", "bf16", "none", False, 100, 40),
    ("flan-t5", "bf16", "lora", False, 300, 40),  # cross-attention k and v adapters read the longer source
    ("bart", "bf16", "lora", False, 300, 40),
    ("flan-t5", "no", "none", True, 100, 40),
    ("bart", "bf16", "none", True, 100, 40),
    ("bart", "bf16", "lora", True, 100, 40),
    *((kind, "bf16-weights", "none", False, 100, 40) for kind in ("t5", "flan-t5", "bart")),  # ZeRO's norms
]  # fmt: skip


@pytest.mark.parametrize("kind, precision, peft, checkpointing, source, target", CASES)
def test_each_stack_keeps_what_the_estimate_says(
    kind, precision, peft, checkpointing, source, target, folders, monkeypatch
):
    """Each stack within 10% without checkpointing; with it, the whole model (the layers' shared inputs are the
    encoder's or the decoder's by the order autograd meets them)."""
    monkeypatch.setattr(torch.nn.functional, "dropout", cuda_like_dropout)
    torch.manual_seed(0)
    encoder, whole = measured(folders[kind], precision, peft, checkpointing, source, target)
    facts = planning.model_facts(folders[kind], task="seq2seq")
    s = Setup(1, 1, 80 * GIB, None, source, precision.removesuffix("-weights"), target_length=target)
    run = Candidate(BY_KEY["zero2" if precision == "bf16-weights" else "ddp"], checkpointing, peft)
    estimated = planning.memory._activations(facts, run, s, 3)[0]
    estimated_encoder = planning.memory._stack_activations(facts.encoder, run, s, 3, source, dense=True)[0]
    print(f"{kind} {precision} {peft} checkpointing={checkpointing}: encoder {encoder} vs {estimated_encoder}, "
          f"whole {whole} vs {estimated}")  # fmt: skip
    assert whole == pytest.approx(estimated, rel=0.10)
    if not checkpointing:
        assert encoder == pytest.approx(estimated_encoder, rel=0.10)


def test_the_facts_of_both_stacks(folders, tmp_path):
    t5 = planning.model_facts(folders["t5-3b"], task="seq2seq")
    assert (t5.architecture, t5.num_layers, t5.encoder.num_layers) == ("T5ForConditionalGeneration", 2, 2)
    assert t5.attention_width == t5.encoder.attention_width == 8 * 32  # q is wider than d_model 64
    assert t5.attention_bias and t5.fp32_down_projection and t5.rms_norm and t5.norm_scales_input
    assert t5.vocab_size == VOCAB
    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(folders["t5-3b"]))
    assert t5.num_params == sum(p.numel() for p in model.parameters())
    in_layers = sum(p.numel() for stack in (model.encoder.block, model.decoder.block) for p in stack.parameters())
    assert t5.root_params == t5.num_params - in_layers  # embeddings, final norms, LM head
    assert t5.layer_params > t5.encoder.layer_params  # a decoder layer holds the cross-attention too
    uneven = tmp_path / "uneven-bart"  # BART's ffn sizes are per stack and named apart from intermediate_size
    config("bart", encoder_ffn_dim=384, decoder_ffn_dim=256, activation_dropout=0.1).save_pretrained(uneven)
    bart = planning.model_facts(str(uneven), task="seq2seq")
    assert (bart.intermediate_size, bart.encoder.intermediate_size) == (256, 384)
    assert bart.intermediate_dropout and not bart.attention_bias and not bart.rms_norm and not bart.attention_width
    assert not bart.norm_scales_input
    assert bart.attention_inputs == bart.encoder.attention_inputs == 3  # q, k, v of the self-attention


def test_plan_seq2seq_end_to_end(folders, tmp_path):
    args = dict(task="seq2seq", gpu_memory_gb=24, max_length=512, max_target_length=64, mixed_precision="bf16")
    plan = planning.make_plan(plan_args(folders["flan-t5"], tmp_path / "a", **args, per_device_train_batch_size=8))
    rows, rec = plan["strategies"], plan["recommendation"]
    assert plan["setup"]["target_length"] == 64 and plan["model"]["encoder"]["num_layers"] == 2
    assert all(row["estimate"]["logits"] == 8 * 64 * VOCAB * 12 for row in rows)  # over the target, not the source
    fsdp = {row["strategy"]: row["estimate"] for row in rows if row["peft"] == "none" and "fsdp" in row["strategy"]}
    assert {"fsdp", "fsdp_grad_op"} <= set(fsdp)  # the run shards T5 (its shared embedding one unit)
    # shard_grad_op keeps every layer gathered from its forward to its backward: the encoder's as well
    facts, both = planning.model_facts(folders["flan-t5"], task="seq2seq"), 2 + 2
    held = fsdp["fsdp_grad_op"]["parameters"] - fsdp["fsdp"]["parameters"]
    assert held == 2 * (both - 2) * facts.layer_params  # bf16 copies; full_shard holds two
    assert {row["peft"] for row in rows} == {"none", "lora", "qlora"}
    assert "--task seq2seq" in rec["command"] and "--max_target_length 64" in rec["command"]
    text = planning.render(plan)
    assert "2 encoder + 2 decoder layers" in text and "max_length 512, max_target_length 64" in text
    assert "logits: micro-batch x max_target_length x vocab" in text
    longer = planning.make_plan(plan_args(folders["flan-t5"], tmp_path / "b", **{**args, "max_target_length": 256}))
    by_key = {row["strategy"]: row for row in longer["strategies"] if row["peft"] == "none"}
    for key, row in by_key.items():  # a longer target: more activations and logits, every row
        before = next(r for r in rows if r["strategy"] == key and r["peft"] == "none")
        assert row["estimate"]["activations"] > before["estimate"]["activations"], key


# the model cards' counts (FLAN-T5's with its own LM head, which transformers 5 builds tied but loads apart)
PUBLISHED_PARAMS = {
    "t5-base": 222_903_552,
    "flan-t5-small": 76_961_152,
    "flan-t5-base": 247_577_856,
    "flan-t5-large": 783_150_080,
    "bart-base": 139_420_416,
    "bart-large-cnn": 406_290_432,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_well_known_encoder_decoders_plan_offline_with_their_published_sizes(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shapes come from the shipped table
    plan = planning.make_plan(plan_args(name, tmp_path, task="seq2seq", gpu="a10g", max_length=512))
    assert plan["model"]["num_params"] == PUBLISHED_PARAMS[name] and plan["model"]["encoder"] is not None
    hub = KNOWN_MODELS[name][0]  # the launch command loads the checkpoint by its Hub id
    assert f"--task seq2seq --model_name_or_path {hub} " in plan["recommendation"]["command"]


def test_a_bart_classifier_reads_its_input_in_both_stacks(folders, tmp_path):
    facts = planning.model_facts(folders["bart"], task="classification", num_labels=3)
    assert facts.architecture == "BartForSequenceClassification" and facts.encoder is not None
    assert facts.vocab_size == 0  # a classification head: no logits term
    s = Setup(1, 1, 24 * GIB, None, 128, "bf16", target_length=None)
    assert target_length(facts, s) == 128  # its decoder reads the same tokens
    plan = planning.make_plan(plan_args(folders["bart"], tmp_path, gpu_memory_gb=24, max_length=128))
    assert plan["recommendation"] is not None and "--max_target_length" not in plan["recommendation"]["command"]


def test_an_option_the_planned_task_does_not_read_is_noted_and_not_passed_on(tmp_path):
    args = dict(task="causal_lm", gpu_memory_gb=24, max_target_length=64, preference_loss="ipo")
    plan = planning.make_plan(plan_args(None, tmp_path, model_config="llama-8m", **args))
    assert plan["notes"][:2] == [
        "--max_target_length 64 has no effect on --task causal_lm; it counts for --task seq2seq",
        "--preference_loss ipo has no effect on --task causal_lm; it counts for --task dpo",
    ]
    command = plan["recommendation"]["command"]
    assert "--max_target_length" not in command and "--preference_loss" not in command


def test_a_plan_that_fits_nothing_names_a_target_length_that_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(
        task="seq2seq", gpu_memory_gb=1.6, max_length=512, per_device_train_batch_size=8, mixed_precision="bf16"
    )
    plan = planning.make_plan(plan_args("bart-large-cnn", tmp_path / "a", **args, max_target_length=1024))
    assert plan["recommendation"] is None
    idea = next(s for s in plan["suggestions"] if s.startswith("a shorter target"))
    shorter = int(idea.rsplit(" ", 1)[1])
    assert (
        shorter < 1024
        and planning.make_plan(plan_args("bart-large-cnn", tmp_path / "b", **args, max_target_length=shorter))[
            "recommendation"
        ]
    )


def test_a_training_run_s_auto_micro_batch_reads_its_target_length(folders):
    """--per_device_train_batch_size auto sized T5's decoder and logits at the source length (found in audit)."""
    from cloudtrain.config import build_config
    from cloudtrain.planning.search import run_micro_batch

    def largest(target: int) -> int:
        options = {"task": "seq2seq", "model_name_or_path": folders["flan-t5"], "max_target_length": target}
        return run_micro_batch(build_config({**options, "mixed_precision": "no"}), 0, 1, 1, 2 * 2**30, 512)

    short, long = largest(16), largest(512)
    assert short > long > 0
