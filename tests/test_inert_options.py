"""Options a run leaves unused get one `note:` each, saying what would make them count; the table behind the
notes (cloudtrain.config.inert) names real options, tasks and enabling values, and covers whole sections."""

import dataclasses

import pytest

from cloudtrain.config import Config, DataConfig, ImagesConfig, ModelConfig, _coerce, build_config, option_fields
from cloudtrain.config.inert import GENERATE, OWN_MODULE, STREAMED, TRAINING, inert_notes, unused
from cloudtrain.config.root import option_default
from cloudtrain.registry_table import STREAMING, TASK_ROWS


def notes(**values) -> list[str]:
    return inert_notes(build_config(values))


def test_lora_options_without_peft_say_peft_enables_them():
    assert notes(lora_r=4, max_steps=1) == ["--lora_r 4 has no effect without --peft lora, dora or qlora"]
    assert notes(lora_r=4, lora_alpha=8, lora_target_modules="q_proj,v_proj") == [
        "--lora_r 4 has no effect without --peft lora, dora or qlora",
        "--lora_alpha 8.0 has no effect without --peft lora, dora or qlora",
        "--lora_target_modules q_proj,v_proj has no effect without --peft lora, dora or qlora",
    ]
    for peft in ("lora", "dora", "qlora"):
        assert notes(peft=peft, lora_r=4) == []
    assert notes(task="text_to_image", peft="lora", lora_r=4) == []  # every task trains adapters


def test_a_classification_run_names_the_tasks_that_read_its_language_model_options():
    said = notes(packing="bfd", chat_template="chatml", beta=0.5, sample_prompts="hello|world")
    assert said == [
        "--packing bfd has no effect on --task classification; it counts for --task causal_lm or sft",
        "--sample_prompts 'hello|world' has no effect on --task classification; it counts for --task causal_lm or sft",
        "--chat_template chatml has no effect on --task classification; it counts for --task sft, dpo or reward",
        "--beta 0.5 has no effect on --task classification; it counts for --task dpo",
    ]


@pytest.mark.parametrize(
    "task, values",
    [
        ("causal_lm", {"packing": "bfd", "sample_prompts": "once upon", "num_sample_prompts": 1, "text_column": "x"}),
        ("question_answering", {"text_column": "q", "text_pair_column": "c", "label_column": "a"}),
        ("sft", {"packing": "bfd", "chat_template": "chatml", "system_prompt": "Be brief.", "train_on_prompt": True}),
        ("dpo", {"beta": 0.5, "chat_template": "chatml", "preference_loss": "ipo", "sample_max_new_tokens": 8}),
        ("dpo", {"preference_loss": "simpo", "simpo_gamma": 0.5}),
        ("reward", {"chosen_column": "good", "rejected_column": "bad", "margin_column": "margin"}),
        ("text_to_image", {"resolution": 256, "validation_prompts": "a dog|a cat", "snr_gamma": 5.0}),
        ("classification", {"report_to": "tensorboard", "tags": "exp1", "project_name": "proj"}),
    ],
)
def test_no_note_where_the_task_reads_the_option(task, values):
    assert notes(task=task, **values) == []


@pytest.mark.parametrize(
    "values, note",
    [
        (
            {"profile_steps": "2:3"},  # no trace, no word (found in audit)
            "--profile_steps 2:3 has no effect without --profile true",
        ),
        ({"tags": "exp1"}, "--tags exp1 has no effect without --report_to TRACKER"),  # silent (found in audit)
        ({"project_name": "proj"}, "--project_name proj has no effect without --report_to TRACKER"),
        (
            {"task": "sft", "text_column": "body"},  # an SFT row is a conversation or a prompt/completion (audit)
            "--text_column body has no effect on --task sft; it counts for --task classification, multi_label, "
            "regression, token_classification, question_answering, seq2seq or causal_lm",
        ),
        (
            {"task": "causal_lm", "label_column": "topic"},
            "--label_column topic has no effect on --task causal_lm; it counts for --task classification, "
            "multi_label, regression, token_classification, question_answering or seq2seq",
        ),
        (
            {"task": "dpo", "sample_prompts": "hi"},  # dpo's sample prompts are its validation pairs'
            "--sample_prompts hi has no effect on --task dpo; it counts for --task causal_lm or sft",
        ),
        (
            {"task": "dpo", "system_prompt": "Be brief."},  # pairs are encoded without one
            "--system_prompt 'Be brief.' has no effect on --task dpo; it counts for --task sft",
        ),
        (
            {"task": "reward", "beta": 0.5},
            "--beta 0.5 has no effect on --task reward; it counts for --task dpo",
        ),
        (
            {"task": "dpo", "simpo_gamma": 2.0},
            "--simpo_gamma 2.0 has no effect without --preference_loss simpo",
        ),
        (  # configs/dpo_r8.yaml precomputes; its own example `make dpo ARGS="--preference_loss simpo"` was refused
            {"task": "dpo", "preference_loss": "simpo", "precompute_reference": True},
            "--precompute_reference true has no effect without --preference_loss sigmoid or ipo",
        ),
        (
            {"task": "causal_lm", "resolution": 256},
            "--resolution 256 has no effect on --task causal_lm; it counts for --task text_to_image",
        ),
        (
            {"task": "causal_lm", "stream_buffer": 16},
            "--stream_buffer 16 has no effect without --streaming true",
        ),
        (
            {"task": "classification", "on_bad_data": "stop"},
            "--on_bad_data stop has no effect on --task classification; it counts for --task causal_lm or sft "
            "with --streaming true",
        ),
        ({"compile_layers": True}, "--compile_layers true has no effect without --torch_compile true"),
        (  # an enabling option that takes any number: named with N
            {"early_stopping_threshold": 0.01},
            "--early_stopping_threshold 0.01 has no effect without --early_stopping_patience N",
        ),
        (  # the anomaly watcher is off: its settings were ignored without a word (audit)
            {"monitoring": False, "on_anomaly": "stop"},
            "--on_anomaly stop has no effect without --monitoring true",
        ),
        (
            {"monitoring": False, "loss_spike_threshold": 3.0},
            "--loss_spike_threshold 3.0 has no effect without --monitoring true",
        ),
        (  # a stream has no stored split to cut (found in audit: the run trained past 10 documents unsaid)
            {"task": "causal_lm", "streaming": True, "max_steps": 5, "max_train_samples": 10},
            "--max_train_samples 10 has no effect without --streaming false",
        ),
        (  # a stream's rows come in its own order (found in audit: ignored without a word)
            {"task": "causal_lm", "streaming": True, "max_steps": 5, "group_by_length": True},
            "--group_by_length true has no effect without --streaming false",
        ),
        (  # pushes during training without a push (found in audit: ignored without a word)
            {"hub_strategy": "every_save"},
            "--hub_strategy every_save has no effect without --push_to_hub true",
        ),
        ({"eval_steps": 2}, "--eval_steps 2 has no effect without --eval_strategy steps"),  # (default: epoch)
        ({"hub_token": "hf_NotShown"}, "--hub_token '<hidden>' has no effect without --push_to_hub true"),
        (  # DreamBooth's class options without prior preservation (found in audit: ignored without a word)
            {"task": "text_to_image", "instance_data_dir": "/d", "instance_prompt": "sks", "class_prompt": "a dog"},
            "--class_prompt 'a dog' has no effect without --with_prior_preservation true",
        ),
        (  # captions come with a --train_data_dir: an enabling folder is named FOLDER
            {"task": "text_to_image", "train_data_dir": "/d", "instance_prompt": "sks"},
            "--instance_prompt sks has no effect without --instance_data_dir FOLDER",
        ),
    ],
)
def test_each_unused_option_is_one_note_saying_what_makes_it_count(values, note):
    assert notes(**values) == [note]


def test_text_to_image_says_it_reads_no_text_length_and_carves_no_validation():
    """Its captions are cut at the text encoders' own length and its evaluation rows are the first images: the
    text tasks' --max_length and --validation_split_percentage went unused without a word (left alone earlier)."""
    assert notes(task="text_to_image", max_length=64, validation_split_percentage=5) == [
        "--max_length 64 has no effect on --task text_to_image; it counts for every other task",
        "--validation_split_percentage 5.0 has no effect on --task text_to_image; it counts for every other task "
        "with --streaming false",
    ]
    for task in TASK_ROWS.keys() - {"text_to_image"}:
        assert notes(task=task, max_length=64, validation_split_percentage=5) == []
    own = unused(TRAINING, Config().to_dict() | {"validation_split_percentage": 5.0}, Config().to_dict(), OWN_MODULE)
    assert own == []  # the Python API's model= carves its validation rows too


def test_hub_options_a_later_push_reads_from_args_json_say_nothing():
    assert notes(hub_model_id="alice/x", hub_private_repo=True, hub_revision="dev") == []  # `push` reads them


def test_streaming_options_count_with_streaming():
    assert notes(task="sft", streaming=True, max_steps=5, stream_buffer=16, on_bad_data="stop") == []
    assert notes(task="causal_lm", streaming=True, max_steps=5, num_train_epochs=5) == [  # (audit)
        "--num_train_epochs 5.0 has no effect without --streaming false"
    ]
    assert notes(early_stopping_patience=2, early_stopping_threshold=0.01) == []


def test_defaults_and_options_given_their_default_value_say_nothing():
    for task in TASK_ROWS:
        assert inert_notes(build_config({"task": task})) == []
    assert notes(lora_r=16, packing="auto", beta=None, resolution=512) == []  # the defaults, given explicitly
    assert inert_notes(Config()) == []


def test_a_task_registered_at_run_time_gets_only_the_enabling_notes():
    """An extension's task may read any option: only what another option enables is said."""
    values = Config().to_dict() | {"packing": "bfd", "lora_r": 4}
    defaults = Config().to_dict()
    assert unused(TRAINING, values, defaults, task="my_own_task") == [
        "--lora_r 4 has no effect without --peft lora, dora or qlora"
    ]


def test_generate_sampling_options_need_do_sample():
    defaults = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    greedy = {"do_sample": False, "temperature": 0.5, "top_k": 50, "top_p": 0.9}
    assert unused(GENERATE, greedy, defaults) == [
        "--temperature 0.5 has no effect without --do_sample true",
        "--top_p 0.9 has no effect without --do_sample true",
    ]
    assert unused(GENERATE, {**greedy, "do_sample": True}, defaults) == []


def test_the_table_names_real_options_tasks_and_enabling_values():
    fields = option_fields()
    for name, use in TRAINING.items():
        assert name in fields, name
        assert set(use.tasks) <= set(TASK_ROWS), (name, use.tasks)
        if use.needs:
            # without values, on at any value but its default: one meaning off (None, or --report_to none)
            off = option_default(fields[use.needs][1]) in (None, ["none"])
            assert use.needs in fields and (use.values or off), name
            for value in use.values:  # each enabling value is one the enabling option takes
                assert _coerce(use.needs, value) == value, (name, use.needs, value)


def test_the_table_covers_whole_sections_and_every_streaming_option():
    """Derived from the config: every text-to-image option, every LoRA option, and every data option whose help
    says it is streaming's, so a new one is covered without an edit here."""
    assert {f.name for f in dataclasses.fields(ImagesConfig)} <= {
        n for n, u in TRAINING.items() if u.tasks == ("text_to_image",)
    }
    assert {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")} <= {
        n for n, u in TRAINING.items() if u.needs == "peft"
    }
    streaming_help = {f.name for f in dataclasses.fields(DataConfig) if f.metadata["help"].startswith("Streaming")}
    assert streaming_help and streaming_help == {n for n, u in TRAINING.items() if u == STREAMED}
    assert STREAMED.tasks == tuple(STREAMING)


def test_a_streaming_task_reads_every_data_option_its_stream_encoder_takes():
    """The tasks' own list of what their stream encoder reads (Task.stream_options) agrees with the table."""
    from cloudtrain.registry import TASKS

    for cls in TASKS:
        if cls.streams_data:
            for name in cls.stream_options:
                use = TRAINING.get(name)
                assert use is None or not use.tasks or cls.name in use.tasks, (cls.name, name)


@pytest.mark.slow
def test_train_from_python_prints_the_notes_as_the_command_line_does(tiny_model_dir, topic_csvs, tmp_path, capsys):
    from cloudtrain import train

    files = {"train_file": str(topic_csvs["train"]), "validation_file": str(topic_csvs["validation"])}
    train(
        {
            "model_name_or_path": tiny_model_dir,
            **files,
            "output_dir": str(tmp_path / "out"),
            "max_steps": 1,
            "lora_r": 4,
        }
    )
    said = capsys.readouterr().out
    assert said.count("note: --lora_r 4 has no effect without --peft lora, dora or qlora") == 1
    assert said.index("note: --lora_r") < said.index("trained 1 step in")  # before the work, as on the command line
