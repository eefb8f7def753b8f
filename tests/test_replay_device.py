"""Replay placement: a ring stored as torch tensors on a device (here "cpu", the same code path as
"cuda:0" but for the pinned upload) must sample exactly what the host numpy ring samples for the
same history and seed; its saved state must be the host format; pinned batches need CUDA; and
``replay.device`` / ``replay.pin_memory`` are checked as one-line configuration errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pixelsac.config import ConfigError, load_config
from pixelsac.replay import ReplayBuffer, ReplaySet, replay_placement

# (agent steps, ends by termination): one- and two-step episodes are shorter than a 3-frame stack,
# so stacks are clamped at episode starts on both obs and next_obs.
EPISODES = [(5, False), (1, True), (2, False), (7, True), (3, False), (1, False), (4, True), (6, False)]
ACTION_DIM = 2
KEYS = ("obs", "action", "reward", "not_terminal", "next_obs")


def random_frame(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    return rng.standard_normal(shape)  # float64: both placements cast it to float32 on write


def fill(buffers: list, shape: tuple[int, ...], dtype, rounds: int = 1, num_envs: int | None = None) -> None:
    """The same random history into every buffer (ReplayBuffers, or ReplaySets of num_envs rings)."""
    rng = np.random.default_rng(7)
    envs = [None] if num_envs is None else list(range(num_envs))

    def call(method: str, env, *args) -> None:
        for buffer in buffers:
            getattr(buffer, method)(*(args if env is None else (env, *args)))

    for _ in range(rounds):
        for length, ends_terminal in EPISODES:
            for env in envs:
                call("add_first", env, random_frame(rng, shape, dtype))
            for step in range(length):
                for env in envs:
                    action = rng.uniform(-1, 1, size=ACTION_DIM)  # float64, cast on write
                    terminal = ends_terminal and step == length - 1
                    call("add", env, action, float(rng.standard_normal()), terminal, random_frame(rng, shape, dtype))


def assert_same_batches(host, device_buffer, batch_size: int = 64, seeds=range(4)) -> None:
    for seed in seeds:
        expected = host.sample(batch_size, np.random.default_rng(seed))
        got = device_buffer.sample(batch_size, np.random.default_rng(seed))
        assert tuple(got) == KEYS
        for key in KEYS:
            assert got[key].device == torch.device("cpu")
            assert got[key].dtype == expected[key].dtype, key
            assert got[key].shape == expected[key].shape, key
            assert got[key].is_contiguous(), key
            assert torch.equal(got[key], expected[key]), f"{key} differs for seed {seed}"


@pytest.mark.parametrize(
    "shape,dtype,stack,capacity,rounds",
    [
        ((3, 6, 6), np.uint8, 3, 200, 1),  # pixels, no wrap-around
        ((3, 6, 6), np.uint8, 3, 23, 3),  # pixels, the ring wraps several times
        ((3, 6, 6), np.uint8, 1, 17, 2),  # one-frame stacks, wrapped
        ((5,), np.float32, 3, 19, 2),  # state vectors, wrapped
        ((5,), np.float32, 1, 200, 1),
    ],
)
def test_device_ring_samples_what_the_host_ring_samples(shape, dtype, stack, capacity, rounds):
    host = ReplayBuffer(capacity, shape, dtype, stack, ACTION_DIM)
    on_device = ReplayBuffer(capacity, shape, dtype, stack, ACTION_DIM, device="cpu")
    fill([host, on_device], shape, dtype, rounds)
    assert isinstance(on_device._frames, torch.Tensor) and isinstance(host._frames, np.ndarray)
    assert len(on_device) == len(host) > 0
    assert_same_batches(host, on_device)


def test_device_ring_matches_after_each_write():
    """Sampled while it fills, including right after episode starts (the rejected slots)."""
    shape = (2, 4, 4)
    host = ReplayBuffer(13, shape, np.uint8, 3, ACTION_DIM)
    on_device = ReplayBuffer(13, shape, np.uint8, 3, ACTION_DIM, device="cpu")
    rng = np.random.default_rng(3)
    for episode, (length, ends_terminal) in enumerate(EPISODES * 2):
        frame = random_frame(rng, shape, np.uint8)
        host.add_first(frame)
        on_device.add_first(frame)
        for step in range(length):
            args = (
                rng.uniform(-1, 1, ACTION_DIM),
                float(rng.standard_normal()),
                ends_terminal and step == length - 1,
                random_frame(rng, shape, np.uint8),
            )
            host.add(*args)
            on_device.add(*args)
            assert_same_batches(host, on_device, batch_size=16, seeds=[episode * 100 + step])


def test_device_samples_differ_from_a_different_history():
    """The comparison above can fail: one changed reward shows up in the device batch."""
    shape = (3, 6, 6)
    host = ReplayBuffer(200, shape, np.uint8, 3, ACTION_DIM)
    on_device = ReplayBuffer(200, shape, np.uint8, 3, ACTION_DIM, device="cpu")
    fill([host, on_device], shape, np.uint8)
    on_device._rewards[on_device._rewards != 0] += 1.0
    with pytest.raises(AssertionError, match="reward differs"):
        assert_same_batches(host, on_device)


@pytest.mark.parametrize("num_envs", [1, 3])
def test_replay_set_of_device_rings_matches_host_set(num_envs):
    shape = (3, 5, 5)
    host = ReplaySet(num_envs, 90, shape, np.uint8, 3, ACTION_DIM)
    on_device = ReplaySet(num_envs, 90, shape, np.uint8, 3, ACTION_DIM, device="cpu")
    fill([host, on_device], shape, np.uint8, rounds=2, num_envs=num_envs)
    assert on_device.device == torch.device("cpu") and host.device is None
    assert all(b.device == torch.device("cpu") for b in on_device.buffers)
    assert_same_batches(host, on_device, batch_size=50)


def sample_each_ring(replay: ReplaySet, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """What a set of rings samples, written as its definition: the multinomial split over the
    rings' sizes, each ring's own sample of its share in ring order, concatenated."""
    sizes = np.array([len(b) for b in replay.buffers], dtype=np.float64)
    counts = rng.multinomial(batch_size, sizes / sizes.sum())
    parts = [b.sample(int(n), rng) for b, n in zip(replay.buffers, counts) if n > 0]
    return {key: torch.cat([part[key] for part in parts]) for key in KEYS}


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("shape,dtype", [((3, 5, 5), np.uint8), ((4,), np.float32)])
def test_replay_set_gathers_what_its_rings_sample_one_by_one(device, shape, dtype):
    """One gather from the rings' joint storage gives each ring's own sample, concatenated in
    ring order, for the same random stream (the rings wrap: 90 slots, 30 a ring, two rounds)."""
    replay = ReplaySet(3, 90, shape, dtype, 3, ACTION_DIM, device=device)
    fill([replay], shape, dtype, rounds=2, num_envs=3)
    assert all(len(b) > 0 for b in replay.buffers)
    for seed in range(6):
        expected = sample_each_ring(replay, 40, np.random.default_rng(seed))
        got = replay.sample(40, np.random.default_rng(seed))
        assert tuple(got) == KEYS
        for key in KEYS:
            assert got[key].is_contiguous() and got[key].dtype == expected[key].dtype, key
            assert torch.equal(got[key], expected[key]), f"{key} differs for seed {seed}"
    shifted = sample_each_ring(replay, 40, np.random.default_rng(0))
    replay.buffers[1]._rewards[:] += 1.0  # the rings' storage is the joint storage: the batch sees it
    assert not torch.equal(replay.sample(40, np.random.default_rng(0))["reward"], shifted["reward"])
    with pytest.raises(ValueError, match="batch_size"):
        replay.sample(0, np.random.default_rng(0))


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 20, (2,), np.float32, 1, 1), "num_envs"),
        ((2, 0, (2,), np.float32, 1, 1), "capacity"),
        ((2, 6, (2,), np.float32, 3, 1), "too small"),
        ((2, 20, (2,), np.float32, 0, 1), "frame_stack"),
        ((2, 20, (2,), np.float32, 1, 0), "action_dim"),
        ((2, 20, (-1, 2), np.float32, 1, 1), "frame_shape needs positive sizes"),
        ((2, 20, (), np.float32, 1, 1), "frame_shape needs positive sizes"),
    ],
)
def test_replay_set_constructor_errors(args, match):
    """Checked before the joint storage is allocated: one line saying which argument."""
    with pytest.raises(ValueError, match=match):
        ReplaySet(*args)


def test_a_batch_of_many_rings_costs_the_ops_of_one():
    """A device ring's batch is a few gathers (one upload of the slot numbers, the frames,
    actions, rewards, terminals), whatever the number of rings: on a GPU each op a kernel. Per
    ring and concatenated, four rings dispatched 70 ops and 33 kernels where one dispatched 15
    and 7."""
    from dispatch_count import DispatchCount

    counts = {}
    for num_envs in (1, 4):
        replay = ReplaySet(num_envs, 120, (3, 5, 5), np.uint8, 3, ACTION_DIM, device="cpu")
        fill([replay], (3, 5, 5), np.uint8, num_envs=num_envs)
        with DispatchCount() as count:
            replay.sample(32, np.random.default_rng(0))
        counts[num_envs] = (count.total, count.kernels)
    assert counts[4] == counts[1], counts


def test_sizes_and_description_say_where_the_ring_lives():
    shape = (3, 84, 84)
    host = ReplaySet(2, 40, shape, np.uint8, 3, 6)
    on_device = ReplaySet(2, 40, shape, np.uint8, 3, 6, device="cpu")
    # 21,198 B per slot in both placements (frames, action, reward, terminal; the first flag on the host)
    assert host.nbytes == on_device.nbytes == 40 * 21_198
    assert on_device.bytes_per_transition == host.bytes_per_transition
    assert "on cpu" in on_device.describe() and "2 rings" in on_device.describe()
    assert " on " not in host.describe() and "stored once, stacks of 3" in host.describe()


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            other = b[key]
            assert isinstance(other, torch.Tensor) and other.device == torch.device("cpu")
            assert value.dtype == other.dtype and torch.equal(value, other), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("shape,dtype", [((3, 6, 6), np.uint8), ((5,), np.float32)])
def test_state_dict_round_trips_host_device_host(shape, dtype):
    host = ReplayBuffer(23, shape, dtype, 3, ACTION_DIM)
    fill([host], shape, dtype, rounds=2)  # wrapped: every slot filled
    saved = host.state_dict()

    on_device = ReplayBuffer(23, shape, dtype, 3, ACTION_DIM, device="cpu")
    on_device.load_state_dict(saved)
    from_device = on_device.state_dict()
    assert_same_state(saved, from_device)
    assert all(
        not np.shares_memory(from_device[k].numpy(), on_device._frames.numpy()) for k in ("frames",)
    )  # a copy, not a view of the live ring

    back = ReplayBuffer(23, shape, dtype, 3, ACTION_DIM)
    back.load_state_dict(from_device)
    assert_same_state(saved, back.state_dict())
    assert_same_batches(host, on_device)
    assert_same_batches(host, back)


def test_partly_filled_state_loads_into_a_used_device_ring():
    """Loading clears slots past the saved ones, as the host buffer does."""
    shape = (3, 6, 6)
    small = ReplayBuffer(60, shape, np.uint8, 3, ACTION_DIM)
    small.add_first(np.full(shape, 9, np.uint8))
    small.add(np.zeros(ACTION_DIM), 1.0, False, np.full(shape, 8, np.uint8))
    on_device = ReplayBuffer(60, shape, np.uint8, 3, ACTION_DIM, device="cpu")
    fill([on_device], shape, np.uint8)
    on_device.load_state_dict(small.state_dict())
    assert len(on_device) == 1
    assert int(on_device._frames[2:].count_nonzero()) == 0 and int(on_device._rewards[2:].count_nonzero()) == 0
    assert_same_state(small.state_dict(), on_device.state_dict())


def test_bad_state_leaves_the_device_ring_unchanged():
    shape = (3, 6, 6)
    on_device = ReplayBuffer(40, shape, np.uint8, 3, ACTION_DIM, device="cpu")
    fill([on_device], shape, np.uint8)
    before = on_device.state_dict()
    state = dict(before, actions=before["actions"].double())
    with pytest.raises(ValueError, match="'actions' is float64"):
        on_device.load_state_dict(state)
    assert_same_state(before, on_device.state_dict())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only torch")
def test_pin_memory_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        ReplayBuffer(10, (4,), np.float32, 1, 1, pin_memory=True)
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        ReplaySet(2, 20, (4,), np.float32, 1, 1, pin_memory=True)


def test_pin_memory_with_device_storage_is_refused():
    with pytest.raises(ValueError, match="pin_memory applies to host storage"):
        ReplayBuffer(10, (4,), np.float32, 1, 1, device="cpu", pin_memory=True)


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("value", ["bogus", "gpu", "cuda:x", "cuda0"])
def test_unknown_replay_device_is_one_line(value):
    with pytest.raises(ConfigError) as info:
        load_config([f"replay.device={value}"])
    message = str(info.value)
    assert f"replay.device={value!r}" in message and "auto" in message and "\n" not in message


def test_replay_settings_parse_and_default_to_null():
    cfg = load_config([])
    assert cfg.replay.device is None and cfg.replay.pin_memory is None
    cfg = load_config(["replay.device=cuda:1", "replay.pin_memory=false"])
    assert cfg.replay.device == "cuda:1" and cfg.replay.pin_memory is False
    with pytest.raises(ConfigError, match="replay.pin_memory='yes please' has the wrong type"):
        load_config(["replay.pin_memory=yes please"])


def placement(device, pin, training: str):
    return replay_placement(SimpleNamespace(device=device, pin_memory=pin), torch.device(training))


def test_placement_defaults_and_auto():
    assert placement(None, None, "cpu") == (None, False)
    assert placement("auto", None, "cpu") == (None, False)  # host memory is the CPU's own
    assert placement("cpu", None, "cpu") == (torch.device("cpu"), False)
    assert placement(None, None, "cuda:0") == (None, True)  # host replay feeding a GPU: pinned
    assert placement("auto", None, "cuda:1") == (torch.device("cuda:1"), False)
    assert placement(None, False, "cuda:0") == (None, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a CPU-only torch")
@pytest.mark.parametrize(
    "device,pin,fragment",
    [
        ("cuda", None, "replay.device=cuda needs a CUDA GPU"),
        ("cuda:0", None, "replay.device=cuda:0 needs a CUDA GPU"),
        (None, True, "replay.pin_memory=true needs CUDA"),
        ("cpu", True, "replay.pin_memory=true applies to host replay"),
    ],
)
def test_placement_this_machine_cannot_give_is_one_line(device, pin, fragment):
    with pytest.raises(ConfigError) as info:
        placement(device, pin, "cpu")
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------ CUDA (skipped without a GPU)

cuda_only = pytest.mark.gpu


@cuda_only
@pytest.mark.parametrize("num_envs", [1, 3])
def test_cuda_ring_samples_the_host_batches_without_syncing(num_envs):
    shape = (3, 6, 6)
    host = ReplaySet(num_envs, 90, shape, np.uint8, 3, ACTION_DIM)
    on_gpu = ReplaySet(num_envs, 90, shape, np.uint8, 3, ACTION_DIM, device="cuda")
    fill([host, on_gpu], shape, np.uint8, rounds=2, num_envs=num_envs)
    assert "on cuda:" in on_gpu.describe()
    on_gpu.sample(32, np.random.default_rng(99))  # warm the caching allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in sampling raises
    try:
        got = [on_gpu.sample(32, np.random.default_rng(seed)) for seed in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed, batch in enumerate(got):
        expected = host.sample(32, np.random.default_rng(seed))
        for key in KEYS:
            assert batch[key].is_cuda and torch.equal(batch[key].cpu(), expected[key]), key
    assert_same_state(host.state_dict()["buffers"][0], on_gpu.state_dict()["buffers"][0])


@cuda_only
@pytest.mark.parametrize("num_envs", [1, 3])
def test_pinned_host_batches(num_envs):
    shape = (5,)
    host = ReplaySet(num_envs, 90, shape, np.float32, 3, ACTION_DIM)
    pinned = ReplaySet(num_envs, 90, shape, np.float32, 3, ACTION_DIM, pin_memory=True)
    fill([host, pinned], shape, np.float32, rounds=2, num_envs=num_envs)
    for seed in range(3):
        expected = host.sample(32, np.random.default_rng(seed))
        batch = pinned.sample(32, np.random.default_rng(seed))
        for key in KEYS:
            assert batch[key].is_pinned() and torch.equal(batch[key], expected[key]), key


def test_the_replay_timing_tool_checks_both_sample_the_same_batch(tmp_path, monkeypatch):
    """tools/instruments/replay_timing.py (the measurement behind the joint rings) times a commit's replay
    against this checkout's, and refuses to time two that sample different batches."""
    from conftest import load_tool

    tool = load_tool("instruments/replay_timing.py")
    out = tmp_path / "timing"
    argv = ["--baseline", "HEAD", "--envs", "1", "3", "--batches", "4", "--total-slots", "24", "--rounds", "1"]
    assert tool.main([*argv, "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| host | 1 | 4 |" in table and "| host | 3 | 4 |" in table

    class Shifted(ReplaySet):
        def sample(self, batch_size, rng):
            batch = super().sample(batch_size, rng)
            return {**batch, "reward": batch["reward"] + 1.0}

    monkeypatch.setattr(tool, "baseline_module", lambda rev: SimpleNamespace(ReplaySet=Shifted))
    with pytest.raises(SystemExit, match="sample different batches"):
        tool.main(argv)
