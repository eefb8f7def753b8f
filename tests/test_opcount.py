"""The benchmark's dispatch counts (pixelsac/perf/opcount.py): what a cast is, the GPU's form of
the counted update, and counts that do not depend on sizes."""

from __future__ import annotations

import pytest
import torch

import pixelsac.perf.opcount as opcount
from pixelsac.bench.plan import MODES
from pixelsac.config import load_config, to_plain
from pixelsac.perf.opcount import DispatchCount, is_host_read


def test_a_cast_converts_dtypes_and_nothing_else_is_one():
    half, single = torch.ones(4, dtype=torch.float16), torch.ones(4)
    image = torch.ones(2, 3, 4, 4)
    with DispatchCount() as count:
        half.float()  # _to_copy fp16 -> fp32: a cast
        single.to(torch.int32)  # _to_copy fp32 -> int32: a cast
        single.clone()  # a copy, same dtype
        image.to(memory_format=torch.channels_last)  # _to_copy, only the layout changes
        torch.empty(4).copy_(half)  # copy_ fp16 -> fp32: a cast
        torch.empty(4).copy_(single)  # copy_ within fp32
        torch._foreach_copy_([torch.empty(4), torch.empty(4)], [single, half])  # one op, one cast
        single.sum(dtype=torch.float64)  # computes in another dtype on the way: not a cast
        half + single  # type promotion inside the op: not a cast
    assert count.cast_total == 4, dict(count.casts)
    assert count.casts == {"float16->float32": 3, "float32->int32": 1}
    assert count.cast_sites and count.host_reads == 0


def test_a_foreach_op_that_cuda_loops_over_counts_once_per_tensor():
    """ATen's CUDA fast-route test, modelled on any device: one multi-tensor kernel where every
    tensor shares a dtype (a copy may cast) and is dense, paired tensors share shapes and strides,
    and a 0-dim tensor operand has the lists' dtype; else a kernel per tensor."""
    a, b = [torch.ones(3), torch.ones(2, 2)], [torch.ones(3), torch.ones(2, 2)]
    half = [t.half() for t in a]
    nhwc = torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last)
    nchw, strided = nhwc.contiguous(), [torch.ones(6)[::2], a[1]]
    two, half_factor, scales = torch.tensor(2.0), torch.tensor(0.5), [torch.tensor(2.0), torch.tensor(3.0)]
    with DispatchCount() as count:
        torch._foreach_mul(a, b)  # 1
        torch._foreach_mul(a, 2.0)  # 1
        torch._foreach_mul(a, two)  # 1: a 0-dim tensor of the lists' dtype
        torch._foreach_copy_(half, a)  # 1: a copy casts as it goes
        torch._foreach_norm(a, float("inf"))  # 1
        torch._foreach_mul(half, half_factor)  # 2: an fp32 factor for fp16 tensors
        torch._foreach_mul(a, scales)  # 2: a list of 0-dim scales
        torch._foreach_add(a, half)  # 2: two dtypes
        torch._foreach_norm(a, 3)  # 2: an order the kernel lacks
        torch._foreach_mul([nhwc, nhwc], [nchw, nhwc])  # 2: the first pair's strides differ
        torch._foreach_mul(strided, 2.0)  # 2: a strided view is not dense
    assert count.total == 11, dict(count.ops)  # aten ops: each foreach op once
    assert count.kernels == 5 + 6 * 2
    assert sum(count.per_tensor.values()) == sum(count.per_tensor_sites.values()) == 12
    with DispatchCount() as views:
        a[1].view(-1), a[1].t(), a[1].detach(), torch.empty(3)  # views and an allocation: no kernel
        with torch.profiler.record_function("step"):  # an optimizer step's markers (2 ops): none
            a[1].clone()  # a copy: one
    assert views.total == 7 and views.kernels == 1


def test_host_reads_are_counted_where_they_happen():
    with DispatchCount() as count:
        torch._foreach_add_([torch.zeros(3)], torch.ones(()))  # the Scalar overload reads the 0-dim tensor
        float(torch.ones(()))
        torch.ones(2).cpu(), torch.ones(2).tolist()  # on a CPU already: nothing dispatched, nothing read
    assert count.host_reads == 2 and sum(count.read_sites.values()) == 2


def test_a_copy_from_a_device_into_host_memory_is_a_host_read():
    """Decided from the devices alone (``meta`` stands for a GPU here: no GPU needed)."""
    device, host = torch.empty(3, device="meta"), torch.empty(3)
    assert is_host_read(torch.ops.aten._to_copy.default, (device,), host)
    assert is_host_read(torch.ops.aten.copy_.default, (host, device), host)
    assert not is_host_read(torch.ops.aten._to_copy.default, (host,), device)  # host to device
    assert not is_host_read(torch.ops.aten.copy_.default, (device, host), device)
    assert not is_host_read(torch.ops.aten._to_copy.default, (host,), host.double())


def test_the_counted_update_is_the_gpus_form():
    cfg = to_plain(load_config(["precision=fp16"]))
    form = opcount.gpu_form(cfg)
    assert form["perf"]["sync_free"] is True and form["perf"]["aug_backend"] == "kornia"
    assert form["perf"]["channels_last"] is True and form["lowp"]["fp32_accumulate"] is False
    assert not form["perf"]["compile"] and not form["perf"]["cuda_graphs"]
    assert form["agent"]["num_conv_layers"] == cfg["agent"]["num_conv_layers"]
    assert form["train"]["log_every_updates"] > 10**9 and cfg["lowp"]["fp32_accumulate"] is None  # a copy
    said = to_plain(load_config(["precision=fp32", "perf.sync_free=false", "perf.aug_backend=index"]))
    form = opcount.gpu_form(said)
    assert form["perf"]["sync_free"] is False and form["perf"]["aug_backend"] == "index"
    assert form["perf"]["channels_last"] is False  # fp32's on a GPU
    assert opcount.count_obs_shape((9, 84, 84), 4) == (9, 17, 17)
    assert opcount.count_obs_shape((9, 12, 12), 4) == (9, 12, 12) and opcount.count_obs_shape((5,), 4) == (5,)


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_the_counts_do_not_depend_on_sizes(mode, monkeypatch):
    """Batch, widths and image size change what each op computes, not which ops run: the counts
    at the benchmark's small sizes are those of a larger agent (batch 16 at 84x84 with DrQ's
    widths measured the same: docs/performance.md)."""
    cfg = to_plain(load_config(list(MODES[mode].overrides)))
    small = opcount.count_update_ops(cfg, (9, 84, 84), 2)
    sizes = {"batch_size": 5, "num_filters": 6, "feature_dim": 12, "hidden_dim": 24}
    monkeypatch.setattr(opcount, "COUNT_SIZES", sizes)
    monkeypatch.setattr(opcount, "count_obs_shape", lambda shape, layers: (9, 26, 26))
    larger = opcount.count_update_ops(cfg, (9, 84, 84), 2)
    assert {k: (v.ops, v.casts, v.host_reads) for k, v in small.items()} == {
        k: (v.ops, v.casts, v.host_reads) for k, v in larger.items()
    }


def test_counting_leaves_the_random_streams_alone():
    cfg = to_plain(load_config(["precision=fp16"]))
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    counts = opcount.count_update_ops(cfg, (5,), 1)  # state observations: no convolutions, no shift
    assert torch.equal(torch.rand(3), expected)
    assert counts["full"].updates == 1 and counts["full"].ops > counts["critic-only"].ops > 0


def _cuda_kernels(run) -> int:
    """CUDA kernels (and memsets/copies) the profiler saw while ``run()`` ran."""
    from torch.autograd import DeviceType

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_foreach_route_model_is_what_cuda_launches():
    """The model the kernel estimate rests on, against the profiler: a foreach op over 8 tensors
    takes one launch where ATen's fast route takes it and 8 where it does not (an fp32 factor
    for fp16 tensors, a list of 0-dim scales)."""
    from pixelsac.perf.opcount import cuda_foreach_launches

    device = torch.device("cuda")
    half = [torch.ones(1000 + i, dtype=torch.float16, device=device) for i in range(8)]
    same, other = torch.tensor(0.5, dtype=torch.float16, device=device), torch.tensor(0.5, device=device)
    scales = [torch.tensor(2.0, dtype=torch.float16, device=device) for _ in half]
    mul = torch.ops.aten._foreach_mul_
    cases = [
        (lambda: torch._foreach_mul_(half, same), mul.Tensor, (half, same)),
        (lambda: torch._foreach_mul_(half, other), mul.Tensor, (half, other)),
        (lambda: torch._foreach_mul_(half, scales), mul.List, (half, scales)),
    ]
    for run, op, args in cases:
        run()  # warm-up: first calls may launch set-up kernels
        assert _cuda_kernels(run) == cuda_foreach_launches(op, args, {}), op


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_kernel_estimate_of_an_update_is_near_what_it_launches(capsys):
    """A full fp16 update of the counted agent on CUDA: the estimate against the profiler's count
    (cuDNN and cuBLAS may launch more than one kernel for an op; the figures are printed)."""
    from pixelsac.perf.opcount import DispatchCount

    seen: list[tuple[int, int]] = []

    class Profiled(DispatchCount):
        def __enter__(self):
            torch.cuda.synchronize()
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]).__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            torch.cuda.synchronize()
            self._profile.__exit__(None, None, None)
            from torch.autograd import DeviceType

            launched = sum(1 for e in self._profile.events() if e.device_type == DeviceType.CUDA)
            seen.append((self.kernels, launched))

    original = opcount.DispatchCount
    opcount.DispatchCount = Profiled
    try:
        counts = opcount.count_update_ops(to_plain(load_config(list(MODES["fp16"].overrides))), (9, 84, 84), 1, "cuda")
    finally:
        opcount.DispatchCount = original
    estimate, launched = next((k, n) for k, n in reversed(seen) if k == counts["full"].kernels)
    with capsys.disabled():
        print(f"\nfp16 full update on CUDA: estimated {estimate} kernels, the profiler saw {launched}")
    assert 0.7 * estimate <= launched <= 2.0 * estimate
