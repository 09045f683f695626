"""--fused_cross_entropy (cloudtrain.models.kernels): the loss and gradients from the hidden states equal the plain
logits path, for the kernel alone and for the causal-LM and SFT tasks' loss; the option's choice and refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from cloudtrain.config import build_config
from cloudtrain.data.packing import CausalLMCollator, pack
from cloudtrain.errors import UserError
from cloudtrain.models import kernels, prepare
from cloudtrain.models.kernels import chunked_linear_cross_entropy, hidden_states_error, linear_cross_entropy
from cloudtrain.models.prepare import fused_cross_entropy
from cloudtrain.registry import TASKS

MODELS = ("tiny_llama_dir", "tiny_gpt2_dir")


def plain(hidden, weight, bias, targets, smoothing=0.0):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum", label_smoothing=smoothing)


def gradients(loss_fn, *inputs) -> tuple[float, list[torch.Tensor]]:
    leaves = [None if x is None else x.detach().clone().requires_grad_(x.requires_grad) for x in inputs[:-1]]
    loss = loss_fn(*leaves, inputs[-1])
    (loss * 0.5).backward()  # a scale, as the step's 1 / token count
    return loss.item(), [x.grad for x in leaves if x is not None and x.requires_grad]


@pytest.mark.parametrize("smoothing", [0.0, 0.2])  # --label_smoothing
@pytest.mark.parametrize("chunk_rows", [1, 7, 50, 4096])
def test_chunked_loss_and_gradients_equal_the_plain_ones(chunk_rows, smoothing):
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(50, 16), torch.randn(37, 16), torch.randn(37)
    targets = torch.randint(0, 37, (50,))
    targets[::4] = -100  # prompt tokens and document starts have no target
    inputs = (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), targets)
    expected, expected_grads = gradients(lambda *a: plain(*a, smoothing=smoothing), *inputs)
    chunked = lambda *a: chunked_linear_cross_entropy(*a, chunk_rows=chunk_rows, smoothing=smoothing)  # noqa: E731
    got, got_grads = gradients(chunked, *inputs)
    assert got == pytest.approx(expected, rel=1e-6)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert torch.allclose(g, e, atol=1e-5)


def test_chunked_under_bf16_autocast_follows_the_autocast_plain_path():
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 32), torch.randn(50, 32)
    targets = torch.randint(0, 50, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = gradients(plain, hidden, weight.requires_grad_(), None, targets)
        got, got_grads = gradients(chunked_linear_cross_entropy, hidden, weight, None, targets)
    assert got == pytest.approx(expected, rel=1e-2)
    assert got_grads[0].dtype == torch.float32  # the fp32 master weight gets an fp32 gradient
    assert (got_grads[0] - expected_grads[0]).abs().max() <= 0.02 * expected_grads[0].abs().max()


# ---------------------------------------------------------------- the task's loss
def task_for(name: str, model_dir: str, **options):
    cfg = build_config({"task": name, "model_name_or_path": model_dir, "train_file": "x.txt", **options})
    return TASKS[name](cfg), cfg


def batch_of(vocab: int, cu_seqlens: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in (9, 30, 4, 17, 22, 11, 5)]
    return CausalLMCollator(0, cu_seqlens=cu_seqlens)(pack(docs, 40, "bfd"))


@pytest.mark.parametrize("model_dir", MODELS)
@pytest.mark.parametrize(
    ("task_name", "smoothing"), [("causal_lm", 0.0), ("sft", 0.0), ("causal_lm", 0.1), ("sft", 0.1)]
)
def test_task_loss_from_hidden_states_equals_the_logits_loss(model_dir, task_name, smoothing, request):
    reference = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_dir)).train()
    model = copy.deepcopy(reference)
    task, _ = task_for(task_name, request.getfixturevalue(model_dir), label_smoothing=smoothing)
    batch = batch_of(reference.config.vocab_size, cu_seqlens=True)
    assert task.use_loss_kernel(None)
    expected, expected_count = task.loss(reference, batch)
    (expected / expected_count).backward()
    task.use_loss_kernel("chunked")
    got, count = task.loss(model, batch)
    (got / count).backward()
    assert count.item() == expected_count.item()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, e), g in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(g.grad, e.grad, atol=1e-6, rtol=1e-4), name


def test_dpo_keeps_its_own_loss(tiny_llama_dir):
    task, _ = task_for("dpo", tiny_llama_dir)
    assert task.use_loss_kernel("chunked") is False and task.loss_kernel is None


# ---------------------------------------------------------------- the option
@pytest.mark.parametrize(("choice", "expected"), [("true", "chunked"), ("auto", None), ("false", None)])
def test_the_option_on_cpu(tiny_llama_dir, monkeypatch, choice, expected):
    monkeypatch.setattr(prepare, "liger_available", lambda: False)
    task, cfg = task_for("causal_lm", tiny_llama_dir, fused_cross_entropy=choice)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert fused_cross_entropy(model, cfg, task, False) is model
    assert task.loss_kernel == expected


class ScaledLogits(LlamaForCausalLM):
    """Logits that are more than the head over the hidden states (as a logit scale or soft-cap makes them)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_refusals_are_one_line(tiny_llama_dir):
    task, cfg = task_for("classification", tiny_llama_dir, fused_cross_entropy="true")
    with pytest.raises(UserError, match="--task classification has no language-model loss"):
        fused_cross_entropy(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg, task, False)
    task, cfg = task_for("causal_lm", tiny_llama_dir, fused_cross_entropy="true")
    scaled = ScaledLogits.from_pretrained(tiny_llama_dir)
    assert "more than its head" in hidden_states_error(scaled)
    with pytest.raises(UserError, match="--fused_cross_entropy true: ScaledLogits's logits are more than"):
        fused_cross_entropy(scaled, cfg, task, False)
    assert hidden_states_error(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)) is None
    task, cfg = task_for("causal_lm", tiny_llama_dir, fused_cross_entropy="true", fsdp=True)
    with pytest.raises(UserError, match="sharded"):
        fused_cross_entropy(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg, task, False)


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("smoothing", [0.0, 0.1])  # --label_smoothing
@pytest.mark.parametrize("backend", ["chunked", "liger"])
def test_fused_loss_on_cuda_in_bf16(backend, smoothing):
    if backend == "liger" and not kernels.liger_available():
        pytest.skip("liger-kernel is not installed here")
    torch.manual_seed(0)
    hidden, weight = torch.randn(3000, 256, device="cuda"), torch.randn(32000, 256, device="cuda") * 0.05
    targets = torch.randint(0, 32000, (3000,), device="cuda")
    targets[::3] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16):
        leaves = (hidden.requires_grad_(), weight.requires_grad_(), None, targets)
        expected, expected_grads = gradients(lambda *a: plain(*a, smoothing=smoothing), *leaves)
        got, got_grads = gradients(lambda *a: linear_cross_entropy(backend, *a, smoothing), *leaves)
    assert got == pytest.approx(expected, rel=1e-2)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert (g.float() - e.float()).abs().max() <= 0.03 * e.float().abs().max()


# ---------------------------------------------------------------- fused decoder modules and compiled layers
def test_liger_modules_are_refused_in_one_line_where_they_cannot_run(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    task, cfg = task_for("causal_lm", tiny_llama_dir, liger_kernels="true")
    message = "--liger_kernels true: Liger Kernel's triton kernels need a CUDA GPU; use false"
    with pytest.raises(UserError, match=message):
        prepare.liger_modules(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg, task, False)
    for choice in ("auto", "false"):  # auto (the default) is off, silently, where Liger cannot run
        task, cfg = task_for("causal_lm", tiny_llama_dir, liger_kernels=choice)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        forwards = [m.forward for m in model.modules()]
        assert prepare.liger_modules(model, cfg, task, False) is model
        assert [m.forward for m in model.modules()] == forwards


def test_a_model_without_a_transformers_config_keeps_its_modules_under_auto(monkeypatch):
    """Where Liger could run (CUDA and the package, faked here), a module of one's own or a diffusion model: auto
    leaves it as it is, true refuses in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_liger", lambda: len)
    module = torch.nn.Linear(2, 2)
    assert kernels.liger_modules_error(module).startswith("Linear is not a transformers model with a model type")
    cfg = build_config({"task": "causal_lm"})
    assert prepare.liger_modules(module, cfg, None, False) is module
    with pytest.raises(UserError, match="--liger_kernels true: Linear is not a transformers model"):
        prepare.liger_modules(module, build_config({"task": "causal_lm", "liger_kernels": "true"}), None, False)


@pytest.mark.parametrize(
    "options, reason",
    [
        ({}, None),
        ({"fsdp": True, "zero_stage": 0}, None),
        ({"peft": "lora"}, "adapters"),
        ({"torch_compile": True}, "--torch_compile"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"context_parallel_size": 2}, "context parallelism"),
    ],
)
def test_liger_auto_is_on_for_full_fine_tuning_and_says_why_not_elsewhere(options, reason):
    why = kernels.liger_auto_off(build_config({"task": "causal_lm", **options}))
    assert why == reason if reason is None else why.startswith(reason)


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("true", True), ("FALSE", False), (True, True)])
def test_liger_kernels_takes_true_false_and_auto(value, parsed):
    assert build_config({"liger_kernels": value}).model.liger_kernels == parsed
    with pytest.raises(UserError, match="--liger_kernels: expected true, false or auto, got 'sometimes'"):
        build_config({"liger_kernels": "sometimes"})


@pytest.mark.slow
def test_compiled_layers_compute_what_the_eager_model_does(tiny_llama_dir):
    from cloudtrain.models.attention import VARLEN

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation=VARLEN).train()
    model = copy.deepcopy(reference)
    task, cfg = task_for("causal_lm", tiny_llama_dir, torch_compile="true", compile_layers="true", max_length=40)
    assert prepare.compile_model(model, cfg, task, False) is model
    assert len(kernels.decoder_layers(model)) == reference.config.num_hidden_layers
    collate = CausalLMCollator(0, cu_seqlens=True, pad_to=40)
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):  # a second batch, other documents: the same graphs or one recompile, the same numbers
        lengths = torch.randint(2, 30, (8,), generator=generator)
        docs = [torch.randint(3, 200, (int(n),), generator=generator).tolist() for n in lengths]
        batch = collate(pack(docs, 40, "bfd")[:3])
        assert batch["input_ids"].shape[1] == 40
        losses = [task.loss(net, batch)[0] for net in (reference, model)]
        for loss in losses:
            loss.backward()
        assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5)
    for (name, e), g in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(g.grad, e.grad, atol=1e-5, rtol=1e-4), name


def test_the_compile_line_names_what_it_compiled(tiny_model_dir, capsys):
    """An encoder names its embeddings as a block never split: the line said "3 decoder layers" for 2 layers."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    task, cfg = task_for("classification", tiny_model_dir, torch_compile="true", compile_layers="true")
    prepare.compile_model(model, cfg, task, True)
    layers = model.config.num_hidden_layers
    assert f"compile: 1 BertEmbeddings, {layers} BertLayer, each on its own" in capsys.readouterr().out


@pytest.mark.gpu
def test_liger_modules_are_on_by_default_on_cuda_and_keep_the_loss(tiny_llama_dir):
    if kernels.liger_modules_error(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)):
        pytest.skip("liger-kernel is not installed here")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).cuda().train()
    model = copy.deepcopy(reference)
    task, cfg = task_for("causal_lm", tiny_llama_dir)  # --liger_kernels auto: on here, full fine-tuning on CUDA
    forwards = [m.forward for m in model.modules()]
    prepare.liger_modules(model, cfg, task, False)
    assert [m.forward for m in model.modules()] != forwards
    batch = {k: v.cuda() for k, v in batch_of(reference.config.vocab_size, cu_seqlens=True).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [task.loss(net, batch)[0].item() for net in (reference, model)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


def test_a_head_peft_trains_in_full_is_fused_through_its_trained_copy(tiny_llama_dir):
    """SFT with LoRA and a chat template's added tokens puts lm_head in PEFT's modules_to_save: the fused loss saw a
    wrapper, not a Linear, and fell back to the full logits while the run said it was fused (found in audit). The
    head is the wrapper's trained copy, and the logits it gives are the model's."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    lora = get_peft_model(
        model, LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    head = kernels.output_head(lora)
    assert type(head) is torch.nn.Linear and head.weight.requires_grad
    with torch.no_grad():
        head.weight.add_(0.5)  # the trained copy moves away from the frozen original
    assert hidden_states_error(lora) is None
