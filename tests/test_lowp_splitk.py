"""Split-K with fp32 sums (pixelsac.lowp.splitk), judged against float64.

The encoder projection's GEMM (K = 32·35·35 = 39,200) gets cuBLAS's split-K parallelism only with
reduced-precision reductions, which round each partial sum to fp16. ``split_k_linear`` splits K
itself and keeps every sum in fp32: its outputs must stay within one fp16 rounding of the float64
product, as the unsplit fp32-accumulated form does, while the reduced-precision form drifts by
several ulps (shown here with the same chunks, each partial rounded to fp16 and summed in fp16).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pixelsac.config import load_config
from pixelsac.lowp import SplitKLinear, fp32_accumulate, split_count, split_k_linear
from pixelsac.precision import PrecisionPolicy

K, N, BATCH = 39_200, 50, 48  # the DrQ projection's reduction and width


def _ulps(value: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """|value - reference| in units of ``dtype``'s spacing at the reference."""
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(tiny)))
    return (value.double() - reference).abs() / torch.pow(2.0, exponent - mantissa)


def _inputs(dtype: torch.dtype = torch.float16, seed: int = 0):
    torch.manual_seed(seed)
    # trunk features are ReLU outputs (non-negative, ~half zero); weights as nn.Linear's init
    x = torch.relu(torch.randn(BATCH, K)).to(dtype)
    w = (torch.rand(N, K) * 2 - 1).mul(K**-0.5).to(dtype)
    b = (torch.rand(N) * 2 - 1).mul(K**-0.5).to(dtype)
    return x, w, b


def _reduced_precision_split(x, w, b, splits):
    """What cuBLAS's split-K does with reduced-precision reductions: each chunk's fp32 dot product
    rounded to fp16, the chunks summed in fp16."""
    chunk = K // splits
    total = torch.zeros(BATCH, N, dtype=x.dtype)
    for c in range(splits):
        part = (x[:, c * chunk : (c + 1) * chunk].float() @ w[:, c * chunk : (c + 1) * chunk].float().t()).to(x.dtype)
        total = total + part
    return total + b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_stays_within_one_rounding_of_float64_where_reduced_precision_sums_do_not(dtype):
    x, w, b = _inputs(dtype)
    reference = F.linear(x.double(), w.double(), b.double())
    splits = split_count(K, 2048)
    assert splits == 20
    ours = split_k_linear(x, w, b, splits=splits)
    with fp32_accumulate():
        unsplit = F.linear(x, w, b)
    assert ours.dtype == dtype
    ours_err, unsplit_err = _ulps(ours, reference, dtype), _ulps(unsplit, reference, dtype)
    # One rounding of an fp32 sum: half an ulp at most, except on outputs where the terms cancel
    # (there the fp32 sum's own error, relative to the terms, is more than an ulp of the small result).
    assert (ours_err > 0.5).float().mean() < 0.005 and (unsplit_err > 0.5).float().mean() < 0.005
    assert ours_err.mean() <= 1.02 * unsplit_err.mean()
    # the two are the same fp32 dot product summed in another order, rounded once
    differ = ours != unsplit
    assert differ.float().mean() < 0.01
    if differ.any():  # neighbours, or next-but-one where the terms cancel to a small output
        assert _ulps(ours[differ], unsplit[differ].double(), dtype).max() <= 2.0
    # the reduced-precision form fails where ours holds (measured: mean 3-9 ulps, 70% past half an ulp)
    naive_err = _ulps(_reduced_precision_split(x, w, b, splits), reference, dtype)
    assert (naive_err > 0.5).float().mean() > 0.5
    assert naive_err.mean() > 10 * ours_err.mean()


def test_split_k_gradients_are_the_fp32_accumulated_ones():
    x, w, b = _inputs(seed=1)
    grad = torch.randn(BATCH, N).mul(0.01).half()
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    split_k_linear(*leaves, splits=20).backward(grad)
    plain = [t.clone().requires_grad_(True) for t in (x, w, b)]
    with fp32_accumulate():
        F.linear(*plain).backward(grad)
    exact = [t.double().requires_grad_(True) for t in (x, w, b)]
    F.linear(*exact).backward(grad.double())
    for ours, theirs, judge in zip(leaves, plain, exact):
        assert ours.grad.dtype == torch.float16
        ours_err, theirs_err = _ulps(ours.grad, judge.grad), _ulps(theirs.grad, judge.grad)
        assert (ours_err > 0.5).float().mean() < 0.005 and ours_err.mean() <= 1.02 * theirs_err.mean()
        assert _ulps(ours.grad, theirs.grad.double()).max() <= 1.0


def test_split_k_falls_back_to_linear_where_it_does_not_apply():
    x, w, b = _inputs()
    x32, w32, b32 = x.float(), w.float(), b.float()
    assert torch.equal(split_k_linear(x32, w32, b32, splits=20), F.linear(x32, w32, b32))
    assert torch.equal(split_k_linear(x, w, b, splits=1), F.linear(x, w, b))
    assert torch.equal(split_k_linear(x, w, b, splits=3), F.linear(x, w, b))  # 3 does not divide 39,200
    assert split_count(1000, 2048) == 1 and split_count(4096, 2048) == 2 and split_count(39_200, 4096) == 10
    with pytest.raises(ValueError, match="chunk"):
        split_count(100, 0)


def test_without_a_mixed_dtype_gemm_the_product_falls_back_to_fp32_copies(monkeypatch):
    """A CPU has no ``bmm`` with an fp32 output from fp16 inputs (nor may an older torch on a GPU):
    that "not supported" failure is remembered, with its reason, and the same product runs on
    exact fp32 copies; the path taken is recorded for the benchmark's rows and run summaries."""
    from pixelsac.lowp import splitk

    monkeypatch.setitem(splitk._MIXED_GEMM, "usable", None)
    monkeypatch.setitem(splitk._MIXED_GEMM, "why_not", None)
    splitk.reset_split_k_paths()
    a, b = torch.randn(3, 4, 8).half(), torch.randn(3, 8, 5).half()
    out = splitk._fp32_product(a, b, mixed=True)  # aten::bmm.dtype has no CPU kernel
    assert out.dtype == torch.float32 and torch.equal(out, torch.bmm(a.float(), b.float()))
    assert splitk._MIXED_GEMM["usable"] is False and "NotImplementedError" in splitk._MIXED_GEMM["why_not"]
    assert list(splitk.split_k_paths()) == ["fp32_copies"]
    assert splitk.describe_split_k().startswith("fp32_copies (mixed GEMM unsupported: NotImplementedError")
    splitk.reset_split_k_paths()
    assert splitk.describe_split_k() == "off"
    splitk._fp32_product(a, b)  # on a CPU: no mixed GEMM tried
    assert splitk.split_k_paths() == {"fp32_copies": "no mixed-dtype GEMM on a CPU"}


def _failing_bmm(exc: BaseException):
    calls = []

    def bmm(*args, **kwargs):
        calls.append(kwargs)
        if "out_dtype" in kwargs:
            raise exc
        return torch.ones(1)

    return bmm, calls


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("operation not permitted when stream is capturing"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
    ],
    ids=["out-of-memory", "capture-error", "illegal-address"],
)
def test_only_an_unsupported_gemm_form_falls_back_and_other_failures_are_raised(monkeypatch, exc):
    """Out of memory, a capture error or a broken device is no reason to multiply fp32 copies for
    the rest of the process: it reaches the caller, and the mixed GEMM is not written off."""
    from pixelsac.lowp import splitk

    monkeypatch.setitem(splitk._MIXED_GEMM, "usable", None)
    bmm, _ = _failing_bmm(exc)
    monkeypatch.setattr(splitk.torch, "bmm", bmm)
    with pytest.raises(type(exc)):
        splitk._fp32_product(torch.ones(1, 2, 2).half(), torch.ones(1, 2, 2).half(), mixed=True)
    assert splitk._MIXED_GEMM["usable"] is None


@pytest.mark.parametrize(
    "exc",
    [
        TypeError("bmm() got an unexpected keyword argument 'out_dtype'"),
        RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasGemmStridedBatchedEx"),
    ],
    ids=["old-torch", "cublas-refuses"],
)
def test_an_unsupported_gemm_form_falls_back_once(monkeypatch, exc):
    from pixelsac.lowp import splitk

    monkeypatch.setitem(splitk._MIXED_GEMM, "usable", None)
    bmm, calls = _failing_bmm(exc)
    monkeypatch.setattr(splitk.torch, "bmm", bmm)
    splitk.reset_split_k_paths()
    for _ in range(2):
        splitk._fp32_product(torch.ones(1, 2, 2).half(), torch.ones(1, 2, 2).half(), mixed=True)
    assert [("out_dtype" in kw) for kw in calls] == [True, False, False]  # tried once, then fp32 copies
    assert splitk._MIXED_GEMM["usable"] is False and list(splitk.split_k_paths()) == ["fp32_copies"]


def test_nothing_is_tried_or_caught_while_a_cuda_graph_is_captured(monkeypatch):
    """During capture (path not yet decided by the eager warm-ups) the mixed GEMM is called
    without a try: its failure ends the capture with the error instead of being swallowed
    inside a broken capture."""
    from pixelsac.lowp import splitk

    monkeypatch.setitem(splitk._MIXED_GEMM, "usable", None)
    monkeypatch.setattr(splitk, "_capturing", lambda device: True)
    bmm, calls = _failing_bmm(NotImplementedError("Could not run 'aten::bmm.dtype'"))
    monkeypatch.setattr(splitk.torch, "bmm", bmm)
    with pytest.raises(NotImplementedError):
        splitk._fp32_product(torch.ones(1, 2, 2).half(), torch.ones(1, 2, 2).half(), mixed=True)
    assert splitk._MIXED_GEMM["usable"] is None and len(calls) == 1


def test_split_k_linear_is_an_nn_linear_with_the_same_state():
    torch.manual_seed(0)
    layer = SplitKLinear(K, N).half()
    plain = nn.Linear(K, N).half()
    assert isinstance(layer, nn.Linear) and layer.state_dict().keys() == plain.state_dict().keys()
    x = _inputs()[0]
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # off until a chunk is set
    layer.split_chunk = 2048
    assert torch.equal(layer(x), split_k_linear(x, layer.weight, layer.bias, splits=20))


def test_the_policy_splits_on_cuda_in_half_precision_only():
    def chunk(device: str, *overrides: str):
        return PrecisionPolicy.from_config(load_config(list(overrides)), device).split_k_chunk

    assert chunk("cuda", "precision=fp16") == 2048 and chunk("cuda", "precision=bf16") == 2048
    assert chunk("cuda", "precision=fp32") is None and chunk("cuda", "precision=amp") is None
    assert chunk("cpu", "precision=fp16") is None
    assert chunk("cpu", "precision=fp16", "perf.split_k=512") == 512
    assert chunk("cuda", "precision=fp16", "perf.split_k=0") is None
    from pixelsac.nets import build_networks

    cfg = load_config(["precision=fp16", "perf.split_k=512"])
    actor, critic = build_networks((9, 84, 84), 6, cfg.agent)
    policy = PrecisionPolicy.from_config(cfg, "cpu")
    for net in (actor, critic):
        policy.configure_split_k(net)
        layers = [m for m in net.modules() if isinstance(m, SplitKLinear)]
        assert len(layers) == 1 and layers[0].split_chunk == 512 and layers[0].in_features == K


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_the_fp32_output_gemm_gives_the_cpu_form(dtype):
    """On CUDA the chunks run as one ``torch.bmm(..., out_dtype=torch.float32)``; its values are the
    CPU form's (exact fp32 copies) up to the fp32 sums' order, and within one rounding of float64."""
    x, w, b = _inputs(dtype)
    reference = F.linear(x.double(), w.double(), b.double())
    on_gpu = split_k_linear(x.cuda(), w.cuda(), b.cuda(), splits=20).cpu()
    from pixelsac.lowp import splitk

    assert splitk._MIXED_GEMM["usable"], f"torch.bmm(out_dtype=float32) unusable: {splitk._MIXED_GEMM['why_not']}"
    assert "mixed_gemm" in splitk.split_k_paths()
    on_cpu = split_k_linear(x, w, b, splits=20)
    assert on_gpu.dtype == dtype
    assert (on_gpu != on_cpu).float().mean() < 0.01
    err = _ulps(on_gpu, reference, dtype)
    assert (err > 0.5).float().mean() < 0.005
    leaves = [t.cuda().requires_grad_(True) for t in (x, w, b)]
    split_k_linear(*leaves, splits=20).sum().backward()
    assert all(leaf.grad is not None and leaf.grad.dtype == dtype for leaf in leaves)


def test_fp16_updates_with_split_k_track_the_unsplit_ones(monkeypatch):
    """The same fp16 agent, batches and seed, with the projections split (tiny agent: K = 100 in two
    chunks of 50) and not: after eight updates the parameters agree to a few fp16 ulps (measured:
    bit for bit; two fp32 sums of 50 products seldom round differently)."""
    from test_module import fit, make_batch, make_module

    from pixelsac.lowp import splitk

    calls = []
    apply = splitk._SplitKLinear.apply
    monkeypatch.setattr(splitk._SplitKLinear, "apply", lambda *a: calls.append(a[-1]) or apply(*a))
    batches = [make_batch(seed=i) for i in range(8)]
    runs = {}
    for split in ("0", "64"):
        torch.manual_seed(0)
        module = make_module("precision=fp16", f"perf.split_k={split}")
        fit(module, batches)
        assert bool(calls) == (split == "64") and set(calls) <= {2}  # the split path ran, in two chunks
        layers = [m for m in module.modules() if isinstance(m, SplitKLinear)]
        assert layers and all(m.split_chunk == (None if split == "0" else 64) for m in layers)
        assert split_count(layers[0].in_features, 64) == 2
        runs[split] = {k: v.detach().clone() for k, v in module.named_parameters()}
    for name, plain in runs["0"].items():
        split = runs["64"][name]
        scale = plain.double().abs().max().clamp_min(1e-3)
        assert (split.double() - plain.double()).abs().max() / scale < 2e-2, name
