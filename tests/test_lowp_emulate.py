"""fp32_accumulate: fp16 convolutions/matmuls with fp32 accumulation on a CPU.

Measured here (torch 2.13, 2 cores): native CPU fp16 forward convolutions and linears agree
with the emulation to within an ulp on almost every element (DrQ-sized conv stack: 2.8% of
outputs differ, the few beyond 2 ulps are small outputs after cancellation), but native
fp16 *conv backward* is less accurate — up to hundreds of element-ulps from float64 where
the emulation stays within ~0.5 ulp (it accumulates in fp32 and rounds once).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pixelsac.lowp import fp32_accumulate

F16, F64 = torch.float16, torch.float64


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """fp16 spacing at |x|, floored at the subnormal spacing, in float64."""
    x = x.double().abs().clamp(min=2.0**-14)
    return torch.exp2(torch.floor(torch.log2(x)) - 10)


def forward_backward(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, emulate: bool):
    layer = copy.deepcopy(layer)
    x = x.clone().requires_grad_()
    if emulate:
        with fp32_accumulate():
            y = layer(x)
    else:
        y = layer(x)
    y.backward(grad_out.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def reference_float64(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """Same fp16 weights and inputs, evaluated in float64."""
    return forward_backward(layer.double(), x.double(), grad_out.double(), emulate=False)


def small_layers():
    torch.manual_seed(0)
    return {
        "conv_s2": (nn.Conv2d(3, 8, 3, stride=2).half(), torch.randn(4, 3, 20, 20).half()),
        "conv_s1": (nn.Conv2d(8, 8, 3).half(), torch.randn(4, 8, 9, 9).half()),
        "linear": (nn.Linear(64, 32).half(), torch.randn(16, 64).half()),
    }


@pytest.mark.parametrize("name", ["conv_s2", "conv_s1", "linear"])
def test_single_layer_matches_native_forward_and_float64_backward(name):
    layer, x = small_layers()[name]
    with torch.no_grad():
        y_shape = layer(x).shape
    grad_out = torch.randn(y_shape).half()
    native = forward_backward(layer, x, grad_out, emulate=False)
    emulated = forward_backward(layer, x, grad_out, emulate=True)
    exact = reference_float64(layer, x, grad_out)
    labels = ["output", "input grad"] + [f"{n} grad" for n, _ in layer.named_parameters()]
    for label, n, e, r in zip(labels, native, emulated, exact):
        assert e.dtype == F16
        differ = (n != e).double().mean().item()
        native_ulps = ((n.double() - r).abs() / fp16_ulp(r)).max().item()
        emulated_ulps = ((e.double() - r).abs() / fp16_ulp(r)).max().item()
        print(f"{name} {label}: {differ:.1%} differ from native; max error vs float64 "
              f"{native_ulps:.1f} ulp native, {emulated_ulps:.2f} ulp emulated")
        # fp32 accumulation of fp16 products, rounded once: within an ulp of float64
        # (plus fp32's own accumulation error for outputs that nearly cancel).
        tol = fp16_ulp(r) + 1e-6 * r.abs().max()
        assert ((e.double() - r).abs() <= tol).all(), label
        assert emulated_ulps <= native_ulps + 1e-9, label  # never worse than the CPU kernel
        if label == "output" or name == "linear":
            # Forward (and linear backward) kernels round once too: 1-2 ulp agreement.
            assert ((n.double() - e.double()).abs() <= 2 * fp16_ulp(r)).all(), label


def test_emulation_is_the_upcast_computation_bitwise():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 9).half()
    w = torch.randn(5, 3, 3, 3).half()
    b = torch.randn(5).half()
    a = torch.randn(4, 6).half()
    m = torch.randn(6, 7).half()
    batch_a, batch_m = torch.randn(2, 4, 6).half(), torch.randn(2, 6, 7).half()
    bias2d = torch.randn(4, 7).half()
    with fp32_accumulate():
        cases = {
            "conv2d": (F.conv2d(x, w, b, padding=1), F.conv2d(x.float(), w.float(), b.float(), padding=1)),
            "conv1d": (F.conv1d(x[:, :, 0], w[:, :, 0], b), F.conv1d(x[:, :, 0].float(), w[:, :, 0].float(), b.float())),
            "linear": (F.linear(a, m.T), F.linear(a.float(), m.T.float())),
            "@": (a @ m, a.float() @ m.float()),
            "matmul": (torch.matmul(a, m), a.float() @ m.float()),
            "mm": (torch.mm(a, m), a.float() @ m.float()),
            "Tensor.mm": (a.mm(m), a.float() @ m.float()),
            "bmm": (torch.bmm(batch_a, batch_m), torch.bmm(batch_a.float(), batch_m.float())),
            "addmm": (torch.addmm(bias2d, a, m), torch.addmm(bias2d.float(), a.float(), m.float())),
        }
    for name, (got, upcast) in cases.items():
        assert got.dtype == F16, name
        assert torch.equal(got, upcast.half()), name


def test_bfloat16_is_emulated_too():
    torch.manual_seed(2)
    layer = nn.Linear(16, 8).bfloat16()
    x = torch.randn(4, 16).bfloat16()
    with fp32_accumulate():
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16())


def test_fp32_inputs_are_untouched():
    torch.manual_seed(3)
    layer = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, grad_out = torch.randn(2, 3, 8, 8), torch.randn(2, 5)
    outside = forward_backward(layer, x, grad_out, emulate=False)
    inside = forward_backward(layer, x, grad_out, emulate=True)
    for a, b in zip(outside, inside):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_autograd_reaches_fp16_leaves_of_a_conv_stack():
    torch.manual_seed(4)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 7 * 7, 16),
    ).half()
    x = torch.randn(4, 3, 20, 20).half()
    grad_out = torch.randn(4, 16).half()
    native = forward_backward(net, x, grad_out, emulate=False)
    emulated = forward_backward(net, x, grad_out, emulate=True)
    exact = reference_float64(net, x, grad_out)
    for n, e, r in zip(native, emulated, exact):
        assert e.dtype == F16 and torch.isfinite(e).all()
        # Through the stack, fp16 rounding of the activations dominates both; the emulation
        # must be about as close to float64 as the native kernels (here: equal or closer).
        scale = r.abs().max()
        native_err = ((n.double() - r).abs().max() / scale).item()
        emulated_err = ((e.double() - r).abs().max() / scale).item()
        assert emulated_err <= 1.25 * native_err + 1e-3, (emulated_err, native_err)


def test_rough_speed_comparison_is_reported_not_asserted():
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(9, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 16, 3)).half()
    x = torch.rand(4, 9, 42, 42).half()

    def timed(emulate: bool) -> float:
        best = float("inf")
        for _ in range(3):  # the first call of either pays one-off start-up costs
            start = time.perf_counter()
            forward_backward(net, x, torch.ones(4, 16, 18, 18).half(), emulate)
            best = min(best, time.perf_counter() - start)
        return best

    native, emulated = timed(False), timed(True)
    print(f"small conv stack fwd+bwd: native fp16 {native * 1e3:.0f} ms, emulated {emulated * 1e3:.0f} ms")
