"""The memory planner on encoder-decoders (T5, BART): the facts of both stacks; what autograd keeps for the backward
pass of a real forward, encoder over the source and decoder over the target (with cross-attention), within 10% of
the estimate for T5 (ReLU and gated) and BART, in fp32 and under bf16 autocast; `plan --task seq2seq` end to end
(logits over the target, no FSDP rows, --max_target_length in the launch command); a BART classifier."""

import pytest
import torch
from test_planner import BY_KEY, plan_args
from transformers import AutoConfig, AutoModelForSeq2SeqLM, BartConfig, T5Config

from cloudtrain import planning
from cloudtrain.planning import GIB, Candidate, Setup
from cloudtrain.planning.memory import target_length

VOCAB = 4000
SHAPES = {
    "t5": dict(d_model=128, d_kv=32, d_ff=512, num_heads=4, dropout_rate=0.0),  # t5-base's ReLU MLP
    "flan-t5": dict(d_model=128, d_kv=32, d_ff=512, num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu"),
    "t5-3b": dict(d_model=64, d_kv=32, d_ff=1024, num_heads=8, dropout_rate=0.0),  # heads x d_kv wider than d_model
}


def config(kind: str, layers: int = 2, **extra):
    if kind in SHAPES:
        return T5Config(vocab_size=VOCAB, num_layers=layers, **{**SHAPES[kind], **extra})
    bart = dict(  # bart-base's shape, scaled down: post-norm layers, learned positions, GELU MLP
        d_model=128,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        max_position_embeddings=256,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return BartConfig(vocab_size=VOCAB, encoder_layers=layers, decoder_layers=layers, **{**bart, **extra})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("seq2seq-configs")
    made = {}
    for kind in (*SHAPES, "bart"):
        config(kind).save_pretrained(root / kind)
        made[kind] = str(root / kind)
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


@pytest.mark.parametrize(
    "kind, precision",
    [("t5", "no"), ("flan-t5", "no"), ("t5-3b", "no"), ("bart", "no"), ("flan-t5", "bf16"), ("bart", "bf16")],
)
def test_each_stack_keeps_what_the_estimate_says(kind, precision, folders):
    """Rows padded as batches are (both attentions masked); b*S, b*T differ from every weight's sizes. Under bf16
    on CPU, ReLU T5's attention falls back to an fp32 math kernel that CUDA's do not use: measured in fp32 only."""
    facts = planning.model_facts(folders[kind], task="seq2seq")
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(folders[kind])).train()
    b, source, target = 3, 100, 40
    src, tgt = torch.randint(5, VOCAB, (b, source)), torch.randint(5, VOCAB, (b, target))
    src_mask, tgt_mask = torch.ones(b, source, dtype=torch.long), torch.ones(b, target, dtype=torch.long)
    src_mask[0, 80:], tgt_mask[0, 30:] = 0, 0

    def forward(whole: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if not whole:
                return model.get_encoder()(input_ids=src, attention_mask=src_mask)
            return model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)

    encoder = kept_for_backward(model, lambda: forward(False))
    decoder = kept_for_backward(model, lambda: forward(True)) - encoder
    s = Setup(1, 1, 80 * GIB, None, source, precision, target_length=target)
    ddp = Candidate(BY_KEY["ddp"], False)
    estimated = planning.memory._activations(facts, ddp, s, b)[0]
    estimated_encoder = planning.memory._stack_activations(facts.encoder, ddp, s, b, source, dense=True)[0]
    print(f"{kind} {precision}: encoder {encoder} vs {estimated_encoder}, decoder {decoder} vs "
          f"{estimated - estimated_encoder}")  # fmt: skip
    assert encoder == pytest.approx(estimated_encoder, rel=0.10)
    assert decoder == pytest.approx(estimated - estimated_encoder, rel=0.10)


def test_the_facts_of_both_stacks(folders, tmp_path):
    t5 = planning.model_facts(folders["t5-3b"], task="seq2seq")
    assert (t5.architecture, t5.num_layers, t5.encoder.num_layers) == ("T5ForConditionalGeneration", 2, 2)
    assert t5.attention_width == t5.encoder.attention_width == 8 * 32  # q is wider than d_model 64
    assert t5.attention_bias and t5.fp32_down_projection and t5.rms_norm and t5.vocab_size == VOCAB
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
    assert bart.attention_inputs == bart.encoder.attention_inputs == 3  # q, k, v of the self-attention


def test_plan_seq2seq_end_to_end(folders, tmp_path):
    args = dict(task="seq2seq", gpu_memory_gb=24, max_length=512, max_target_length=64, mixed_precision="bf16")
    plan = planning.make_plan(plan_args(folders["flan-t5"], tmp_path / "a", **args, per_device_train_batch_size=8))
    rows, rec = plan["strategies"], plan["recommendation"]
    assert plan["setup"]["target_length"] == 64 and plan["model"]["encoder"]["num_layers"] == 2
    assert all(row["estimate"]["logits"] == 8 * 64 * VOCAB * 12 for row in rows)  # over the target, not the source
    assert not [row for row in rows if "fsdp" in row["strategy"]]  # the run refuses FSDP2 for seq2seq
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
    assert (
        plan["recommendation"] is not None
        and "--task seq2seq --model_name_or_path " in (plan["recommendation"]["command"])
    )


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
        "--preference_loss ipo has no effect on --task causal_lm; it counts for --task dpo",
        "--max_target_length 64 has no effect on --task causal_lm; it counts for --task seq2seq",
    ]
    command = plan["recommendation"]["command"]
    assert "--max_target_length" not in command and "--preference_loss" not in command
