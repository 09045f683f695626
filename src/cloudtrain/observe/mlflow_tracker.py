"""The MLflow tracker of cloudtrain.observe.tracking: a run in $MLFLOW_TRACKING_URI, else in a SQLite database
inside the output folder."""

import logging
import os
from pathlib import Path

from accelerate.tracking import MLflowTracker
from PIL import Image

from cloudtrain.errors import UserError, first_line
from cloudtrain.observe.tracker_base import RunContext, RunMethods, reachable, without_userinfo
from cloudtrain.redact import MASK, mask

MLFLOW_CONNECT_TIMEOUT_S = 5.0  # a server that answers nothing in this long: MLflow would retry for minutes
# MLflow's HTTP retries, unless the user set them: its own (7 retries, 120 s each) spend minutes on a server gone down
# mid-run before the tracker fails and is dropped; these, seconds (a refused connection) to about half a minute.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def check_mlflow_store(uri: str, source: str) -> None:
    """One line where MLflow's store cannot be used, before MLflow retries for minutes and ends in a traceback: a
    server that cannot be reached, or a SQLite database in a folder that cannot be made or written (MLflow makes
    the missing folders). `source`: where the URI came from, for the remedy."""
    if uri.startswith(("http://", "https://")) and not reachable(uri, MLFLOW_CONNECT_TIMEOUT_S):
        raise UserError(f"MLflow at {mask(uri)} ({source}) cannot be reached within {MLFLOW_CONNECT_TIMEOUT_S:.0f} s: "
                        "start its server, or change the URI")  # fmt: skip
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        existing = next(f for f in (folder, *folder.parents) if f.exists())
        if not (existing.is_dir() and os.access(existing, os.W_OK)):
            raise UserError(f"MLflow's database {uri} ({source}) cannot be written: {existing} is no folder this "
                            "process can write; change the URI")  # fmt: skip


def check_mlflow_server(report_to: list[str]) -> None:
    """The store MLFLOW_TRACKING_URI names, checked before the data and the model load: the tracker checks it
    again when it starts, which is after both (a run refused after minutes of loading; found in audit)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if "mlflow" in report_to and uri:
        check_mlflow_store(uri, "MLFLOW_TRACKING_URI")


class MLflow(RunMethods, MLflowTracker):
    """An MLflow run in $MLFLOW_TRACKING_URI, else in a SQLite database inside the output folder."""

    def __init__(self, context: RunContext, saved: dict):
        import mlflow

        # its INFO lines as it makes the output folder's database ("Creating initial MLflow database tables...")
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        store = context.output_dir / "mlruns"
        store.mkdir(exist_ok=True)
        local = f"sqlite:///{(store / 'mlflow.db').resolve()}"
        saved_uri = saved.get("tracking_uri")
        if saved_uri and f"://{MASK}@" in saved_uri:  # its password is not kept: MLFLOW_TRACKING_USERNAME/PASSWORD
            saved_uri = without_userinfo(saved_uri)
        sources = [
            (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"),
            (saved_uri, "the resumed run's tracker_runs.json"),
            (local, "the output folder's"),
        ]
        self.tracking_uri, source = next((uri, source) for uri, source in sources if uri)
        check_mlflow_store(self.tracking_uri, source)
        if self.tracking_uri.startswith(("http://", "https://")):
            for name, value in MLFLOW_HTTP_DEFAULTS.items():
                os.environ.setdefault(name, value)
        if without_userinfo(self.tracking_uri) != self.tracking_uri:  # MLflow prints "View run at <URI>", password too
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        mlflow.set_tracking_uri(self.tracking_uri)
        run_id = saved.get("run_id")
        if run_id and not self._exists(run_id):  # a spot restart into an emptied output folder: its store went too
            print(
                f"note: MLflow run {run_id} is not in {mask(self.tracking_uri)} any more (the store was emptied or "
                "replaced since the checkpoint); this part of the run logs to a new MLflow run",
                flush=True,
            )
            run_id = None
        self.resumed = run_id is not None
        super().__init__(
            experiment_name=context.tracking.project_name,
            # the artifacts of a new experiment: beside the output folder's own store; any other store (a server)
            # keeps its own artifact root (all later runs' artifacts went to the first run's folder; found in audit)
            logging_dir=str((store / "artifacts").resolve()) if self.tracking_uri == local else None,
            run_id=run_id,
            tags={tag: "true" for tag in context.tracking.tags} or None,
            run_name=context.run_name,
        )

    def _exists(self, run_id: str) -> bool:
        """Whether the store holds the run; a store that does not answer is the run's error, not a lost run."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(self.tracking_uri).get_run(run_id)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise UserError(
                f"MLflow at {mask(self.tracking_uri)} could not be asked for run {run_id} ({mask(first_line(err))}); "
                "start its server or check MLFLOW_TRACKING_URI, then resume again",
                transient=True,
            ) from None
        return True

    def state(self) -> dict:
        # a password in the URI is not stored (found in audit): a resume takes it from MLFLOW_TRACKING_URI again
        return {"run_id": self.active_run.info.run_id, "tracking_uri": mask(self.tracking_uri)}

    def log_config(self, config: dict) -> None:
        if not self.resumed:  # MLflow parameters cannot change once logged; the first part logged them
            super().log_config(config)

    def log_confusion_matrix(self, name: str, matrix: list[list[int]], labels: list[str], step: int) -> None:
        import mlflow

        mlflow.log_dict({"labels": labels, "rows_true_columns_predicted": matrix}, f"{name}.json")

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        import mlflow

        mlflow.log_dict({"columns": header, "data": rows}, f"{name}-step{step}.json")

    def log_images(self, name: str, captions: list[str], images: list, grid: Image.Image, step: int) -> None:
        import mlflow

        mlflow.log_image(grid, f"{name}-step{step}.png")

    def log_files(self, curves_png: Path, step: int) -> None:
        self.log_artifact(str(curves_png))
