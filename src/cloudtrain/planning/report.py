"""The plan as data (the JSON `plan --json` prints) and as text: the model and set-up, the table of every
candidate under its group's title, and the recommendation with its reasons and launch command."""

from dataclasses import asdict

from cloudtrain.planning.memory import GIB, Estimate
from cloudtrain.planning.search import Choice, Row
from cloudtrain.planning.strategies import Candidate

COLUMNS = (
    "strategy",
    "time",
    "params",
    "grads",
    "optim",
    "activ",
    "logits",
    "overhd",
    "GPU total",
    "CPU/node",
    "comm/step",
    "max mb",
    "fits",
)


# ---------------------------------------------------------------- as data


def estimate_json(est: Estimate) -> dict:
    return {**asdict(est), "total": est.total, "cpu_per_node": est.cpu_per_node}


def candidate_json(c: Candidate) -> dict:
    return {
        "strategy": c.strategy.key,
        "label": c.name,
        "gradient_checkpointing": c.checkpointing,
        "peft": c.peft,
        "tensor_parallel_size": c.tensor_parallel,
        "context_parallel_size": c.context_parallel,
    }


def row_json(row: Row) -> dict:
    c = row.candidate
    return {
        **candidate_json(c),
        "relative_step_time": round(c.speed, 3),
        "estimate": estimate_json(row.estimate),
        "fits": row.fits,
        "max_micro_batch": row.max_micro_batch,
        "pipeline": row.pipeline,
        "communication_per_step": row.traffic,
    }


def choice_json(choice: Choice) -> dict:
    """A fallback: a candidate that fits, at the micro-batch and accumulation it would run with."""
    return {
        **candidate_json(choice.candidate),
        "micro_batch": choice.micro_batch,
        "gradient_accumulation_steps": choice.accumulation,
        "estimate": estimate_json(choice.estimate),
    }


def recommendation_json(choice: Choice, global_batch: int, files: dict, reasons: list[str], command: str) -> dict:
    c = choice.candidate
    return {
        **candidate_json(c),
        "pipeline": c.pipeline and asdict(c.pipeline),
        "micro_batch": choice.micro_batch,
        "gradient_accumulation_steps": choice.accumulation,
        "global_batch_size": global_batch,
        "estimate": estimate_json(choice.estimate),
        "reasons": reasons,
        "files": files,
        "command": command,
    }


# ---------------------------------------------------------------- as text


def _size(n: int) -> str:
    if n >= 10 * GIB:
        return f"{n / GIB:.1f}G"
    if n >= GIB:
        return f"{n / GIB:.2f}G"
    return f"{n / 2**20:.0f}M"


def render(plan: dict) -> str:
    """The human-readable plan: model, setup, the table of all candidates, the recommendation."""
    m, s = plan["model"], plan["setup"]
    lm = m["vocab_size"] > 0  # an LM head's logits (a decoder's, an encoder-decoder's) have their own column
    vocab = f", vocab {m['vocab_size']}" if lm else ""
    encoder = m.get("encoder")
    layers = f"{encoder['num_layers']} encoder + {m['num_layers']} decoder" if encoder else str(m["num_layers"])
    target = s.get("target_length") if encoder else None  # the decoder's tokens: the logits' rows
    lines = [
        f"model: {m['architecture']} ({m['name']}), {m['num_params'] / 1e6:,.1f}M parameters, "
        f"{layers} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, intermediate "
        f"{m['intermediate_size']}{' (gated)' if m['gated_mlp'] else ''}"
        f"{vocab}, {m['attn_implementation']} attention",
        f"setup: {s['num_nodes']} node(s) x {s['num_gpus']} GPU(s) x {s['gpu_memory_bytes'] / GIB:g} GiB, "
        f"max_length {s['max_length']}{f', max_target_length {target}' if target else ''}, "
        f"mixed precision {s['mixed_precision']}, micro-batch "
        f"{plan['requested_micro_batch']}, global batch {plan['global_batch_size']}",
        f"memory per GPU at micro-batch {plan['requested_micro_batch']}; time: relative step time, fastest "
        "first; overhd: 1 GiB CUDA context + communication buffers + 5% fragmentation; max mb: the largest "
        "micro-batch that fits",
    ]
    if lm and s.get("fused_loss"):
        kernel = "Liger's" if s["fused_loss"] == "liger" else "a chunked"
        lines.append(
            f"logits: {kernel} fused linear cross-entropy (--fused_cross_entropy): the input's and the head's "
            "gradients and one chunk of logits at a time (a pipeline's on its last stage); the full logits under "
            "ZeRO-3, FSDP, TP and CP"
        )
    elif lm:
        lines.append(
            f"logits: micro-batch x {'max_target_length' if target else 'max_length'} x vocab x 12 bytes (the "
            "logits with their fp32 copy and "
            "the cross-entropy's fp32 buffers), whatever the strategy or checkpointing; a pipeline's on its last "
            "stage, of every micro-batch under GPipe"
        )
    if s.get("fused_modules"):
        lines.append(
            "kernels: Liger's fused RMSNorm and SwiGLU keep less (--liger_kernels) in full fine-tuning without TP or CP"
        )
    if m["adapters"]:
        lines.append(_adapters_line(m["adapters"], m["num_params"], s["mixed_precision"]))
    lines += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(lines + [""] + _render_table(plan["strategies"], lm) + [""] + _render_choice(plan))


def _adapters_line(a: dict, num_params: int, precision: str) -> str:
    trainable = a["lora_params"] + a["head_params"]
    return (
        f"adapters: r={a['spec']['r']} on {','.join(a['spec']['target_modules'])}"
        f"{' + the head trained in full' if a['head_params'] else ''}: {trainable:,} trainable parameters "
        f"({100 * trainable / num_params:.2f}%; DoRA +{a['magnitude_params']:,}), the only ones with gradients and "
        f"AdamW states; the base frozen in {'fp32' if precision == 'no' else precision} (QLoRA: "
        f"{a['quantized_params'] / 1e6:,.1f}M weights in 4-bit NF4, the rest in fp32 under DDP, in the compute "
        "dtype under ZeRO and FSDP2, which shard it)"
    )


def _render_table(rows: list[dict], logits: bool) -> list[str]:
    """The table of candidates under two titles, full fine-tuning and adapters; the logits column only for a
    language model."""
    shown = [i for i, name in enumerate(COLUMNS) if logits or name != "logits"]
    table = [[row[i] for i in shown] for row in [COLUMNS] + [_table_row(r) for r in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(shown))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    body = lines[1:]
    titles = (
        (
            lambda r: r["peft"] != "none",
            "adapters under DDP, ZeRO and FSDP2 (recommended only if no full fine-tuning fits):",
        ),
        (
            lambda r: r["pipeline"] is not None,
            "pipeline + data parallel (--training_type pipeline): pp processes per pipeline, v stages each, M "
            "micro-batches per step, time x (1 + bubble (pp - 1)/(v*M)); memory of the process that needs the most:",
        ),
        (
            lambda r: r["tensor_parallel_size"] > 1 or r["context_parallel_size"] > 1,
            "tensor parallel (TP=t: --tensor_parallel_size t, x FSDP2: --fsdp true) and context parallel (CP=c: "
            "--context_parallel_size c, all-to-all attention): t or c processes take the same rows, so a row's "
            "micro-batch is t (or c) times the one asked of each GPU:",
        ),
    )
    # rows list data-parallel full fine-tuning first, then tensor/context parallel, pipelines, adapters: each title
    # is inserted before its group's first row, the last group first so that the earlier indices hold
    for starts, title in titles:
        first = next((i for i, row in enumerate(rows) if starts(row)), None)
        if first is not None:
            body.insert(first, title)
    return [lines[0], "full fine-tuning (every weight trains):"] + body


def _table_row(r: dict) -> tuple:
    e = r["estimate"]
    return (
        "  " + r["label"],
        f"{r['relative_step_time']:.2f}",
        _size(e["parameters"]),
        _size(e["gradients"]),
        _size(e["optimizer_states"]),
        _size(e["activations"]),
        _size(e["logits"]),
        _size(e["overhead"]),
        _size(e["total"]),
        _size(e["cpu_per_node"]) + (f" +{_size(e['nvme_per_node'])} NVMe" if e.get("nvme_per_node") else ""),
        _size(sum((r.get("communication_per_step") or {}).values())),
        str(r["max_micro_batch"]),
        "yes" if r["fits"] else "no",
    )


def _render_choice(plan: dict) -> list[str]:
    rec = plan["recommendation"]
    if rec is None:
        return [plan["message"], "What would fit:"] + [f"  - {idea}" for idea in plan["suggestions"]]
    lines = [
        f"Recommended: {rec['label']}, micro-batch {rec['micro_batch']}, gradient accumulation "
        f"{rec['gradient_accumulation_steps']}."
    ] + [f"  {reason}" for reason in rec["reasons"]]
    wrote = "Wrote " + ", ".join(rec["files"].values()) + ". " if rec["files"] else ""
    lines += [wrote + "Launch with:", f"  {rec['command']}"]
    if plan.get("fallbacks"):
        lines.append("If it does not suit, the next best (--strategy and --gradient_checkpointing choose one):")
        lines += [
            f"  - {f['label']}: micro-batch {f['micro_batch']}, gradient accumulation "
            f"{f['gradient_accumulation_steps']}, {f['estimate']['total'] / GIB:.1f} GiB per GPU"
            for f in plan["fallbacks"]
        ]
    return lines
