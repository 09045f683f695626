"""transformers.Trainer on the same work: what a user would run instead of cloudtrain.

Same optimizer (AdamW, no decay on biases and LayerNorm, the same kernel), linear schedule with the
same warmup, clipping, batch size, steps and precision; the train sampler is swapped for cloudtrain's
so both see the same batches in the same order. Evaluation is Trainer.evaluate on the test split.
"""

import tempfile

import numpy as np
import torch
from common import Spec, StepClock, prepare
from transformers import Trainer, TrainerCallback, TrainingArguments

from cloudtrain.data.processing import train_dataloader

# cloudtrain's --adamw_implementation as Trainer's `optim` (auto is fused); Trainer has no
# for_loop/foreach choice, so those take torch's default AdamW kernel
OPTIM = {"auto": "adamw_torch_fused", "fused": "adamw_torch_fused", "for_loop": "adamw_torch", "foreach": "adamw_torch"}


class ClockCallback(TrainerCallback):
    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.step_done()


def accuracy(prediction) -> dict:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


def run(spec: Spec) -> dict:
    cfg, data, model, tokenizer = prepare(spec)
    t = cfg.training
    clock = StepClock()
    sampler = train_dataloader(data, spec.batch_size, t.seed, cfg.data).sampler

    class SameOrderTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return sampler

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=t.max_steps,
            per_device_train_batch_size=spec.batch_size,
            per_device_eval_batch_size=t.per_device_eval_batch_size,
            learning_rate=t.learning_rate,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            lr_scheduler_type=t.lr_scheduler_type,
            warmup_steps=t.warmup_ratio,
            optim=OPTIM[t.adamw_implementation],
            seed=t.seed,
            bf16=t.mixed_precision == "bf16",
            use_cpu=not torch.cuda.is_available(),
            torch_compile=t.torch_compile,
            dataloader_num_workers=spec.num_workers,
            dataloader_pin_memory=spec.pin_memory,
            include_num_input_tokens_seen="non_padding",
            eval_strategy="no",
            save_strategy="no",
            logging_steps=t.max_steps,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = SameOrderTrainer(
            model=model,
            args=args,
            train_dataset=data.train,
            data_collator=data.collator,
            processing_class=tokenizer,
            compute_metrics=accuracy,
            callbacks=[ClockCallback(clock)],
        )
        trainer.train()
        metrics = trainer.evaluate(data.test)
    samples = t.max_steps * spec.batch_size
    return {
        **clock.result(spec.batch_size, samples, trainer.state.num_input_tokens_seen),
        "eval_samples_per_s": metrics["eval_samples_per_second"],
        "accuracy": metrics["eval_accuracy"],
        "eval_samples": len(data.test),
        "train_loss": trainer.state.log_history[-1].get("train_loss"),
    }
