"""The FLOPs estimate behind train/mfu: non-embedding matmul parameters plus attention, frozen parts."""

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from cloudtrain.data.packing import CausalLMCollator, pack
from cloudtrain.observe.flops import (
    DEVICES,
    DeviceInfo,
    ModelFlops,
    attention_dims,
    attention_squared_lengths,
    device_peak,
    full_numel,
    identify,
    matmul_parameters,
    matmul_precision,
    no_peak_reason,
    peak_flops,
    sum_squared_lengths,
)


def total_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=8)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4))


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    # head_dim 16 with 4 heads: d_attn 64 differs from hidden_size 32, as it may in Llama-style models
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )


def tiny_bert_classifier() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(
        BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
        )
    )


def test_minilm_counts_everything_but_the_embedding_tables(minilm, minilm_dir):
    config = AutoConfig.from_pretrained(minilm_dir)
    d = config.hidden_size
    tables = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * d
    total = total_parameters(minilm)
    flops = ModelFlops.from_model(minilm)
    assert flops.matmul_params == total - tables
    assert flops.trainable_matmul_params == flops.matmul_params
    assert (flops.n_layers, flops.d_attn) == (config.num_hidden_layers, d)


@pytest.mark.parametrize("seq_len", [64, 128])
def test_minilm_per_token_flops_about_half_the_old_6n(minilm, minilm_dir, seq_len):
    config = AutoConfig.from_pretrained(minilm_dir)
    d, layers = config.hidden_size, config.num_hidden_layers
    total = total_parameters(minilm)
    non_embedding = total - (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * d
    expected = 6 * non_embedding + 12 * layers * d * seq_len
    flops = ModelFlops.from_model(minilm)
    assert flops.flops_per_token(seq_len) == pytest.approx(expected)
    old = 6 * total
    assert flops.flops_per_token(seq_len) < 0.55 * old  # the old formula overstated by about 2x
    assert old / flops.flops_per_token(seq_len) == pytest.approx(old / expected)
    assert 1.9 < old / expected < 2.1


def test_old_six_n_formula_is_not_what_is_computed(minilm):
    flops = ModelFlops.from_model(minilm)
    tokens = 16 * 64
    assert flops.training_flops(tokens, 16 * 64**2) != pytest.approx(6 * total_parameters(minilm) * tokens, rel=0.1)


def test_gpt2_tied_lm_head_counted_once_embeddings_excluded():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    n_total, _ = matmul_parameters(model)
    # parameters() lists the tied matrix once: total minus the position table leaves it in, once
    assert n_total == total_parameters(model) - model.transformer.wpe.weight.numel()
    assert n_total == (
        sum(p.numel() for p in model.transformer.h.parameters())
        + sum(p.numel() for p in model.transformer.ln_f.parameters())
        + model.lm_head.weight.numel()
    )
    flops = ModelFlops.from_model(model)
    assert (flops.n_layers, flops.d_attn) == (2, 32)
    assert flops.attention_flops(50**2) == 12 * 2 * 32 * 50**2


def test_llama_untied_lm_head_counted_input_embedding_excluded():
    model = tiny_llama()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    n_total, n_trainable = matmul_parameters(model)
    assert n_total == total_parameters(model) - model.model.embed_tokens.weight.numel()
    assert model.lm_head.weight.numel() == 100 * 32 and n_trainable == n_total
    flops = ModelFlops.from_model(model)
    assert (flops.n_layers, flops.d_attn) == (2, 4 * 16)  # heads * head_dim, not hidden_size
    lengths = [10, 30, 7]
    assert flops.training_flops(sum(lengths), sum(n * n for n in lengths)) == (
        6 * n_total * sum(lengths) + sum(12 * 2 * 64 * n * n for n in lengths)
    )


def test_frozen_base_counts_only_trainable_weight_gradients():
    model = tiny_bert_classifier()
    for p in model.bert.parameters():
        p.requires_grad_(False)
    head = sum(p.numel() for p in model.classifier.parameters())
    flops = ModelFlops.from_model(model)
    n = flops.matmul_params
    assert flops.trainable_matmul_params == head
    assert n == total_parameters(model) - sum(
        m.weight.numel()
        for m in (
            model.bert.embeddings.word_embeddings,
            model.bert.embeddings.position_embeddings,
            model.bert.embeddings.token_type_embeddings,
        )
    )
    assert flops.dense_flops_per_token == 4 * n + 2 * head < 6 * n
    assert flops.training_flops(3 * 20, 3 * 20**2) == (4 * n + 2 * head) * 60 + 12 * 2 * 32 * 3 * 20**2


def test_zero3_partitioned_parameters_count_fully():
    model = tiny_bert_classifier()
    expected, _ = matmul_parameters(model)
    for p in model.parameters():  # what ZeRO-3 leaves: an empty local shard, the full size in ds_numel
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert matmul_parameters(model) == (expected, expected)


def test_no_layer_count_leaves_attention_out():
    assert attention_dims(None) is None
    assert attention_dims(object()) is None
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    flops = ModelFlops.from_model(model)
    assert flops.matmul_params == 4 * 3 + 3
    assert not flops.attention and flops.attention_flops(100) == 0.0
    assert flops.training_flops(5, 25) == 6 * 15 * 5


def test_sum_squared_lengths_of_a_padded_batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])  # right and left padding
    assert sum_squared_lengths(mask).item() == 9 + 16 + 4


@pytest.mark.parametrize("trainer_name", ["BasicTrainer", "AcceleratedTrainer"])
def test_logged_mfu_uses_the_matmul_and_attention_flops(trainer_name, tiny_model_dir, tmp_path, monkeypatch):
    """train/mfu (logged where the device's peak is known: a peak is given to the CPU here) is the interval's
    matmul + attention FLOPs over time and peak, not 6 x all parameters x tokens."""
    from test_training import tiny_setup

    import cloudtrain.training as training
    from cloudtrain.observe.tracking import read_metrics
    from cloudtrain.training import hooks

    peak = 1e12
    monkeypatch.setattr(hooks, "peak_flops", lambda device, precision: peak)
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        getattr(training, trainer_name),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=4,
        eval_strategy="no",
    )
    trainer.fit()
    (event,) = [e for e in read_metrics(tmp_path / "metrics.jsonl") if "train/mfu" in e]
    flops_per_token = event["train/mfu"] * peak / event["train/tokens_per_s"]
    flops = ModelFlops.from_model(trainer.model)
    lengths = [len(ids) for ids in trainer.data.train["input_ids"]]
    assert flops.flops_per_token(min(lengths)) <= flops_per_token * (1 + 1e-6)
    assert flops_per_token <= flops.flops_per_token(max(lengths)) * (1 + 1e-6)
    assert flops_per_token < 0.6 * 6 * total_parameters(trainer.model)  # the tiny model is mostly embeddings


@pytest.mark.slow  # trains
def test_an_evaluation_s_seconds_are_not_in_the_next_interval_s_rates(tiny_model_dir, tmp_path, monkeypatch):
    """The samples/s, tokens/s and MFU of the interval after an evaluation (or a save) divided by its seconds too:
    6.2 samples/s logged beside 298 ms/step of 24 rows (found in audit)."""
    import time

    from test_training import tiny_setup

    import cloudtrain.training as training
    from cloudtrain.observe.tracking import read_metrics
    from cloudtrain.training import hooks

    evaluate = hooks.EvaluationHook.on_step_end

    def slow_evaluation(self, loop):
        if self.due(loop):
            time.sleep(3.0)
        return evaluate(self, loop)

    monkeypatch.setattr(hooks.EvaluationHook, "on_step_end", slow_evaluation)
    trainer = tiny_setup(
        tiny_model_dir, tmp_path, training.BasicTrainer, max_steps=4, per_device_train_batch_size=4,
        logging_steps=2, eval_strategy="steps", eval_steps=2,
    )  # fmt: skip
    trainer.fit()
    rates = {e["step"]: e["train/samples_per_s"] for e in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in e}
    assert sorted(rates) == [2, 4]
    assert 8 / rates[4] < 3.0  # the interval's 8 rows took its two steps' time, not the evaluation's 3 s


# ---------------------------------------------------------------- attention per document
def test_packed_rows_count_attention_per_document_not_per_row():
    """bfd rows of several documents, one row padded: the count is the sum of each document's len^2, by hand."""
    docs = [list(range(1, n + 1)) for n in (5, 3, 9, 2, 7, 4)]
    rows = pack(docs, 12, "bfd")
    batch = CausalLMCollator(pad_token_id=0)(rows)
    by_hand = sum(n * n for n in (5, 3, 9, 2, 7, 4))
    assert attention_squared_lengths(batch).item() == by_hand
    real = batch["attention_mask"].sum(dim=1)
    assert sum_squared_lengths(batch["attention_mask"]).item() == sum(int(n) ** 2 for n in real) > by_hand
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # a padded row is in the batch


def test_a_batch_without_position_ids_counts_its_rows():
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert attention_squared_lengths({"attention_mask": mask, "input_ids": mask}).item() == 9 + 9
    wrapped = CausalLMCollator(pad_token_id=0)([{"input_ids": [1] * 6, "seq_lengths": [6]}])  # one segment
    assert attention_squared_lengths(wrapped).item() == 36


def test_training_flops_of_packed_rows_use_document_lengths():
    model = tiny_llama()
    flops = ModelFlops.from_model(model)
    rows = [{"input_ids": list(range(1, 11)), "seq_lengths": [4, 6]}]
    batch = CausalLMCollator(pad_token_id=0)(rows)
    counted = flops.training_flops(10, attention_squared_lengths(batch).item())
    assert counted == 6 * flops.matmul_params * 10 + 12 * 2 * 64 * (16 + 36)
    assert counted < flops.training_flops(10, 100)  # the row-length count overstates it


def test_the_meter_counts_attention_per_document_of_packed_rows():
    """train/mfu's attention term: the interval's squared lengths are the documents' (Meter.add), not the rows'."""
    from cloudtrain.checkpointing import TrainerState
    from cloudtrain.parallel.runtime import Runtime
    from cloudtrain.training.meter import Meter, StepStats

    collate = CausalLMCollator(pad_token_id=0)
    window = [
        collate([{"input_ids": list(range(1, 11)), "seq_lengths": [4, 6]}, {"input_ids": [5] * 7, "seq_lengths": [7]}]),
        collate([{"input_ids": [3] * 9, "seq_lengths": [2, 3, 4]}]),
    ]
    meter = Meter(Runtime(), TrainerState(), torch.device("cpu"))
    stats = StepStats(torch.tensor(1.0), torch.tensor(3.0), None)
    meter.add(window, stats, torch.tensor(True))
    interval = meter.flush()
    assert interval["tokens"] == 10 + 7 + 9
    assert interval["squared_lengths"] == 16 + 36 + 49 + 4 + 9 + 16


# ---------------------------------------------------------------- the device's peak
GIB = 2**30


@pytest.mark.parametrize(
    "name, memory_gib, sms, key, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 79.6, 132, "H100 SXM", 989e12),
        ("NVIDIA H100 PCIe", 79.6, 114, "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 93.6, 132, "H100 NVL", 835e12),
        ("NVIDIA H100", 79.6, 114, "H100 PCIe", 756e12),  # a name that says nothing: the SM count does
        ("NVIDIA H100", 93.6, 132, "H100 NVL", 835e12),
        ("NVIDIA H100", 79.6, 132, "H100 SXM", 989e12),
        ("NVIDIA H800", 79.6, 132, "H100 SXM", 989e12),
        ("NVIDIA H200", 139.8, 132, "H200 SXM", 989e12),
        ("NVIDIA H200 NVL", 139.8, 132, "H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 94.5, 132, "GH200", 989e12),
        ("NVIDIA B200", 178.4, 148, "B200", 2250e12),
        ("NVIDIA A100-SXM4-40GB", 39.4, 108, "A100", 312e12),
        ("NVIDIA A100-SXM4-80GB", 79.2, 108, "A100", 312e12),
        ("NVIDIA A100 80GB PCIe", 79.2, 108, "A100", 312e12),
        ("NVIDIA A10G", 22.0, 80, "A10G", 70e12),
        ("NVIDIA A10", 22.0, 72, "A10", 125e12),
        ("NVIDIA L40S", 44.4, 142, "L40S", 362e12),
        ("NVIDIA L4", 22.0, 58, "L4", 121e12),
        ("AMD Instinct MI300X", 191.5, 304, "MI300X", 1307e12),
        ("Tesla T4", 14.6, 40, "T4", None),  # no native bf16
    ],
)
def test_each_listed_device_is_identified_with_its_own_peak(name, memory_gib, sms, key, bf16):
    info = DeviceInfo(name, int(memory_gib * GIB), sms)
    assert identify(info) == key
    assert device_peak(info, "bf16") == bf16 == DEVICES[key].bf16
    assert device_peak(info, "fp16") == DEVICES[key].fp16 > 0
    assert device_peak(info, "fp32") == DEVICES[key].fp32 < DEVICES[key].fp16


def test_the_three_h100s_have_different_peaks_in_every_precision():
    for precision in ("bf16", "tf32", "fp32"):
        peaks = {getattr(DEVICES[k], precision) for k in ("H100 SXM", "H100 PCIe", "H100 NVL")}
        assert len(peaks) == 3


@pytest.mark.parametrize(
    "name, memory_gib, sms",
    [
        ("NVIDIA GeForce RTX 4090", 23.6, 128),
        ("NVIDIA H100", 79.6, 100),  # an H100 whose variant cannot be told: no guess
        ("", 0, 0),
        ("NVIDIA L40", 44.4, 142),  # not L40S, not L4
        ("NVIDIA A100X", 79.2, 108),
    ],
)
def test_an_unknown_device_gets_no_peak(name, memory_gib, sms):
    info = DeviceInfo(name, int(memory_gib * GIB), sms)
    assert identify(info) is None
    assert all(device_peak(info, p) is None for p in ("bf16", "fp16", "tf32", "fp32"))


def test_a_mig_slice_gets_its_share_of_the_chip():
    info = DeviceInfo("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * GIB, 60)
    assert identify(info) == "H100 SXM"
    assert device_peak(info, "bf16") == pytest.approx(989e12 * 60 / 132)


def test_an_mi300x_compute_partition_gets_its_share_of_the_chip():
    """In CPX mode each of the 8 partitions is a device of 38 CUs under the chip's name (found in audit: the whole
    chip's peak, an MFU 8x too low)."""
    assert device_peak(DeviceInfo("AMD Instinct MI300X", 24 * GIB, 38), "bf16") == pytest.approx(1307e12 / 8)
    assert device_peak(DeviceInfo("AMD Instinct MI300X", 192 * GIB, 304), "bf16") == 1307e12


def test_mi300x_on_a_rocm_that_gives_no_name():
    assert identify(DeviceInfo("", 192 * GIB, 304, "gfx942:sramecc+:xnack-")) == "MI300X"
    assert identify(DeviceInfo("", 128 * GIB, 228, "gfx942")) is None  # an MI300A: not listed


def test_fp32_runs_use_the_tf32_peak_only_where_torch_allows_tf32():
    assert matmul_precision("bf16") == "bf16" and matmul_precision("fp16") == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("no") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("no") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_precision_is_read_after_tf32_set_it_per_backend():
    """--tf32 sets torch's per-backend setting, after which torch >= 2.9 refuses the legacy getter: every CUDA run
    with --tf32 true and fp32 crashed as its logging hook asked (found in audit)."""
    matmul, conv = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # what use_tf32 sets (allowed without a GPU)
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        assert matmul_precision("no") == "tf32" and matmul_precision("bf16") == "bf16"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert matmul_precision("no") == "fp32"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = matmul, conv
    assert matmul_precision("no") in ("fp32", "tf32")  # the legacy getter answers again


class FakeProperties:
    def __init__(self, name: str, memory: int, sms: int):
        self.name, self.total_memory, self.multi_processor_count = name, memory, sms


@pytest.mark.parametrize("name, sms, peak", [("NVIDIA H100 PCIe", 114, 756e12), ("NVIDIA GeForce RTX 4090", 128, None)])
def test_peak_flops_reads_the_device_properties_and_says_once_why_there_is_none(name, sms, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: FakeProperties(name, 80 * GIB, sms))
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bf16") == peak
    reason = no_peak_reason(cuda, "bf16")
    assert (reason is None) == (peak is not None)
    if reason:
        assert reason.startswith("no MFU logged") and name in reason and "\n" not in reason
    assert peak_flops(torch.device("cpu")) is None and no_peak_reason(torch.device("cpu"), "bf16") is None


def test_a_known_device_without_the_precision_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: FakeProperties("Tesla T4", GIB, 40))
    assert "T4 has no native bf16 peak" in no_peak_reason(torch.device("cuda", 0), "bf16")
    assert no_peak_reason(torch.device("cuda", 0), "fp16") is None


def test_a_resumes_pending_sums_are_rated_over_the_seconds_they_took():
    """A checkpoint between logging steps keeps the sums not yet logged, and now their seconds: the first rates of
    a resume (samples/s, tokens/s, MFU, DPO's pairs/s) were those sums over this launch's seconds alone (found in
    audit: 26.8 samples/s against 5.3 in the run that never stopped)."""
    import time

    from cloudtrain.checkpointing import TrainerState
    from cloudtrain.parallel.runtime import Runtime
    from cloudtrain.training.meter import Meter

    state = TrainerState(interval=[8.0, 80.0, 4.0, 0.0, 8.0], interval_s=4.0)
    meter = Meter(Runtime(), state, torch.device("cpu"))
    assert 4.0 <= meter.since_logged() < 5.0
    time.sleep(0.05)
    interval = meter.flush()
    assert 4.05 <= interval["seconds"] < 5.0 and interval["samples_per_s"] == pytest.approx(8 / interval["seconds"])
    assert meter.since_logged() < 1.0  # the next interval is this launch's own


@pytest.mark.parametrize("task", ["causal_lm", "seq2seq", "text_to_image"])
def test_tasks_whose_work_the_token_formula_misses_log_no_mfu_and_say_why(task, monkeypatch):
    """Found in audit: text-to-image's MFU counted caption tokens (the same at any resolution) and seq2seq's charged
    the whole encoder-decoder to each source token (2.6x a t5-small summariser's true count)."""

    from cloudtrain.config import resolve_options
    from cloudtrain.tasks import build_task
    from cloudtrain.training.hooks import LoggingHook

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: FakeProperties("NVIDIA H100 PCIe", 80 * GIB, 114)
    )
    cfg = resolve_options(None, {"task": task, "mixed_precision": "bf16"})
    hook = LoggingHook(SimpleNamespace(cfg=cfg, task=build_task(cfg)), torch.device("cuda", 0))
    if task == "causal_lm":
        assert (hook.peak, hook.no_mfu) == (756e12, None)
    else:
        assert hook.peak is None and hook.no_mfu.startswith(f"no MFU logged for --task {task}: ")
    assert LoggingHook(SimpleNamespace(cfg=cfg, task=build_task(cfg)), torch.device("cpu")).no_mfu is None


def test_a_4_bit_weight_counts_its_full_size():
    """bitsandbytes packs a QLoRA weight two to a byte (four to a bf16 element under FSDP2): its numel was counted,
    so the MFU and the parameter count of a QLoRA run were 2-4x too low (found in audit)."""
    from cloudtrain.training.weights import count_parameters

    packed = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = SimpleNamespace(shape=torch.Size([4, 4]))  # as bitsandbytes' Params4bit keeps it
    model = torch.nn.Module()
    model.linear = torch.nn.Linear(4, 4, bias=False)
    model.linear.weight = packed
    assert full_numel(packed) == 16 and count_parameters(model) == 16
    assert matmul_parameters(model) == (16, 0)
