"""The varlen attention (cloudtrain.models.attention): packed documents stay apart without a dense mask, the
loss and gradients equal the sdpa + position_ids path, the isolation probe refuses a kernel that leaks, and the
default for --packing bfd. CPU runs the per-document reference; the gpu tests the CUDA kernels."""

import copy

import pytest
import torch
from conftest import lm_documents, topic_run_args
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import import_utils

from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.data.packing import CausalLMCollator, causal_lm_forward, isolation_error, pack, shifted_loss
from cloudtrain.errors import UserError
from cloudtrain.models import attention as varlen
from cloudtrain.models.attention import VARLEN, kernel_name
from cloudtrain.models.prepare import attention
from cloudtrain.registry import TASKS
from cloudtrain.tasks.causal_lm import one_layer_copy

MODELS = ("tiny_llama_dir", "tiny_gpt2_dir")


def leaky_attention(module, query, key, value, attention_mask, **kwargs):
    """A kernel that ignores the documents (plain causal attention over the row), as FlashAttention did
    for batches of several packed rows: the probe must refuse it."""
    return sdpa_attention_forward(module, query, key, value, None, scaling=kwargs.get("scaling"), is_causal=True)


AttentionInterface.register("leaky_causal", leaky_attention)


@pytest.fixture(scope="module")
def token_docs(lm_tokenizer_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(lm_documents(16, seed=2))["input_ids"]]


def packed(token_docs, cu_seqlens: bool) -> tuple[dict, list[dict]]:
    rows = pack(token_docs, 128, "bfd")
    assert any(len(r["seq_lengths"]) > 2 for r in rows) and len({len(r["input_ids"]) for r in rows}) > 1
    return CausalLMCollator(pad_token_id=0, cu_seqlens=cu_seqlens)(rows), rows


def pair(model_dir: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: with sdpa (today's path) and with varlen; train mode, where caches leak."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").train()
    model = copy.deepcopy(reference)
    model.set_attn_implementation(VARLEN)
    return reference, model.train()


# ---------------------------------------------------------------- the batch
def test_collator_gives_the_cumulative_lengths_of_every_document_and_padding():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    batch = CausalLMCollator(0, cu_seqlens=True)(rows)
    # row 0: documents of 2 and 3; row 1: a document of 2, then 3 of padding (its own sequence)
    assert batch["cu_seqlens"].tolist() == [0, 2, 5, 7, 10]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"].shape == (0, 3)  # carried in the shape: no read of device memory
    assert "cu_seqlens" not in CausalLMCollator(0)(rows)


# ---------------------------------------------------------------- isolation and parity on CPU
@pytest.mark.parametrize("model_dir", MODELS)
def test_varlen_keeps_packed_documents_apart(model_dir, token_docs, request):
    _, model = pair(request.getfixturevalue(model_dir))
    batch, rows = packed(token_docs, cu_seqlens=True)
    assert kernel_name(torch.device("cpu"), torch.float32) == "per_document_sdpa"
    with torch.no_grad():
        logits = causal_lm_forward(model, batch)
        for b, row in enumerate(rows):
            start = 0
            for length in row["seq_lengths"]:
                doc = row["input_ids"][start : start + length]
                alone = CausalLMCollator(0, cu_seqlens=True)([{"input_ids": doc, "seq_lengths": [length]}])
                difference = (logits[b, start : start + length] - causal_lm_forward(model, alone)[0]).abs().max()
                assert difference < 1e-5
                start += length
    assert isolation_error(model) is None


@pytest.mark.parametrize("model_dir", MODELS)
def test_loss_and_gradients_equal_the_sdpa_position_ids_path(model_dir, token_docs, request):
    reference, model = pair(request.getfixturevalue(model_dir))
    sums = {}
    for name, net, with_lengths in (("sdpa", reference, False), ("varlen", model, True)):
        batch, _ = packed(token_docs, cu_seqlens=with_lengths)
        total, count = shifted_loss(causal_lm_forward(net, batch), batch["labels"])
        (total / count).backward()
        sums[name] = total.item(), count.item()
    assert sums["varlen"][1] == sums["sdpa"][1]
    assert sums["varlen"][0] == pytest.approx(sums["sdpa"][0], rel=1e-5)
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(got.grad, expected.grad, atol=1e-6, rtol=1e-4), name


def test_without_lengths_varlen_masks_from_position_ids_and_padding(tiny_llama_dir, token_docs):
    """A caller that gives only position_ids (a pipeline stage), and generation from left-padded prompts with
    a cache, get what sdpa gives."""
    reference, model = pair(tiny_llama_dir)
    batch, _ = packed(token_docs, cu_seqlens=False)
    with torch.no_grad():
        assert (causal_lm_forward(model, batch) - causal_lm_forward(reference, batch)).abs().max() < 1e-5
    prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    generated = [
        m.eval().generate(input_ids=prompts, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for m in (reference, model)
    ]
    assert torch.equal(*generated)


# ---------------------------------------------------------------- the probe refuses what leaks
@pytest.mark.parametrize("implementation", ["sdpa", "eager", VARLEN, "leaky_causal"])
def test_isolation_probe_runs_each_kernel_and_refuses_a_leaking_one(tiny_llama_dir, implementation):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation=implementation)
    problem = isolation_error(model)
    if implementation == "leaky_causal":
        assert problem and "lets packed documents attend to each other" in problem
    else:
        assert problem is None


def lm_config(model_dir: str, **options):
    return build_config({"task": "causal_lm", "model_name_or_path": model_dir, "train_file": "x.txt", **options})


def test_check_model_refuses_a_leaking_kernel_in_one_line(tiny_llama_dir):
    cfg = lm_config(tiny_llama_dir, packing="bfd", attn_implementation="leaky_causal")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="leaky_causal")
    with pytest.raises(UserError, match="--packing bfd: .*leaky_causal.* attend to each other") as err:
        TASKS["causal_lm"](cfg).check_model(model, cfg, announce=False)
    assert "\n" not in str(err.value)
    # the way out is cloudtrain's varlen kernels (sdpa and eager were offered too: they leak for OPT; audit)
    assert str(err.value).endswith("; use --packing wrapped or none, or --attn_implementation varlen")


def refuses_flash_attention_without_the_package(model_dir: str) -> None:
    cfg = lm_config(model_dir, packing="bfd", attn_implementation="flash_attention_2")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(UserError, match="^--attn_implementation flash_attention_2: ") as err:
        attention(model, cfg, TASKS["causal_lm"](cfg), False)
    assert "\n" not in str(err.value) and "installed" in str(err.value)
    assert str(err.value).endswith("install its package, or leave the option out for the default kernel")


def test_flash_attention_without_flash_attn_is_refused_in_one_line(tiny_llama_dir):
    if varlen._flash_attn():
        pytest.skip("flash-attn is installed here: the gpu probe runs it")
    refuses_flash_attention_without_the_package(tiny_llama_dir)


def test_a_kernel_that_needs_a_gpu_is_refused_on_a_cpu(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = lm_config(tiny_llama_dir, packing="bfd")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.config._attn_implementation = "flash_attention_2"  # as if flash-attn had loaded
    with pytest.raises(UserError, match="flash_attention_2 needs a GPU"):
        TASKS["causal_lm"](cfg).check_model(model, cfg, announce=False)


# ---------------------------------------------------------------- the default and its refusals
DEFAULTS = [
    ("causal_lm", "bfd", 512, VARLEN),
    ("sft", "bfd", 1024, VARLEN),
    ("causal_lm", "bfd", 256, "sdpa"),  # short rows: the dense mask is cheaper than a call per document
    ("causal_lm", "wrapped", 1024, "sdpa"),
]


@pytest.mark.parametrize(("task", "packing", "max_length", "expected"), DEFAULTS)
def test_varlen_is_the_default_for_packed_rows_on_cpu(tiny_llama_dir, monkeypatch, task, packing, max_length, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = lm_config(tiny_llama_dir, packing=packing, max_length=max_length)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert attention(model, cfg, TASKS[task](cfg), False).config._attn_implementation == expected


def test_varlen_is_refused_where_it_cannot_compute_the_attention(tiny_llama_dir):
    cfg = lm_config(tiny_llama_dir, packing="bfd", attn_implementation=VARLEN)
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.attn_logit_softcapping = 30.0  # as Gemma 2 has: varlen computes plain softmax attention
    with pytest.raises(UserError, match="varlen: LlamaForCausalLM caps its attention logits; use sdpa"):
        attention(LlamaForCausalLM(config), cfg, TASKS["causal_lm"](cfg), False)
    classification = build_config({"task": "classification", "attn_implementation": VARLEN})
    with pytest.raises(UserError, match="is for decoders on packed rows"):
        attention(LlamaForCausalLM(config), classification, TASKS["classification"](classification), False)


def test_under_autocast_the_kernel_is_chosen_in_autocasts_dtype(tiny_llama_dir, token_docs, monkeypatch):
    """fp32 weights under bf16 autocast: Llama's rotary embedding hands over fp32 queries and keys (cos/sin follow
    the fp32 residual stream). The kernel is chosen in autocast's dtype, as sdpa would cast; chosen by the queries'
    fp32 it was the dense-mask fallback on CUDA (seen on an H100: 0.75x a plain loop)."""
    _, model = pair(tiny_llama_dir)
    chosen = []
    choose = varlen.kernel_name
    monkeypatch.setattr(
        varlen, "kernel_name", lambda device, dtype, dropout=0.0: chosen.append(dtype) or choose(device, dtype, dropout)
    )
    batch, _ = packed(token_docs, cu_seqlens=True)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            causal_lm_forward(model, batch)
        assert chosen == [torch.bfloat16] * layers
        chosen.clear()
        causal_lm_forward(model, batch)
    assert chosen == [torch.float32] * layers  # no autocast: the tensors' own


# ---------------------------------------------------------------- the CUDA kernels
@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS)
def test_cuda_varlen_kernel_under_autocast_over_fp32_weights(model_dir, token_docs, request, monkeypatch):
    """As the trainers run: fp32 weights, bf16 autocast. The 16-bit kernel runs (not the dense-mask fallback) and
    the loss and gradients equal sdpa's under the same autocast."""
    reference, model = (m.to("cuda") for m in pair(request.getfixturevalue(model_dir)))
    chosen = []
    name = varlen.kernel_name
    monkeypatch.setattr(varlen, "kernel_name", lambda *a, **k: chosen.append(name(*a, **k)) or chosen[-1])
    batch, _ = packed(token_docs, cu_seqlens=True)
    batch = {k: v.cuda() for k, v in batch.items()}
    losses = []
    for net in (reference, model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, count = shifted_loss(causal_lm_forward(net, batch), batch["labels"])
        (total / count).backward()
        losses.append((total / count).item())
    assert chosen and set(chosen) <= {"flash_attn", "torch_varlen"}
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (pname, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        scale = expected.grad.abs().max().item() + 1e-6
        assert (got.grad - expected.grad).abs().max().item() <= 0.05 * scale, pname


@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS)
def test_cuda_varlen_kernel_matches_sdpa_and_keeps_documents_apart(model_dir, token_docs, request):
    if not varlen.varlen_kernel_available():
        pytest.fail("no variable-length kernel on this GPU: neither flash-attn nor torch.nn.attention.varlen")
    reference, model = (m.to("cuda", torch.bfloat16) for m in pair(request.getfixturevalue(model_dir)))
    assert kernel_name(torch.device("cuda"), torch.bfloat16) in ("flash_attn", "torch_varlen")
    batch, _ = packed(token_docs, cu_seqlens=True)
    batch = {k: v.cuda() for k, v in batch.items()}
    losses = []
    for net in (reference, model):
        total, count = shifted_loss(causal_lm_forward(net, batch), batch["labels"])
        (total / count).backward()
        losses.append((total / count).item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        scale = expected.grad.abs().max().item() + 1e-6
        assert (got.grad - expected.grad).abs().max().item() <= 0.05 * scale, name
    assert isolation_error(model.eval()) is None


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["sdpa", VARLEN, "flash_attention_2"])
def test_gpu_probe_of_a_one_layer_copy(tiny_llama_dir, implementation):
    if implementation == "flash_attention_2" and not varlen._flash_attn():
        # where flash-attn is not installed (the lent H100), asking for it is refused in one line before any work
        refuses_flash_attention_without_the_package(tiny_llama_dir)
        return
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation=implementation)
    small = one_layer_copy(model, "cuda", torch.bfloat16)
    assert small.config.num_hidden_layers == 1 and small.config._attn_implementation == implementation
    assert isolation_error(small) is None


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale) -> torch.Tensor:
    """Flattened [T, H, D] through the CPU reference (one row: the layout varlen kernels take)."""
    out = varlen._per_document(*(x.transpose(0, 1)[None] for x in (q, k, v)), cu, scale, 0.0)
    return out[0]


def test_torch_varlen_call_adapts_to_the_older_signature(monkeypatch):
    """torch 2.9-2.10 spell causality `is_causal` and take no scale and no GQA flag (the GPU machine has 2.11):
    the call still computes causal attention per document with the model's scale and grouped heads."""
    calls = []

    def older_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        calls.append(is_causal)
        assert key.shape[1] == query.shape[1] and is_causal and max_q == max_k == 6
        return reference(query, key, value, cu_seq_q, None)

    monkeypatch.setattr(varlen, "_torch_varlen", lambda: (older_varlen_attn, frozenset({"is_causal"})))
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    got = varlen._torch_varlen_call(q, k, v, cu, 6, 0.2)
    assert calls == [True]
    assert torch.allclose(got, reference(q, k, v, cu, 0.2), atol=1e-6)


def test_an_unknown_kernel_is_refused_in_one_line_before_the_data_is_read(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """transformers refuses it only inside the model's loading, after the data, in a message a screen long."""
    out = tmp_path / "out"
    assert main([*topic_run_args(tiny_model_dir, topic_csvs, out), "--attn_implementation", "flash"]) == 2
    said = capsys.readouterr()
    assert said.err.strip().startswith(
        "error: --attn_implementation flash is not an attention kernel transformers knows: use one of varlen, eager,"
    )
    assert said.err.strip().endswith("or a Hub kernel (<org>/<repo>), or leave it out for the default")
    assert "\n" not in said.err.strip() and "data:" not in said.out and said.err.count("varlen") == 1
    assert "paged" not in said.err  # continuous batching's kernels are no choice for training
    # paged|eager passed, then crashed at the first step in an 88-line traceback (found in audit)
    assert main([*topic_run_args(tiny_model_dir, topic_csvs, out), "--attn_implementation", "paged|eager"]) == 2
    said = capsys.readouterr()
    assert said.err.strip() == (
        "error: --attn_implementation paged|eager attends over a paged cache for serving (continuous batching), not "
        "in training; use eager or leave it out for the default"
    )
    if not import_utils.is_kernels_available():
        assert main([*topic_run_args(tiny_model_dir, topic_csvs, out), "--attn_implementation", "org/attn"]) == 2
        said = capsys.readouterr()
        assert said.err.startswith(
            "error: --attn_implementation org/attn is a Hub kernel: it needs pip install 'kernels>="
        )
        assert "data:" not in said.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_flex_attention_without_cuda_and_checkpointing_a_model_that_cannot_are_one_line(tiny_llama_dir):
    """FlexAttention has no backward on CPU: the run loaded data and model and then failed in a 35-frame traceback
    (with bfd, blamed on a C++ compiler); ALBERT/MPNet under --gradient_checkpointing a 12-frame ValueError (found in
    audit)."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    from cloudtrain.models.prepare import check_attention_name, gradient_checkpointing

    with pytest.raises(UserError, match=r"^--attn_implementation flex_attention trains on a CUDA GPU only .* sdpa"):
        check_attention_name(lm_config(tiny_llama_dir, attn_implementation="flex_attention"))
    albert = AlbertForSequenceClassification(
        AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32)
    )
    cfg = build_config({"gradient_checkpointing": True})
    with pytest.raises(UserError, match="^--gradient_checkpointing true: AlbertForSequenceClassification does not"):
        gradient_checkpointing(albert, cfg, TASKS["classification"](cfg), False)
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert gradient_checkpointing(llama, cfg, TASKS["causal_lm"](cfg), False).is_gradient_checkpointing
