"""FLOPs per update (pixelsac/perf/flops.py): the count is the update's real arithmetic, scales
exactly with the batch, and is the same in every precision mode."""

from __future__ import annotations

import json

import pytest
from conftest import load_tool

from pixelsac.config import load_config, to_plain
from pixelsac.perf.flops import COUNT_BATCH, count_update_flops

SMALL = [
    "task=cartpole_swingup",
    "env.image_size=24",
    "agent.num_filters=4",
    "agent.feature_dim=8",
    "agent.hidden_dim=16",
    "agent.batch_size=6",
]
OBS, ACTIONS = (9, 24, 24), 1


def _config(*overrides: str) -> dict:
    return to_plain(load_config([*SMALL, *overrides]))


def _encoder_flops(config: dict, side: int) -> tuple[int, int]:
    """One image through DrQ's encoder (3x3 convolutions, the first of stride 2, no padding), by
    hand: the forward's FLOPs and its backward's (weight gradients everywhere, input gradients
    below the first layer), at 2 FLOPs per multiply-add."""
    agent = config["agent"]
    channels_in, filters = OBS[0], int(agent["num_filters"])
    forward = backward = 0
    side = (side - 3) // 2 + 1
    for layer in range(int(agent["num_conv_layers"])):
        if layer:
            side -= 2
        flops = 2 * (channels_in if layer == 0 else filters) * 9 * filters * side * side
        forward += flops
        backward += flops * (1 if layer == 0 else 2)
    return forward, backward


def test_the_count_is_the_update_s_own_convolutions_forward_and_backward():
    """Each image the update encodes, counted by hand: the critic's K copies of the batch (forward
    and backward), the target's M copies and the actor's action for them (M more, forward only),
    and in a full update the actor's one copy (forward: its loss reads the features detached)."""
    config = _config()
    batch, k, m = 6, int(config["agent"]["aug_q_copies"]), int(config["agent"]["aug_target_copies"])
    flops = count_update_flops(config, OBS, ACTIONS)
    forward, backward = _encoder_flops(config, OBS[-1])
    assert flops.full_by_op["convolution"] == forward * batch * (k + 2 * m + 1)
    assert flops.full_by_op["convolution_backward"] == backward * batch * k
    assert flops.full > flops.critic_only > flops.full_by_op["convolution"]
    # DrQ's schedule: the actor every second update, so half the updates of a cycle are full ones
    assert flops.per_update == (flops.full + flops.critic_only) / 2


def test_counted_at_a_small_batch_and_scaled_is_exactly_the_count_at_the_batch():
    at_small = count_update_flops(_config(), OBS, ACTIONS, count_batch=COUNT_BATCH)
    at_batch = count_update_flops(_config(), OBS, ACTIONS, count_batch=6)
    assert (at_small.full, at_small.critic_only, at_small.per_update, at_small.full_by_op) == (
        at_batch.full,
        at_batch.critic_only,
        at_batch.per_update,
        at_batch.full_by_op,
    )
    assert count_update_flops(_config("agent.batch_size=512"), OBS, ACTIONS).full == at_small.full * 512 // 6
    assert at_small.at_batch(512).at_batch(6) == at_batch  # rescaled both ways, every figure exact


@pytest.mark.parametrize(
    "mode",
    [
        ["precision=fp16", "lowp.fp32_accumulate=false"],
        ["precision=bf16", "lowp.fp32_accumulate=false"],
        ["precision=fp16", "lowp.all=false", "lowp.fp32_accumulate=false"],
        ["precision=amp"],
    ],
    ids=["fp16", "bf16", "fp16-naive", "amp"],
)
def test_every_precision_does_the_same_arithmetic_as_fp32(mode):
    """What the benchmark divides by each mode's time is one figure: the low-precision modes do
    fp32's products in other dtypes (split-K's chunks included), none more, none fewer."""
    fp32 = count_update_flops(_config("precision=fp32"), OBS, ACTIONS, keep_precision=True)
    low = count_update_flops(_config(*mode), OBS, ACTIONS, keep_precision=True)
    assert (low.full, low.critic_only, low.full_by_op) == (fp32.full, fp32.critic_only, fp32.full_by_op)


def test_rates_and_floors_are_gflop_over_time():
    flops = count_update_flops(_config(), OBS, ACTIONS)
    assert flops.achieved_tflops(2.0) == pytest.approx(flops.per_update / 1e9 / 2.0)
    assert flops.floor_ms(flops.achieved_tflops(2.0)) == pytest.approx(2.0)


def _tool():
    return load_tool("instruments/update_flops.py")


def test_the_flops_tool_writes_each_batch_and_the_rate_a_measured_time_sustained(tmp_path, capsys):
    out = tmp_path / "flops"
    args = ["--batch-sizes", "2,4", "--ms", "0.5", "--measured", "4:0.25:somewhere", "--out", str(out)]
    assert _tool().main([*args, *SMALL[:-1]]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    two, four = data["flops"]["2"], data["flops"]["4"]
    assert four["full"] == 2 * two["full"] and four["per_update"] == 2 * two["per_update"]
    text = out.with_suffix(".md").read_text()
    assert text.startswith("Command: `python tools/instruments/update_flops.py --batch-sizes 2,4")
    rate = four["per_update"] / 1e9 / 0.25  # GFLOP per ms = TFLOP/s
    assert f"| somewhere | 4 | 0.25 | {rate:,.1f} |" in text and "TFLOP/s at 0.5 ms" in text


def test_the_flops_tool_refuses_a_measured_time_at_a_batch_it_does_not_count(capsys):
    with pytest.raises(SystemExit) as stop:
        _tool().main(["--batch-sizes", "2", "--measured", "512:16.4:gpu", *SMALL[:-1]])
    assert stop.value.code == 2 and "not one of --batch-sizes" in capsys.readouterr().err
