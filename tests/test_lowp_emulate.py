"""fp32_accumulate: fp16 convolutions/matmuls with fp32 accumulation on a CPU.

Measured here (torch 2.13, 2 cores): native CPU fp16 forward convolutions and linears agree
with the emulation to within an ulp on almost every element (DrQ-sized conv stack: 2.8% of
outputs differ, the few beyond 2 ulps are small outputs after cancellation), but native
fp16 *conv backward* is less accurate — up to hundreds of element-ulps from float64 where
the emulation stays within ~0.5 ulp (it accumulates in fp32 and rounds once).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pixelsac.lowp import fp32_accumulate
from pixelsac.nets import ConvTrunk, Projection
from pixelsac.perf import SavedTensorMeter, TensorPeakMeter, module_state_tensors

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


# More than the terms in any one sum below (a weight gradient sums batch x output pixels: 324).
ACCUMULATED_TERMS = 512


def absolute(layer: nn.Module) -> nn.Module:
    """A copy of the layer with |weights|: run on |inputs| it gives each output's sum of |terms|."""
    layer = copy.deepcopy(layer)
    with torch.no_grad():
        for p in layer.parameters():
            p.abs_()
    return layer


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
    # The same sums over |terms|: the scale of fp32's own accumulation error for each element.
    magnitude = reference_float64(absolute(layer), x.abs(), grad_out.abs())
    labels = ["output", "input grad"] + [f"{n} grad" for n, _ in layer.named_parameters()]
    for label, n, e, r, m in zip(labels, native, emulated, exact, magnitude):
        assert e.dtype == F16
        differ = (n != e).double().mean().item()
        native_ulps = ((n.double() - r).abs() / fp16_ulp(r)).max().item()
        emulated_ulps = ((e.double() - r).abs() / fp16_ulp(r)).max().item()
        print(
            f"{name} {label}: {differ:.1%} differ from native; max error vs float64 "
            f"{native_ulps:.1f} ulp native, {emulated_ulps:.2f} ulp emulated"
        )
        # fp32 accumulation of fp16 products, rounded once: within an ulp of float64
        # (plus fp32's own accumulation error for outputs that nearly cancel).
        tol = fp16_ulp(r) + 1e-6 * r.abs().max()
        assert ((e.double() - r).abs() <= tol).all(), label
        # Rounded once from an fp32 sum: half an fp16 ulp plus the fp32 sum's own error, which is
        # at most terms * 2^-24 * sum|terms| (the CI failure this replaces: a conv output that
        # nearly cancels, 0.53 ulp from float64, its fp32 sum 0.03 ulp off across a rounding
        # boundary). An fp16 accumulator's bound would be 2^13 times that second term.
        fp32_sum_error = ACCUMULATED_TERMS * 2.0**-24 * m
        half_ulp = 0.5 * torch.maximum(fp16_ulp(r), fp16_ulp(e))
        assert ((e.double() - r).abs() <= half_ulp + fp32_sum_error).all(), label
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
            "conv1d": (
                F.conv1d(x[:, :, 0], w[:, :, 0], b),
                F.conv1d(x[:, :, 0].float(), w[:, :, 0].float(), b.float()),
            ),
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
        nn.Conv2d(3, 8, 3, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 16),
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


# Speed is not a test's business: ``python -m pixelsac.bench`` times the emulation against the
# CPU's native fp16 kernels side by side (modes fp16 and fp16-native).


# --- what is saved for backward: fp16/bf16, as on a GPU, with the same values --------------------
LOW = [torch.float16, torch.bfloat16]


def _conv(**kw):
    return lambda x, w, b=None: F.conv2d(x, w, b, **kw)


# (function, input shapes); the first input is the activation, the rest are weights/bias
OPS = {
    "conv 3x3 stride 2 (DrQ's first)": (_conv(stride=2), [(3, 9, 20, 20), (8, 9, 3, 3), (8,)]),
    "conv 3x3 stride 1 (DrQ's others)": (_conv(), [(3, 8, 11, 11), (8, 8, 3, 3), (8,)]),
    "conv stride 1, no bias": (_conv(), [(3, 8, 11, 11), (8, 8, 3, 3)]),
    "conv stride 2 padding 1, no bias": (_conv(stride=2, padding=1), [(3, 9, 12, 12), (8, 9, 3, 3)]),
    "conv padding 1": (_conv(padding=1), [(3, 8, 9, 9), (8, 8, 3, 3), (8,)]),
    "linear": (F.linear, [(6, 16), (7, 16), (7,)]),
    "linear, no bias": (F.linear, [(6, 16), (7, 16)]),
    "linear, batched leading dims": (F.linear, [(2, 3, 5, 16), (7, 16), (7,)]),
    "linear, leading dims, no bias": (F.linear, [(2, 5, 16), (7, 16)]),
    "matmul 3-D @ 2-D": (torch.matmul, [(2, 5, 16), (16, 7)]),
    "matmul broadcast batch": (lambda a, b: a @ b, [(2, 1, 5, 16), (3, 16, 7)]),
    "matmul, transposed batch (a reshape copies: kept in fp32)": (
        lambda a, b: a.transpose(0, 1) @ b,
        [(5, 2, 16), (16, 7)],
    ),
    "bmm": (torch.bmm, [(2, 5, 16), (2, 16, 7)]),
    "mm": (torch.mm, [(5, 16), (16, 7)]),
    "addmm": (lambda a, b, c: torch.addmm(c, a, b), [(5, 16), (16, 7), (5, 7)]),
}


def _inputs(shapes, dtype, activation_grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=g).to(dtype) for shape in shapes]
    for i, t in enumerate(tensors):
        t.requires_grad_(i > 0 or activation_grad)  # the first conv's input (pixels) needs none
    return tensors


def _values_and_grads(fn, inputs, emulate, grad_seed: int = 1):
    """Output and every input gradient of one forward/backward; emulate: None (the plain upcast
    form written out, today's emulation) or fp32_accumulate's save_low_precision."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    if emulate is None:
        low = inputs[0].dtype
        out = fn(*[t.float() for t in inputs]).to(low)
    else:
        with fp32_accumulate(save_low_precision=emulate):
            out = fn(*inputs)
    g = torch.Generator().manual_seed(grad_seed)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return [out.detach()] + [t.grad for t in inputs if t.requires_grad]


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation_grad", [True, False], ids=["input-grad", "no-input-grad"])
@pytest.mark.parametrize("name", list(OPS))
def test_saving_low_precision_gives_the_plain_forms_values_and_gradients_bitwise(name, activation_grad, dtype):
    fn, shapes = OPS[name]
    inputs = _inputs(shapes, dtype, activation_grad)
    plain = _values_and_grads(fn, inputs, emulate=None)
    for form in (True, False):
        got = _values_and_grads(fn, inputs, emulate=form)
        assert len(got) == len(plain)
        for what, a, b in zip(["output", *range(len(got) - 1)], got, plain):
            assert a.dtype == dtype, (what, a.dtype)
            assert torch.equal(a, b), (name, form, what)


def test_a_drq_trunk_trains_bitwise_as_before():
    """Critic encoder (convs + projection) and a Q head, through nn modules, fp16: same loss and
    parameter gradients whether the emulation saves fp16 or fp32."""
    torch.manual_seed(6)
    trunk = ConvTrunk((9, 24, 24), num_filters=8, num_layers=4)
    net = nn.Sequential(trunk, Projection(trunk.out_dim, 16), nn.Linear(16, 1)).half()
    obs = torch.randint(0, 256, (5, 9, 24, 24)).half()

    def grads(save_low: bool):
        model = copy.deepcopy(net)
        with fp32_accumulate(save_low_precision=save_low):
            loss = model(obs).float().square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


def _saved(net: nn.Module, obs: torch.Tensor, emulate):
    meter = SavedTensorMeter(module_state_tensors(net))
    with meter:
        if emulate is None:
            out = net(obs)
        else:
            with fp32_accumulate(save_low_precision=emulate):
                out = net(obs)
    out.float().sum().backward()
    return meter.result()


def test_a_drq_encoder_saves_half_of_fp32s_bytes_for_backward():
    torch.manual_seed(7)
    trunk = ConvTrunk((9, 36, 36), num_filters=16, num_layers=4)
    encoder = nn.Sequential(trunk, Projection(trunk.out_dim, 32))
    obs = torch.randint(0, 256, (8, 9, 36, 36)).float()
    fp32 = _saved(encoder, obs, emulate=None)
    encoder16 = copy.deepcopy(encoder).half()
    fp16 = _saved(encoder16, obs.half(), emulate=True)
    plain = _saved(encoder16, obs.half(), emulate=False)  # what the emulation saved before
    small = 4096  # bytes: LayerNorm's per-row statistics stay fp32 (mean and rstd, 8 rows here)
    print(
        f"saved for backward: fp32 {fp32.activations:,} B, fp16 {fp16.activations:,} B "
        f"({fp16.activations / fp32.activations:.3f}x), fp16 saving fp32 copies {plain.activations:,} B"
    )
    assert fp32.activations > 500_000
    assert fp16.activations <= 0.5 * fp32.activations + small
    assert set(fp16.by_dtype) <= {"float16", "float32"} and fp16.by_dtype.get("float32", 0) <= small
    assert plain.activations > fp32.activations  # the fp32 copies beside the fp16 ReLU outputs
    assert fp16.state == fp32.state // 2  # the weights saved are the parameters themselves


def test_no_fp32_copy_outlives_its_op():
    """Every fp32 storage made while the forward runs is freed by its end."""
    created: list[weakref.ref] = []

    class Fp32Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > 64:
                created.append(weakref.ref(out.untyped_storage()))
            return out

    torch.manual_seed(8)
    trunk = ConvTrunk((9, 24, 24), num_filters=8, num_layers=3)
    net = nn.Sequential(trunk, nn.Linear(trunk.out_dim, 16)).half()
    obs = torch.randint(0, 256, (4, 9, 24, 24)).half()
    for save_low, expect_kept in ((True, False), (False, True)):
        created.clear()
        with Fp32Storages(), fp32_accumulate(save_low_precision=save_low):
            out = net(obs)
        gc.collect()
        kept = [ref for ref in created if ref() is not None]
        assert created and bool(kept) == expect_kept, (save_low, len(kept))
        out.float().sum().backward()


def test_autograd_checks_still_apply():
    torch.manual_seed(9)
    x = torch.randn(4, 8).half().requires_grad_()
    w = torch.randn(3, 8).half().requires_grad_()
    with fp32_accumulate():
        y = F.linear(x * 1, w)
    first = torch.autograd.grad(y.sum(), [x, w], retain_graph=True)
    again = torch.autograd.grad(y.sum(), [x, w], retain_graph=True)  # a retained graph replays
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()

    with fp32_accumulate():
        h = x * 1
        y = F.linear(h, w)
    with torch.no_grad():
        h.add_(1)  # modifying a tensor saved for backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    with fp32_accumulate():
        y = F.linear(x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.float().sum().backward()
    with fp32_accumulate(save_low_precision=False):  # the plain form supports double backward
        y = F.linear(x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), [x], create_graph=True)
    gx.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_a_dropped_graph_frees_what_the_ops_saved():
    torch.manual_seed(11)
    w = torch.randn(3, 8).half().requires_grad_()
    h = torch.randn(4, 8).half() * 1
    freed = []
    weakref.finalize(h.untyped_storage(), freed.append, True)
    with fp32_accumulate():
        y = F.linear(h, w).detach()
    del h
    gc.collect()
    assert freed and y.shape == (4, 3)


def test_without_grad_nothing_is_recorded():
    torch.manual_seed(10)
    x, w = torch.randn(4, 8).half(), torch.randn(3, 8).half().requires_grad_()
    with torch.no_grad(), fp32_accumulate():
        y = F.linear(x, w)
    assert y.grad_fn is None and torch.equal(y, F.linear(x.float(), w.float()).half())


# --- batch_chunk: fp32 work a chunk of samples at a time --------------------------------------
def _trunk_net(channels_last: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(8)
    trunk = ConvTrunk((9, 24, 24), num_filters=8, num_layers=4)
    net = nn.Sequential(trunk, Projection(trunk.out_dim, 16), nn.Linear(16, 1)).half()
    obs = torch.randint(0, 256, (37, 9, 24, 24)).half()  # 37: the last chunk is a short one
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        obs = obs.contiguous(memory_format=torch.channels_last)
    return net, obs


def _train_step(net: nn.Module, obs: torch.Tensor, **emulation):
    model = copy.deepcopy(net)
    x = obs.clone().requires_grad_()
    with fp32_accumulate(**emulation):
        out = model(x)
    out.float().square().mean().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("channels_last", [False, True])
def test_chunked_emulation_equals_the_whole_batch_but_for_weight_sums(channels_last):
    """Per-sample results (outputs, input and bias gradients) are bitwise those of the whole-batch
    emulation; weight gradients, sums over the batch, agree to within an fp16 ulp and are as
    close to float64 as the whole-batch form's."""
    net, obs = _trunk_net(channels_last)
    whole = _train_step(net, obs)
    chunked = _train_step(net, obs, batch_chunk=8)
    exact = _train_step(net.double(), obs.double(), batch_chunk=None)
    assert chunked[0].dtype == F16 and torch.equal(chunked[0], whole[0])
    assert torch.equal(chunked[1], whole[1])
    for name, grad in chunked[2].items():
        if name.endswith("bias"):
            assert torch.equal(grad, whole[2][name]), name
        ulp = fp16_ulp(whole[2][name])
        assert ((grad.double() - whole[2][name].double()).abs() <= ulp).all(), name
        reference = exact[2][name]
        scale = reference.abs().max()
        err_chunked = ((grad.double() - reference).abs().max() / scale).item()
        err_whole = ((whole[2][name].double() - reference).abs().max() / scale).item()
        assert err_chunked <= err_whole + 2**-10, (name, err_chunked, err_whole)


def test_chunking_leaves_small_batches_and_fp32_alone():
    net, obs = _trunk_net(False)
    small = obs[:8]
    for a, b in zip(_train_step(net, small), _train_step(net, small, batch_chunk=8)):
        if isinstance(a, dict):
            assert all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="batch_chunk must be a positive integer"):
        with fp32_accumulate(batch_chunk=0):
            pass


def test_chunks_bound_the_fp32_buffers_and_keep_fp16_saves():
    """Two DrQ convolutions at batch 64: the chunked emulation's most bytes alive at once is well
    below the whole-batch form's (whose fp32 copies of a layer's input, output and gradients exist for
    the whole batch), and what it saves for backward is fp16 as before."""
    torch.manual_seed(9)
    trunk = nn.Sequential(nn.Conv2d(9, 32, 3, stride=2), nn.ReLU(), nn.Conv2d(32, 32, 3)).half()
    obs = torch.randint(0, 256, (64, 9, 42, 42)).half()

    def peak(**emulation) -> int:
        model = copy.deepcopy(trunk)
        gc.collect()
        meter = TensorPeakMeter()
        with meter, fp32_accumulate(**emulation):
            model(obs).sum().backward()  # a loss whose own gradients take no memory
        return meter.peak

    whole, chunked = peak(), peak(batch_chunk=8)
    print(f"most tensor bytes alive: whole batch {whole:,}, chunks of 8 {chunked:,} ({chunked / whole:.2f}x)")
    assert chunked < 0.7 * whole
    encoder = nn.Sequential(ConvTrunk((9, 36, 36), num_filters=16, num_layers=4)).half()
    saved = SavedTensorMeter(module_state_tensors(encoder))
    with saved, fp32_accumulate(batch_chunk=4):
        out = encoder(torch.randint(0, 256, (8, 9, 36, 36)).half())
    out.float().sum().backward()
    assert set(saved.result().by_dtype) == {"float16"}
