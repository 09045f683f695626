"""bench/sft_bench.py's report: the goals (ours-bfd against hf-trainer and trl-packing) and the markdown
section."""

TITLE = "## SFT: ours vs transformers.Trainer vs TRL"
GOAL_VS_HF, GOAL_VS_TRL = 1.3, 1.0


def goals(runners: dict) -> dict:
    """The issue's two targets: ours-bfd at least 1.3x hf-trainer's real tokens/s, and not slower than trl-packing."""

    def rate(name):
        return runners[name]["summary"]["real_tokens_per_s"]["median"] if name in runners else None

    def loss(name):
        return runners[name]["summary"]["heldout_loss"]["median"] if name in runners else None

    out = {}
    for key, other, target in (
        ("vs_hf_trainer", "hf-trainer", GOAL_VS_HF),
        ("vs_trl_packing", "trl-packing", GOAL_VS_TRL),
    ):
        ours, theirs = rate("ours-bfd"), rate(other)
        ratio = ours / theirs if ours and theirs else None
        out[key] = {
            "ratio": ratio,
            "target": target,
            "met": None if ratio is None else ratio >= target,
            "loss_difference": None if ratio is None else loss("ours-bfd") - loss(other),
        }
    return out


def markdown(sft: dict) -> str:
    """The report's section: one row per runner, the goal ratios under it."""
    s, d = sft["settings"], sft["data"]
    lines = [
        TITLE,
        "",
        f"A {d['parameters'] / 1e6:.1f}M-parameter Llama (preset {s['preset']}, random weights from seed {s['seed']}, "
        f"vocabulary {d['vocab_size']} with chatml's two tokens) fine-tuned on Reuters R8 as instruction pairs "
        f'("Which topic is this article about ...?" + the article cut to fit, answer the category): '
        f"{d['train_examples']} training examples of {d['min_tokens']}-{d['max_tokens']} tokens (median "
        f"{d['median_tokens']}, {d['answer_tokens_per_example']:.1f} answer tokens each). Every runner: the same "
        f"folder (weights, chatml template, tokens), max_length {s['max_length']}, fp32, sdpa, "
        f"{s['threads'] or 'default'} thread(s), AdamW fused, lr {s['learning_rate']:g} ({s['lr_scheduler_type']}, "
        f"warmup {s['warmup_ratio']:g}), {s['steps']} steps. Equal work: packed runners take {s['batch_size']} rows "
        f"of {s['max_length']} per step (our bfd holds {d['examples_per_bfd_row']:.2f} examples per row, "
        f"{d['bfd_fill']:.0%} full); unpacked runners take as many examples per step instead, so all see about the "
        f'same examples and tokens (columns "examples", "real tokens"), not k times fewer. ours-none, hf-trainer '
        f"and trl-none see exactly the same batches. Medians of {sft['repetitions']} interleaved repetition(s), "
        f"each a fresh process; wall time {sft['wall_s']:.0f}s.",
        "",
        "Real tokens/s: non-padding tokens per step over the median step time (first step left out); computed "
        "tokens/s counts the padding too. Held-out loss: after the steps, mean cross-entropy over the answer tokens "
        f"of {d['heldout_examples']} R8 test examples, one per row, one function on each runner's saved weights.",
        "",
        "| runner | rows/step | examples | real tokens | answer tokens | real tokens/s | vs hf-trainer | "
        "computed tokens/s | padding | peak RSS MB | held-out loss | train loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(m: dict, digits: int) -> str:
        text = f"{m['median']:.{digits}f}"
        return text if m["min"] == m["max"] else f"{text} ({m['min']:.{digits}f}-{m['max']:.{digits}f})"

    base = sft["runners"].get("hf-trainer")
    for name, r in sft["runners"].items():
        m, run = r["summary"], r["runs"][0]
        ratio = (
            f"{m['real_tokens_per_s']['median'] / base['summary']['real_tokens_per_s']['median']:.2f}x" if base else ""
        )
        lines.append(
            f"| {name} | {r['rows_per_step']} | {run['examples_seen']} | {run['real_tokens_seen']} | "
            f"{run['answer_tokens_seen']} | {spread(m['real_tokens_per_s'], 0)} | {ratio} | "
            f"{m['computed_tokens_per_s']['median']:.0f} | {run['padding_fraction']:.1%} | "
            f"{m['peak_rss_mb']['median']:.0f} | {m['heldout_loss']['median']:.4f} | "
            f"{m['train_loss']['median']:.4f} |"
        )
    lines.append("")
    for key, other in (("vs_hf_trainer", "hf-trainer"), ("vs_trl_packing", "trl-packing")):
        g = sft["goals"][key]
        if g["ratio"] is None:
            lines.append(f"- ours-bfd / {other} real tokens/s: n/a ({other} not run)")
            continue
        verdict = "met" if g["met"] else "not met"
        lines.append(
            f"- ours-bfd / {other} real tokens/s: **{g['ratio']:.2f}x** (goal at least {g['target']:.1f}x: "
            f"{verdict}); held-out loss difference {g['loss_difference']:+.4f}"
        )
    for name, why in sft.get("skipped", {}).items():
        lines.append(f"- {name}: skipped, {why}")
    trl = sft["runners"].get("trl-none", {}).get("runs", [{}])[0]
    if "inputs_differing_from_ours" in trl:
        lines.append(
            f"- TRL trains on our tokens and loss masks (pre-tokenized). Its own tokenization of the same "
            f"pairs: {trl['inputs_differing_from_ours']} of {d['train_examples']} examples with other input "
            f"tokens; it would train {trl['trained_not_by_ours']} tokens ours does not (the newline chatml "
            f"writes after <|im_end|>, which ours leaves out: the template's, never generated) and leave "
            f"{trl['not_trained_by_trl']} of ours untrained"
        )
    return "\n".join(lines) + "\n"
