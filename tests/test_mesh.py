"""The mesh: how each trainer arranges a launch's processes, and checkpoints that resume only on the same one."""

import pytest

from cloudtrain.checkpointing import check_compatible
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.registry import TRAINERS


@pytest.mark.parametrize(
    "options, processes, expected",
    [
        ({"training_type": "basic"}, 1, Mesh(world=1, dp_replicate=1)),
        ({"training_type": "accelerated"}, 4, Mesh(world=4, dp_replicate=4)),
        ({"training_type": "accelerated", "zero_stage": 2}, 4, Mesh(world=4, dp_shard=4)),
        ({"training_type": "accelerated", "zero_stage": 0}, 2, Mesh(world=2, dp_replicate=2)),
        ({"training_type": "pipeline", "pipeline_parallel_size": 2}, 4, Mesh(world=4, dp_replicate=2, pp=2)),
    ],
)
def test_each_trainer_arranges_its_processes(options, processes, expected):
    cfg = build_config(options)
    mesh = TRAINERS[cfg.training.training_type].mesh(cfg, processes)
    assert mesh == expected and mesh.fits
    assert mesh.data_parallel * mesh.pp == processes


def test_a_pipeline_launch_that_does_not_fit_is_seen():
    cfg = build_config({"training_type": "pipeline", "pipeline_parallel_size": 2})
    assert not TRAINERS["pipeline"].mesh(cfg, 3).fits
    assert not TRAINERS["pipeline"].mesh(cfg, 1).fits


def test_a_checkpoint_resumes_only_on_the_mesh_that_wrote_it(tmp_path):
    ddp, zero = Mesh(world=2, dp_replicate=2), Mesh(world=2, dp_shard=2)
    meta = {"trainer": "AcceleratedTrainer", "num_processes": 2, "mesh": zero.degrees()}
    check_compatible(meta, tmp_path, "AcceleratedTrainer", zero)
    with pytest.raises(UserError) as refused:
        check_compatible(meta, tmp_path, "AcceleratedTrainer", ddp)
    assert str(refused.value) == (
        f"checkpoint {tmp_path} was written with its 2 processes arranged as sharded 2; this run arranges them as "
        "replicated 2: resume with --fsdp true or the --zero_stage it was written with (states sharded over 2 "
        "processes)"
    )
    # the options that differ are named, not "the same options" with the two layouts as dicts (audit)
    tensor = {**meta, "mesh": Mesh(world=2, tp=2).degrees()}
    with pytest.raises(
        UserError, match="arranged as tensor 2; .* as replicated 2: resume with --tensor_parallel_size 2$"
    ):
        check_compatible(tensor, tmp_path, "AcceleratedTrainer", ddp)
    pipeline = {**meta, "mesh": Mesh(world=2, dp_replicate=2).degrees()}
    with pytest.raises(UserError, match="resume with --pipeline_parallel_size 1$"):
        check_compatible(pipeline, tmp_path, "AcceleratedTrainer", Mesh(world=2, pp=2))
    with pytest.raises(UserError, match="with 2 process\\(es\\); this run is the AcceleratedTrainer with 4"):
        check_compatible(meta, tmp_path, "AcceleratedTrainer", Mesh(world=4, dp_shard=4))
    hybrid = {**meta, "num_processes": 4, "mesh": Mesh(world=4, dp_replicate=2, dp_shard=2).degrees()}
    with pytest.raises(UserError, match="resume with --fsdp_sharding_strategy hybrid_shard over 2 nodes \\(states"):
        check_compatible(
            hybrid, tmp_path, "AcceleratedTrainer", Mesh(world=4, dp_shard=4)
        )  # not "--fsdp true" (review)
    older = {"trainer": "AcceleratedTrainer", "num_processes": 2}  # written before meshes were stored
    check_compatible(older, tmp_path, "AcceleratedTrainer", ddp)


def test_options_of_another_trainer_are_refused_by_name():
    cfg = build_config({"training_type": "basic", "pipeline_microbatches": 8})
    message = "--pipeline_microbatches needs --training_type pipeline \\(this run is basic\\)"
    with pytest.raises(UserError, match=message):
        TRAINERS["basic"].check_options(cfg, None)
