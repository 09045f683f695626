"""The registries: a task or trainer is one class registered once by name, and every choice, default and help
text that names tasks or trainers is read from its row in cloudtrain.registry_table, which says what the
class says (checked here and at registration)."""

import pytest

from cloudtrain.config import _help, build_config, option_fields
from cloudtrain.errors import UserError
from cloudtrain.registry import TASKS, TRAINERS, row_of
from cloudtrain.registry_table import STREAMING
from cloudtrain.tasks import build_task
from cloudtrain.tasks.base import DecoderTask
from cloudtrain.tasks.classification import ClassificationTask


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test are gone after it."""
    monkeypatch.setattr(TASKS, "_classes", dict(TASKS._loaded()))


def test_a_new_task_is_one_class_and_its_registration(scratch_registry):
    @TASKS.register
    class BalancedClassification(ClassificationTask):  # the worked example of docs/extending.md
        name = "balanced_classification"
        summary = "text -> label, the best checkpoint by macro F1"
        default_best_metric = "macro_f1"

    cfg = build_config({"task": "balanced_classification"})
    assert isinstance(build_task(cfg), BalancedClassification)
    assert "balanced_classification: text -> label, the best checkpoint by macro F1" in _help(
        option_fields()["task"][1]
    )
    assert "macro_f1 for balanced_classification" in _help(option_fields()["metric_for_best_model"][1])
    from cloudtrain.pipeline import resolve

    assert resolve(cfg, build_task(cfg)).checkpoint.metric_for_best_model == "macro_f1"


def test_a_name_is_registered_once(scratch_registry):
    class Impostor(ClassificationTask):
        name = "classification"

    with pytest.raises(ValueError, match="registered twice"):
        TASKS.register(Impostor)


def test_the_parser_table_is_exactly_the_registered_classes():
    """Every registered class has its row, the same summary, metrics and best-metric default, in --help's
    order, and there is no row without a class: the parser can't describe or accept something else."""
    for registry in (TASKS, TRAINERS):
        classes = registry._loaded()
        assert [(name, row_of(cls)) for name, cls in classes.items()] == list(registry.table.items())
        assert all(cls.name == name for name, cls in classes.items())


def test_a_class_that_differs_from_its_row_is_refused(monkeypatch):
    monkeypatch.setattr(TASKS, "_classes", {})

    class Relabelled(ClassificationTask):
        summary = "text -> one of many labels"

    with pytest.raises(ValueError, match="'classification'.*differs from its row in cloudtrain/registry_table.py"):
        TASKS.register(Relabelled)


def test_unknown_names_are_refused_with_the_registered_choices():
    with pytest.raises(UserError, match="--task: 'translation' is not one of classification, multi_label, regression"):
        build_config({"task": "translation"})
    with pytest.raises(KeyError, match="--training_type 'turbo' is not one of basic, accelerated, pipeline"):
        TRAINERS["turbo"]


def test_the_language_model_tasks_are_the_decoder_tasks():
    assert [c.name for c in TASKS if issubclass(c, DecoderTask)] == ["causal_lm", "sft", "dpo"]
    assert [c.name for c in TASKS if c.chat_template] == ["sft", "dpo"]


STORED_ROW_TASKS = sorted(name for name, cls in TASKS._loaded().items() if not cls.streams_data)


def test_the_language_model_tasks_stream_and_the_others_read_stored_rows():
    streaming = {name for name, cls in TASKS._loaded().items() if cls.streams_data}
    assert streaming == {"causal_lm", "sft"}


def test_the_streaming_table_is_what_the_streaming_classes_say():
    """`cloudtrain preprocess` offers and checks tasks by registry_table.STREAMING, without importing them."""
    classes = TASKS._loaded()
    assert {name: cls.stream_records for name, cls in classes.items() if cls.streams_data} == STREAMING
    assert list(STREAMING) == [name for name, cls in classes.items() if cls.streams_data]  # in --help's order


@pytest.mark.parametrize("name", STORED_ROW_TASKS)
def test_streaming_is_refused_first_for_a_task_that_reads_stored_rows(name, tmp_path):
    """A task without its own stream would train on one sample record per source: refused before anything."""
    from cloudtrain.pipeline import preflight

    cfg = build_config({"task": name, "streaming": True, "output_dir": str(tmp_path / "out")})
    with pytest.raises(UserError, match=f"^--streaming true streams --task causal_lm and sft, not --task {name}: "):
        preflight(cfg, build_task(cfg))
    assert not (tmp_path / "out").exists()
