"""pixelsac/checkpoint.py: finding, safely loading and validating checkpoints, and the counters
they record -- on checkpoints written here by hand (no training), each refusal one clear line."""

from __future__ import annotations

import pickle

import pytest
import torch
from test_module import ACTION_DIM, OBS_SHAPE, make_module

from pixelsac import checkpoint as ckpt
from pixelsac.checkpoint import CheckpointError
from pixelsac.module import SACModule


class NotAllowed:
    """A class weights-only unpickling refuses."""


def written(
    module: SACModule,
    env_frames: int = 40,
    world_size: int | None = 2,
    callback_key: str = "Checkpointer",
    version: int = ckpt.FORMAT_VERSION,
) -> dict:
    """What Lightning writes for ``module``: the module's hooks and the Checkpointer's state."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "callbacks": {}}
    module.updates = 7
    module.on_save_checkpoint(checkpoint)
    checkpoint["pixelsac"]["format"] = version
    collector = {"env_frames": env_frames, "at_episode_boundary": True}
    if world_size is not None:
        collector["world_size"] = world_size
    checkpoint["callbacks"][callback_key] = {"collector": collector}
    checkpoint["callbacks"]["Evaluator"] = {"last_eval_frames": env_frames * (world_size or 1)}
    return checkpoint


def test_resolve_a_run_directory_prefers_and_falls_back(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(b"x")
    assert ckpt.resolve(tmp_path / "run") == folder / "last.ckpt"  # best asked for, last is what there is
    (folder / "best.ckpt").write_bytes(b"x")
    assert ckpt.resolve(tmp_path / "run") == folder / "best.ckpt"
    assert ckpt.resolve(tmp_path / "run", prefer="last") == folder / "last.ckpt"
    assert ckpt.in_run_dir(tmp_path / "run") == folder / "last.ckpt"
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.resolve(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        ckpt.resolve(tmp_path)


def test_a_written_checkpoint_loads_and_rebuilds_the_agent(tmp_path):
    module = make_module("precision=fp16")
    checkpoint = written(module)
    torch.save(checkpoint, tmp_path / "a.ckpt")
    loaded = ckpt.load(tmp_path / "a.ckpt")
    rebuilt = SACModule.from_checkpoint(loaded)
    assert not rebuilt.training and rebuilt.updates == 7
    for (name, a), (_, b) in zip(module.state_dict().items(), rebuilt.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ckpt.saved_counters(loaded) == {"env_frames": 80, "world_size": 2, "updates": 7}
    point = ckpt.resume_point(tmp_path / "a.ckpt", loaded)
    assert point.env_frames == 80 and point.world_size == 2 and point.exact and point.final_eval_done
    assert point.finished(80) and not point.finished(81)


def test_counters_of_older_checkpoints_and_keyed_callback_states():
    checkpoint = written(make_module(), env_frames=12, world_size=None, callback_key="Checkpointer{'every': 1}")
    assert ckpt.callback_state(checkpoint, "Checkpointer") == checkpoint["callbacks"]["Checkpointer{'every': 1}"]
    assert ckpt.callback_state(checkpoint, "Check") is None  # a prefix of another name is not that name
    assert ckpt.saved_counters(checkpoint) == {"env_frames": 12, "world_size": None, "updates": 7}
    assert ckpt.saved_counters({"state_dict": {}}) == {"env_frames": None, "world_size": None, "updates": None}
    with pytest.raises(CheckpointError, match="holds no training state"):
        ckpt.resume_point("x.ckpt", {"state_dict": {}})


@pytest.mark.parametrize(
    "content,message",
    [
        (b"not a zip at all", "is not a readable checkpoint, or is truncated"),
        ("truncated", "is not a readable checkpoint, or is truncated"),
        ("pickled", "holds pickled Python objects"),
        ("not ours", "not one written by pixelsac"),
        ("no state_dict", "is not a Lightning checkpoint"),
        ("future", "has checkpoint format 99; this pixelsac reads formats 1 and 2"),
    ],
)
def test_unusable_files_are_refused_in_one_line(tmp_path, content, message):
    file = tmp_path / "bad.ckpt"
    if content == "truncated":
        torch.save(written(make_module()), file)
        file.write_bytes(file.read_bytes()[:500])
    elif content == "pickled":
        torch.save({"state_dict": {}, "thing": NotAllowed()}, file)
    elif content == "not ours":
        torch.save({"state_dict": {}}, file)
    elif content == "no state_dict":
        torch.save({"weights": torch.zeros(1)}, file)
    elif content == "future":
        torch.save(written(make_module(), version=99), file)
    else:
        file.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        ckpt.load(file)
    assert "\n" not in str(info.value)


def test_pickled_objects_load_only_when_trusted(tmp_path):
    checkpoint = written(make_module())
    checkpoint["extra"] = NotAllowed()
    torch.save(checkpoint, tmp_path / "p.ckpt")
    with pytest.raises(CheckpointError, match="trust_checkpoint=true"):
        ckpt.load(tmp_path / "p.ckpt")
    assert isinstance(ckpt.load(tmp_path / "p.ckpt", trust=True)["extra"], NotAllowed)
    with pytest.raises(pickle.UnpicklingError):  # what torch itself says, for comparison
        torch.load(tmp_path / "p.ckpt", weights_only=True)


def test_weights_that_do_not_fit_the_config_are_a_checkpoint_error():
    checkpoint = written(make_module())
    checkpoint["hyper_parameters"] = {
        **checkpoint["hyper_parameters"],
        "obs_shape": [OBS_SHAPE[0], 32, 32],
        "action_dim": ACTION_DIM,
    }
    with pytest.raises(CheckpointError, match="do not fit the network its config describes"):
        SACModule.from_checkpoint(checkpoint)


def _replay_file(path, owner):
    contents = {"buffers": [{"format_version": 1}]}
    if owner is not None:
        contents[ckpt.REPLAY_OWNER] = owner
    torch.save(contents, path)
    return path


@pytest.mark.parametrize(
    "found,message",
    [
        (None, "does not say which run wrote it"),
        (ckpt.replay_owner("b" * 32, 20, 0), f"belongs to another run (run {'b' * 32}; the checkpoint is run"),
        (
            ckpt.replay_owner("a" * 32, 12, 0),
            "holds rank 0's replay at agent step 12; the checkpoint was saved at agent step 20",
        ),
        (ckpt.replay_owner("a" * 32, 20, 1), "holds rank 1's replay at agent step 20"),
    ],
)
def test_a_replay_file_that_is_not_its_checkpoints_is_refused_in_one_line(tmp_path, found, message):
    path = _replay_file(tmp_path / "replay-0000000020.pt", found)
    with pytest.raises(CheckpointError) as caught:
        ckpt.load_replay(path, tmp_path / "last.ckpt", ckpt.replay_owner("a" * 32, 20, 0))
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_replay_file_of_its_checkpoint_loads_and_one_from_before_run_ids_is_taken_as_it_is(tmp_path):
    owner = ckpt.replay_owner("a" * 32, 20, 0)
    mine = ckpt.load_replay(_replay_file(tmp_path / "mine.pt", owner), tmp_path / "last.ckpt", owner)
    assert mine[ckpt.REPLAY_OWNER] == owner
    older = ckpt.load_replay(_replay_file(tmp_path / "older.pt", None), tmp_path / "last.ckpt", None)
    assert ckpt.REPLAY_OWNER not in older
