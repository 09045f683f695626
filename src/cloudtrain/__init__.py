"""cloudtrain: train Hugging Face models (classifiers, decoder LMs, SFT, adapters) on one CPU, many GPUs or
SageMaker, with experiment tracking.

From Python or a notebook, the same pipeline as the `cloudtrain` command:

    from cloudtrain import Config, train

    results = train(task="causal_lm", model_name_or_path="gpt2", train_file="corpus.txt", max_steps=100)
    results = train("configs/recipes/classification_cpu.yaml", num_train_epochs=1)   # a config file + overrides
    cfg = Config()                                                                  # or the typed config
    cfg.training.learning_rate = 3e-5
    results = train(cfg)
    results["eval"]["accuracy"], results["output_dir"]

Mistakes raise cloudtrain.errors.UserError (one line saying what and how to fix), before anything heavy.
"""

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cloudtrain.config import Config
from cloudtrain.errors import TrainingStopped, UserError

# bitsandbytes (imported by peft wherever it is installed) warns on every CPU with AVX512-BF16 that it could not
# fetch a CPU 4-bit kernel from the Hub: noise on every command's stderr, as cloudtrain runs QLoRA on CUDA only.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = "0.1.0"
__all__ = ["Config", "train", "__version__"]


def train(config: Config | dict | str | Path | None = None, /, **options: Any) -> dict:
    """Run the training pipeline in this process; returns its results: {"train": ..., "eval": ..., "test": ...
    (when there is a test split), "output_dir": ...}; {} for a requeued run that found its model saved (a note
    says so).

    `config`: a Config, a dict of options (flat, or grouped by section as in a config file), or the path of a
    YAML/JSON config file; `options` (flag names, e.g. learning_rate=3e-5) override it. The values are checked
    exactly as on the command line. For several processes launch the command instead (accelerate, torchrun).

    `model`: your own torch.nn.Module whose forward returns the loss, with `train_dataset` (and `eval_dataset`):
    datasets of tensor dicts, the forward's keyword arguments (docs/extending.md, Your own module).
    `callbacks`: functions or objects called at train begin, step end, evaluate, save and train end (strings
    name importable ones, as --callbacks does; docs/extending.md, Callbacks).
    """
    from cloudtrain.config import resolve_options
    from cloudtrain.config.inert import OWN_MODULE, print_inert_notes
    from cloudtrain.hub_reach import back_online
    from cloudtrain.observe import console
    from cloudtrain.paths import check_local_paths

    console.setup()  # as the command line: bars on a terminal or in a notebook, none in a log file or a pipe
    if config is None and "config" in options:  # train(config="run.yaml"): as if given first
        config = options.pop("config")
    check_keywords(options)

    module = options.pop("model") if not isinstance(options.get("model", {}), dict) else None  # a dict: the section
    train_dataset, eval_dataset = options.pop("train_dataset", None), options.pop("eval_dataset", None)
    given = options.pop("callbacks", None) or []
    if isinstance(given, str):  # "module:a,module:b", as --callbacks takes them
        given = [name.strip() for name in given.split(",") if name.strip()]
    elif callable(given) or not isinstance(given, Iterable):  # one function or object
        given = [given]
    else:  # a list, a tuple, a set, ...
        given = list(given)
    names = [c for c in given if isinstance(c, str)]  # module:name, as on the command line
    if names:
        options["callbacks"] = names
    cfg = resolve_options(config, options)
    own_module = module is not None or train_dataset is not None
    try:
        if not own_module:  # the command line's checks, in its order: a missing file before the Hub or the imports
            check_local_paths(cfg)  # (a module's run is checked by its task first: what does not apply to a module)
        print_inert_notes(cfg, OWN_MODULE if own_module else None)
        from accelerate.state import AcceleratorState, GradientState  # heavy imports only once the options are valid

        from cloudtrain.pipeline import run_training

        # accelerate keeps one state per process, made by the first Accelerator: a notebook's next run (another
        # precision, DeepSpeed set-up, ...) must not find the last one's
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        task = None
        if own_module:  # the user's own module: a task object, not a --task name
            from cloudtrain.tasks.module_task import ModuleTask

            task = ModuleTask(module, train_dataset, eval_dataset, cfg)
        try:
            return run_training(cfg, task=task, callbacks=[c for c in given if not isinstance(c, str)])
        except TrainingStopped as done:
            if done.exit_code:
                raise
            print(f"note: {done}", flush=True)  # a requeued run whose model is saved: nothing was left to do
            return {}
    finally:
        back_online()  # an unreachable Hub switched this run to the cache, not the notebook's next one


API_KEYWORDS = ("model", "train_dataset", "eval_dataset", "callbacks")  # train()'s own, besides the options


def check_keywords(options: dict) -> None:
    """A keyword near one of train()'s own (eval_datset=) is named so; the options' hints suggested eval_strategy."""
    import difflib

    from cloudtrain.config.root import option_fields

    for name in options:
        close = difflib.get_close_matches(name, API_KEYWORDS, n=1, cutoff=0.8)
        if name not in option_fields() and name not in API_KEYWORDS and close:
            raise UserError(f"unknown option {name!r}; did you mean {close[0]}=?")
