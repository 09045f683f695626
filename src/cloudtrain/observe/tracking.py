"""Experiment tracking shared by the trainers: `metrics.jsonl` always, plus the trackers of `--report_to`.

Every logging event is one line of `<output_dir>/metrics.jsonl`: {"step": N, "time": unix seconds,
<name>: value}, strict JSON (a value that is not finite is null there; the trackers get it as it is); at
the end `<output_dir>/training_curves.png` is drawn from those lines, so a run can
be looked at with no tracker at all. The trackers are accelerate's tracker classes, extended with
what a finished run needs (a summary, the confusion matrix, resuming):
- wandb: online when credentials are configured (WANDB_API_KEY or `wandb login`) and the server
  answers within a few seconds and takes the key; otherwise offline under <output_dir>/wandb, with the `wandb sync`
  command printed at the end. WANDB_* variables (WANDB_MODE, WANDB_PROJECT, WANDB_DIR,
  WANDB_ENTITY, ...) are respected. `--log_model true` uploads the saved model (the files cloudtrain wrote) as an
  artifact.
- trackio: local SQLite under $HF_HOME/trackio (or $TRACKIO_DIR); `trackio show` is its dashboard.
- tensorboard: event files under <output_dir>/tensorboard/<run name>.
- mlflow: $MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlruns/mlflow.db. A URI's password is masked in
  tracker_runs.json: a resume without MLFLOW_TRACKING_URI reads MLFLOW_TRACKING_USERNAME/PASSWORD instead.

Only the main process creates trackers and writes, so a multi-process training is one tracker run. Tracking is
auxiliary: a tracker that fails mid-run (its server gone down) is dropped with a one-line warning.
A run resumed from a checkpoint (`resume_step`) continues the same tracker runs, whose ids are kept
in <output_dir>/tracker_runs.json, and keeps the metrics.jsonl lines up to that step. Points the
first part logged after its checkpoint stay in W&B, trackio and MLflow (TensorBoard hides them).
Not supported: accelerate's other trackers (comet_ml, aim, clearml, dvclive, swanlab).
"""

import base64
import fnmatch
import importlib.util
import itertools
import json
import os
import shlex
import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from accelerate import PartialState
from accelerate.tracking import TensorBoardTracker, TrackioTracker, WandBTracker
from PIL import Image

from cloudtrain.config import Config, TrackingConfig, differs_from_default
from cloudtrain.errors import UserError, first_line
from cloudtrain.observe.mlflow_tracker import MLflow
from cloudtrain.observe.plotting import image_grid, plot_training_curves
from cloudtrain.observe.tracker_base import RunContext, RunMethods, http_status, numbers, reachable, without_userinfo
from cloudtrain.publish.atomic import write_whole
from cloudtrain.publish.output_dir import ours_in_merged, remote_code, written
from cloudtrain.publish.saving import MERGED, MODEL_PATTERNS, finite
from cloudtrain.redact import mask, mask_value
from cloudtrain.sagemaker_env import in_training_job

RUNS_FILE = "tracker_runs.json"
RUN_LOG_FILES = ("metrics.jsonl", "training_curves.png")
WANDB_CONNECT_TIMEOUT_S = 3.0
WANDB_INIT_TIMEOUT_S = 30.0
WANDB_TAG_MAX = 64  # characters of a W&B tag
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # what wandb 0.2x's settings take
PACKAGES = {"wandb": "wandb", "trackio": "trackio", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def check_trackers(cfg: TrackingConfig) -> None:
    """Fail before training when a requested tracker cannot be used (no imports, no network)."""
    for name in requested(cfg):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(
                f"--report_to {name} needs the {PACKAGES[name]} package: "
                f"pip install {PACKAGES[name]} (or run `make setup`)"
            )
    if cfg.log_model and "wandb" not in cfg.report_to:
        raise UserError("--log_model true uploads the model to W&B: add wandb to --report_to")
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in cfg.report_to and mode is not None and mode.strip().lower() not in WANDB_MODES:
        raise UserError(f"WANDB_MODE={mode} is not a W&B mode: set one of {', '.join(WANDB_MODES)}, or unset it")
    long = [tag for tag in cfg.tags if not 1 <= len(tag) <= WANDB_TAG_MAX] if "wandb" in cfg.report_to else []
    if long:  # wandb.init's own refusal: a 45-line pydantic traceback (found in audit)
        raise UserError(f"--tags {long[0]!r} has {len(long[0])} characters: W&B takes tags of 1 to {WANDB_TAG_MAX}")


def requested(cfg: TrackingConfig) -> list[str]:
    return [name for name in cfg.report_to if name != "none"]


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file, less a last line a kill or a full disk cut mid-write (its step is
    redone by a resume). ValueError where another line does not parse."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError as err:
            if number < len(lines):
                raise ValueError(f"{path}: line {number} is not a JSON record ({first_line(err)})") from None
    return records


def _is_save_line(record: dict) -> bool:
    return all(key.startswith("checkpoint/") for key in record if key not in ("step", "time"))


class RunLog:
    """The run's record: metrics.jsonl and the trackers on the main process; a no-op on the others."""

    def __init__(
        self,
        cfg: Config,
        output_dir: Path,
        is_main_process: bool,
        run_info: dict,
        resume_step: int | None = None,
        checkpoint: Path | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        self.enabled = is_main_process
        self.run_info = run_info
        self.trackers: list = []
        self.curves: dict = {}  # what training_curves.png shows, once finish() has drawn it
        self.latest_step = 0  # the newest step logged: W&B drops a value logged at an earlier one
        self.start_time = time.perf_counter()
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        kept_at_resume_step = self._start_metrics_file(resume_step, checkpoint)
        saved = load_runs(self.output_dir) if resume_step is not None else {}
        run_name = saved.get("run_name") or cfg.tracking.run_name or default_run_name(self.output_dir)
        context = RunContext(cfg, self.output_dir, run_name, resume_step, kept_at_resume_step)
        state = {**saved, "run_name": run_name}
        config = mask_value({**cfg.to_dict(), **run_info})  # secrets are out already
        if requested(cfg.tracking):
            PartialState()  # accelerate's trackers log through its logger, which needs its state
        for name in requested(cfg.tracking):
            tracker = TRACKERS[name](context, saved.get(name, {}))
            tracker.start()
            tracker.log_config(config)
            state[name] = tracker.state()
            self.trackers.append(tracker)
        write_whole(self.output_dir / RUNS_FILE, json.dumps(state, indent=2) + "\n")

    def _start_metrics_file(self, resume_step: int | None, checkpoint: Path | None) -> list[dict] | None:
        """A fresh file, or on resume the lines up to the checkpoint (later ones are redone). At the checkpoint's
        own step, the lines its copy of the log holds and the save's own line: not what came after it there (a
        finished run's final evaluation, which a resume at its last step writes again). Returns the lines kept at
        the checkpoint's step where some logged there after it were dropped; else None."""
        kept, redone = [], False
        copy = checkpoint / "metrics.jsonl" if checkpoint else None
        if resume_step is not None and self.path.exists():
            logged = self._logged(copy)
            kept = [r for r in logged if r["step"] < resume_step]
            at_step = [r for r in logged if r["step"] == resume_step]
            if copy and copy.is_file():
                seen = sum(r["step"] == resume_step for r in read_metrics(copy))
                whole = len(at_step)
                at_step = at_step[:seen] + list(itertools.takewhile(_is_save_line, at_step[seen:]))
                redone = len(at_step) < whole
            kept += at_step
        write_whole(self.path, "".join(json.dumps(r) + "\n" for r in kept))  # a kill now leaves the old log whole
        # the validation grids alike: an earlier run's were shown on this run's card (found in audit)
        for grid in (self.output_dir / "validation").glob("*-step-*.png"):
            step = grid.stem.rsplit("-step-", 1)[1]
            if step.isdigit() and (resume_step is None or int(step) > resume_step):
                grid.unlink()
        return [r for r in kept if r["step"] == resume_step] if redone else None

    def _logged(self, copy: Path | None) -> list[dict]:
        """The run's log as far as it parses; where it is damaged, the checkpoint's copy (what it held at the
        save), the damaged file kept beside it."""
        try:
            return read_metrics(self.path)
        except ValueError as err:
            damage = str(err)
        if not (copy and copy.is_file()):
            raise UserError(f"{damage}: mend or remove it, or resume from a checkpoint holding its copy")
        kept = self.path.with_name("metrics.damaged.jsonl")
        shutil.copy2(self.path, kept)
        print(f"note: {damage}; the log restarts from {copy}'s copy (the damaged file is kept as {kept.name})")
        return read_metrics(copy)

    def log(self, values: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        with self.path.open("a") as f:
            f.write(json.dumps(finite(record), allow_nan=False) + "\n")  # NaN is not JSON: jq and JSON.parse refuse it
        self.latest_step = max(self.latest_step, step)
        self._each_tracker(lambda tracker: tracker.log(values, step=step))

    def _each_tracker(self, call: Callable[["RunMethods"], object]) -> None:
        """`call` on every tracker. Tracking is auxiliary: a tracker that fails (a server gone down mid-run) is dropped
        with one line, and the run goes on without it (MLflow's traceback ended the run unsaved; found in audit)."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:
                self.trackers.remove(tracker)
                print(
                    f"warning: {getattr(tracker, 'name', type(tracker).__name__)} failed ({mask(first_line(err))}); "
                    "the run goes on without it",
                    flush=True,
                )

    def event(self, kind: str, message: str, value: float, step: int) -> None:
        """Something that went wrong (an anomaly): `anomaly/<kind>` = value in every tracker, the line in
        metrics.jsonl, and an alert where the tracker has alerts (W&B online). Found at a logging step after it,
        the value goes to the trackers at that step (W&B drops one logged at an earlier step; the message says
        which step it was)."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), "event": kind, "message": message}) + "\n")

        def report(tracker: RunMethods) -> None:
            tracker.log({f"anomaly/{kind}": value}, step=max(step, self.latest_step))
            tracker.alert(kind.replace("_", " "), message)

        self._each_tracker(report)

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        """A table (a causal LM's sample generations, say) to every tracker; metrics.jsonl keeps numbers only.
        A table of (caption, image) rows (text-to-image's validation images) is logged as images."""
        if not self.enabled:
            return
        if rows and len(rows[0]) == 2 and isinstance(rows[0][1], Image.Image):
            self.log_images(name, [str(r[0]) for r in rows], [r[1] for r in rows], step)
            return
        self._each_tracker(lambda tracker: tracker.log_table(name, header, rows, step))

    def log_images(self, name: str, captions: list[str], images: list, step: int) -> None:
        """Images with their captions: one grid per call in <output_dir>/validation (`<name's first part>-step-N.png`),
        and the images to every tracker that shows images."""
        if not self.enabled:
            return
        folder = self.output_dir / "validation"
        folder.mkdir(exist_ok=True)
        grid = image_grid(images, captions)
        grid.save(folder / f"{name.split('/')[0]}-step-{step:06d}.png")
        self._each_tracker(lambda tracker: tracker.log_images(name, captions, images, grid, step))

    def finish(self, results: dict, label_names: list[str]) -> None:
        """Curves, summary, confusion matrices and (optionally) the model; then end the tracker runs."""
        if not self.enabled:
            return
        png = self.output_dir / "training_curves.png"
        self.curves = plot_training_curves(read_metrics(self.path), png)
        step = results["train"]["global_step"]
        summary = run_summary(results, self.run_info, time.perf_counter() - self.start_time)
        matrices = {
            f"{split}/confusion_matrix": results[split]["confusion_matrix"]
            for split in ("eval", "test")
            if "confusion_matrix" in results.get(split, {})
        }

        def end(tracker: RunMethods) -> None:
            tracker.log_summary(summary, step)
            for name, matrix in matrices.items():
                tracker.log_confusion_matrix(name, matrix, label_names, step)
            tracker.log_files(png, step)
            tracker.finish()

        self._each_tracker(end)
        print(f"training curves: {png.resolve()}", flush=True)


def default_run_name(output_dir: Path) -> str:
    return f"{output_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"


def load_runs(output_dir: Path) -> dict:
    """The tracker run ids an earlier part of this run saved, or {} if there are none."""
    path = output_dir / RUNS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def run_summary(results: dict, run_info: dict, total_time_s: float) -> dict:
    """Final numbers: training summary, eval/test metrics, time, size and hardware."""
    summary = {f"summary/{k}": v for k, v in results["train"].items()}
    for split in ("eval", "test"):
        summary.update({f"summary/{split}_{k}": v for k, v in results.get(split, {}).items()})
    summary.update({f"summary/{k}": v for k, v in run_info.items()})
    summary["summary/total_time_s"] = round(total_time_s, 2)
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def matrix_rows(matrix: list[list[int]], labels: list[str]) -> tuple[list[str], list[list]]:
    """A confusion matrix as (header, rows) of a table: rows = true class, columns = predicted."""
    return ["true \\ predicted", *labels], [[label, *row] for label, row in zip(labels, matrix, strict=True)]


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


# ---------------------------------------------------------------- W&B


class WandB(RunMethods, WandBTracker):
    """A W&B run: online when possible, offline (with a sync command at the end) otherwise."""

    def __init__(self, context: RunContext, saved: dict):
        self.context, self.saved = context, saved
        tracking, env = context.tracking, os.environ
        kwargs = {
            "name": None if tracking.run_name is None and env.get("WANDB_NAME") else context.run_name,
            "tags": tracking.tags or None,
            "entity": saved.get("entity") or None,
        }
        if not env.get("WANDB_DIR"):
            kwargs["dir"] = str(context.output_dir)
        if saved.get("id"):
            kwargs.update(id=saved["id"], resume="allow")
        if not env.get("WANDB_INIT_TIMEOUT"):
            import wandb

            kwargs["settings"] = wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S)
        # The flag wins over WANDB_PROJECT only when it was changed from its default.
        default_project = TrackingConfig().project_name
        project = saved.get("project") or (
            tracking.project_name
            if tracking.project_name != default_project
            else env.get("WANDB_PROJECT", default_project)
        )
        super().__init__(project, **kwargs)

    def start(self) -> None:
        import wandb

        offline_reason = wandb_offline_reason()
        if offline_reason:
            print(f"W&B: {offline_reason}; logging offline", flush=True)
            self.init_kwargs["mode"] = "offline"
            without_wandb_analytics()
        try:
            super().start()
        except wandb.errors.Error as err:  # a server that refuses the run otherwise: never lose the run over it
            if self.init_kwargs.get("mode") == "offline":
                raise
            print(f"W&B: could not start an online run ({first_line(err)}); logging offline", flush=True)
            self.init_kwargs["mode"] = "offline"
            without_wandb_analytics()
            super().start()

    def state(self) -> dict:
        offline_dirs = list(self.saved.get("offline_dirs", []))
        if self.run.offline:
            offline_dirs.append(str(Path(self.run.settings.sync_dir).resolve()))
        return {
            "id": self.run.id,
            "project": self.run.project,
            "entity": self.run.entity or None,
            "offline_dirs": offline_dirs,
        }

    def log_summary(self, summary: dict, step: int) -> None:
        self.run.summary.update(summary)

    def alert(self, title: str, text: str) -> None:
        if not self.run.offline:  # an offline run has no one to tell
            self.run.alert(title=f"cloudtrain: {title}", text=text, level="WARN")

    def log_confusion_matrix(self, name: str, matrix: list[list[int]], labels: list[str], step: int) -> None:
        import wandb

        # W&B's chart takes one (true, predicted) pair per example: expand the counts back into pairs.
        pairs = [(t, p) for t, row in enumerate(matrix) for p, count in enumerate(row) for _ in range(count)]
        chart = wandb.plot.confusion_matrix(
            y_true=[t for t, _ in pairs], preds=[p for _, p in pairs], class_names=labels, title=name
        )
        self.log({name: chart}, step=step)

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        import wandb

        self.log({name: wandb.Table(columns=header, data=rows)}, step=step)  # type: ignore[arg-type]  # list[str | int]: invariant

    def log_images(self, name: str, captions: list[str], images: list, grid: Image.Image, step: int) -> None:
        import wandb

        self.log({name: [wandb.Image(im, caption=c) for im, c in zip(images, captions, strict=True)]}, step=step)

    def log_files(self, curves_png: Path, step: int) -> None:
        import wandb

        self.log({"training_curves": wandb.Image(str(curves_png))}, step=step)
        if self.context.tracking.log_model:
            cfg = self.context.cfg  # W&B takes at most 100 metadata keys: the options given, not every default
            given = {k: v for k, v in cfg.to_dict().items() if differs_from_default(cfg, k)}
            metadata = mask_value(dict(list(given.items())[:100]))
            artifact = wandb.Artifact(f"model-{self.run.id}", type="model", metadata=metadata)
            for path, name in model_artifact_entries(self.context.output_dir):
                if path.is_dir():
                    artifact.add_dir(str(path), name=name)
                else:
                    artifact.add_file(str(path), name=name)
            self.run.log_artifact(artifact)

    def finish(self) -> None:
        state = self.state()
        super().finish()
        gone = [d for d in state["offline_dirs"] if not Path(d).is_dir()]  # an emptied output folder's (spot restart)
        state["offline_dirs"] = [d for d in state["offline_dirs"] if d not in gone]
        if gone:
            print(
                f"W&B: {len(gone)} earlier offline part(s) of this run are gone with their folder ({gone[0]}): "
                "their history cannot be uploaded",
                flush=True,
            )
        if state["offline_dirs"]:
            print(f"W&B ran offline; to upload this run: {wandb_sync_command(state, bool(self.saved))}", flush=True)


def model_artifact_entries(output_dir: Path) -> list[tuple[Path, str]]:
    """What `--log_model true` uploads, as (path, name in the artifact): the files cloudtrain wrote in the output
    folder (its manifest's, as `cloudtrain push` reads it; a remote-code model's modules; this run's log and curves,
    recorded only after the trackers finish) and its model sub-folders, merged/ name by name. Not the user's files
    (a notes.txt there went up: found in audit), nor tracker data, checkpoints or cloudtrain's hidden files."""
    ours = written(output_dir) | remote_code(output_dir) | set(RUN_LOG_FILES)
    entries = []
    for entry in sorted(output_dir.iterdir()):
        if entry.name not in ours or entry.name == RUNS_FILE or entry.name.startswith("."):
            continue
        if entry.is_file():
            entries.append((entry, entry.name))
        elif entry.name == MERGED:
            entries += merged_entries(output_dir)
        elif any(fnmatch.fnmatchcase(entry.name, p) for p in (*MODEL_PATTERNS, "tokenizer*")):
            entries.append((entry, entry.name))  # a pipeline's parts (unet/, vae/, ...)
    return entries


def merged_entries(output_dir: Path) -> list[tuple[Path, str]]:
    """The names of merged/ that cloudtrain's merge wrote (a GGUF export beside them is the user's)."""
    ours = ours_in_merged(output_dir)
    paths = sorted((output_dir / MERGED).iterdir())
    return [(path, f"{MERGED}/{path.name}") for path in paths if ours(path.name) and not path.name.startswith(".")]


def wandb_offline_reason() -> str | None:
    """Why W&B must run offline although it was not asked to; None when online can be tried.

    Credentials are looked up locally (env, settings, .netrc) and the server gets a few seconds to
    answer, so a missing key or network costs seconds, not W&B's minute-long init retries.
    """
    import pydantic
    import wandb

    try:
        settings = wandb.setup().settings  # WANDB_* variables and `wandb login`/`wandb offline` settings
    except pydantic.ValidationError as err:  # a WANDB_* value it refuses: 50 lines, raised inside wandb
        problems = err.errors()
        said = f"{problems[0]['loc'][0]}: {problems[0]['msg']}" if problems else first_line(err)
        raise UserError(
            f"W&B refuses its settings ({said}): check the WANDB_* variables (WANDB_BASE_URL, WANDB_MODE) and "
            "~/.config/wandb/settings"
        ) from None
    if settings.mode in ("offline", "dryrun", "disabled"):
        return None  # the user's choice (WANDB_MODE or `wandb offline`): wandb handles it
    if not wandb_credentials(settings):
        return "no credentials (set WANDB_API_KEY or run `wandb login`)"
    if not reachable(settings.base_url, WANDB_CONNECT_TIMEOUT_S):
        return f"{settings.base_url} cannot be reached (no answer within {WANDB_CONNECT_TIMEOUT_S:.0f} s)"
    if wandb_key_rejected(settings):
        return f"{settings.base_url} rejects the API key (HTTP 401; check WANDB_API_KEY or run `wandb login --relogin`)"
    return None


def wandb_key_rejected(settings) -> bool:
    """Whether the W&B server answers 401 to this process's API key. Checked before wandb.init: an online run the
    server refused left its run folder in <output_dir>/wandb, and its `Find logs at` line at exit, beside the
    offline run (found in audit). A key W&B checks otherwise (an identity token file) is left to wandb.init."""
    import wandb
    from wandb.sdk.lib import wbauth

    try:
        key = settings.api_key or wbauth.read_netrc_auth(host=settings.base_url)
    except wandb.errors.AuthenticationError:
        return False  # a malformed stored key: wandb.init says so
    if not key:
        return False
    request = urllib.request.Request(
        without_userinfo(settings.base_url).rstrip("/") + "/graphql",
        data=json.dumps({"query": "query CloudtrainViewer { viewer { id } }"}).encode(),
        headers={
            "Authorization": "Basic " + base64.b64encode(f"api:{key}".encode()).decode(),
            "Content-Type": "application/json",
        },
        method="POST",
    )
    return http_status(request, WANDB_CONNECT_TIMEOUT_S) == 401


def without_wandb_analytics() -> None:
    """Turn W&B's usage analytics off in this process. They go to the W&B server, which a run logging offline could
    not use: a server that rejected the key refused them too, one `Failed to export metrics batch code: 401` line
    each at exit (found in audit)."""
    try:
        from wandb.analytics.opentelemetry import opentelemetry_proxy

        opentelemetry_proxy.disable()
    except (ImportError, AttributeError):  # a wandb without them
        pass


def wandb_credentials(settings) -> bool:
    import wandb
    from wandb.sdk.lib import wbauth  # where wandb itself reads logins stored in .netrc

    try:
        stored = wbauth.read_netrc_auth(host=settings.base_url)
        return bool(settings.api_key or settings.identity_token_file or stored)
    except wandb.errors.AuthenticationError:  # a malformed stored key: no usable login
        return False


def wandb_sync_command(state: dict, resumed: bool) -> str:
    """`wandb sync` for every offline part of the run; parts of one resumed run go to one run id."""
    dirs = " ".join(shlex.quote(d) for d in state["offline_dirs"])
    several = resumed or len(state["offline_dirs"]) > 1
    return f"wandb sync --id {state['id']} {dirs}" if several else f"wandb sync {dirs}"


# ---------------------------------------------------------------- trackio


class Trackio(RunMethods, TrackioTracker):
    """A trackio run in the local database ($HF_HOME/trackio); resumed by its project and name, which trackio
    resolves to the newest run of the name: a new run takes a name no run of the project has."""

    def __init__(self, context: RunContext, saved: dict):
        if in_training_job() and not os.environ.get("TRACKIO_DIR"):  # read at trackio's import, just below
            os.environ["TRACKIO_DIR"] = str(context.output_dir / "trackio")  # into model.tar.gz, not lost with the job
        project = saved.get("project", context.tracking.project_name)
        super().__init__(
            project,
            name=saved.get("name") or untaken_name(project, context.run_name),
            resume="allow" if saved else "never",
            embed=False,
        )

    def state(self) -> dict:
        return {"project": self.run.project, "name": self.run.name, "id": self.run.id}

    def log_config(self, config: dict) -> None:
        self.run.config.update(config)  # stored with the first logged step

    def log_confusion_matrix(self, name: str, matrix: list[list[int]], labels: list[str], step: int) -> None:
        self.log_table(name, *matrix_rows(matrix, labels), step=step)

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        import trackio

        self.log({name: trackio.Table(columns=header, data=rows)}, step=step)

    def log_images(self, name: str, captions: list[str], images: list, grid: Image.Image, step: int) -> None:
        import trackio

        self.log({name: trackio.Image(grid, caption=" | ".join(captions))}, step=step)

    def finish(self) -> None:
        import trackio

        trackio.finish()  # also forgets the run, so trackio's exit hook does not finish it a second time


def untaken_name(project: str, name: str) -> str:
    """`name`, or `name-2`, `name-3`... where an earlier run of the project has it (another experiment's resume
    would otherwise attach to this one)."""
    import trackio

    try:
        taken = {run.name for run in trackio.Api().runs(project)}
    except ValueError:  # no such project yet
        return name
    candidates = (name if n == 1 else f"{name}-{n}" for n in itertools.count(1))
    chosen = next(c for c in candidates if c not in taken)
    if chosen != name:
        print(f"trackio: project {project} has a run named {name} already; this one is {chosen}", flush=True)
    return chosen


# ---------------------------------------------------------------- TensorBoard


def folder_name(run_name: str) -> str:
    """A run name as one folder's name: `../x` put TensorBoard's files outside <output_dir>/tensorboard."""
    name = run_name.replace("/", "_").replace("\\", "_")
    return "_" * len(name) if name in (".", "..") else name or "run"


def purge_step(context: RunContext) -> int:
    """The step from which TensorBoard hides what the run's folder holds: on a new run, an older run of the name; on
    resume, what the first part logged after its checkpoint. That is from the next step, or from the checkpoint's
    own where the first part logged there after the save: its final evaluation, which this part logs again, showed
    twice (found in audit)."""
    if context.resume_step is None:
        return 0
    return context.resume_step if context.kept_at_resume_step is not None else context.resume_step + 1


class TensorBoard(RunMethods, TensorBoardTracker):
    """Event files in <output_dir>/tensorboard/<run name>; the config as text and, at the end, hparams."""

    def __init__(self, context: RunContext, saved: dict):
        self.context = context
        super().__init__(
            saved.get("name", folder_name(context.run_name)),
            str(context.output_dir / "tensorboard"),
            purge_step=purge_step(context),
        )
        self.config: dict = {}

    def start(self) -> None:
        super().start()
        # the checkpoint's own step is hidden whole: its points from before the save are logged again
        for record in self.context.kept_at_resume_step or []:
            self.log(numbers({k: v for k, v in record.items() if k not in ("step", "time")}), step=record["step"])

    def state(self) -> dict:
        return {"name": self.run_name, "logdir": str(Path(self.logging_dir).resolve())}

    def log_config(self, config: dict) -> None:
        # accelerate's store_init_configuration writes hparams into extra timestamped run folders
        self.config = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in config.items()}
        self.writer.add_text("config", markdown_table(["option", "value"], [[k, v] for k, v in self.config.items()]))
        self.writer.flush()

    def log_summary(self, summary: dict, step: int) -> None:
        # the HParams tab: this run's options next to its final numbers
        self.writer.add_hparams(self.config, numbers(summary), run_name=".", global_step=step)

    def log_confusion_matrix(self, name: str, matrix: list[list[int]], labels: list[str], step: int) -> None:
        self.log_table(name, *matrix_rows(matrix, labels), step=step)

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        self.writer.add_text(
            name, markdown_table(header, [[str(v).replace("|", "\\|") for v in row] for row in rows]), global_step=step
        )
        self.writer.flush()

    def log_images(self, name: str, captions: list[str], images: list, grid: Image.Image, step: int) -> None:
        import numpy as np

        self.writer.add_image(name, np.asarray(grid), global_step=step, dataformats="HWC")
        self.writer.add_text(f"{name}/prompts", " | ".join(captions), global_step=step)
        self.writer.flush()


TRACKERS = {"wandb": WandB, "trackio": Trackio, "tensorboard": TensorBoard, "mlflow": MLflow}
