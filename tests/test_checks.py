"""Tests for the validation layer (_checks) and the uniform behaviour it gives every public
function (issue 14, points 5 and 6): the same input gets the same answer everywhere."""

import inspect
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import efficient_attention as ea
from efficient_attention import _checks

F64 = torch.float64


def _qkv(n=6, d=4, dtype=F64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, n, e, generator=g, dtype=dtype) for e in (d, d, 3))


def _w(d=4):
    return ea.gaussian_random_matrix(8, d, generator=torch.Generator().manual_seed(1),
                                     dtype=F64)


# Every public attention function, called with the keyword arguments it accepts.
ATTENTION = {
    "softmax_attention": lambda q, k, v, **kw: ea.softmax_attention(q, k, v, **kw),
    "kernelized_attention": lambda q, k, v, **kw: ea.kernelized_attention(
        q, k, v, ea.softmax_kernel, **kw),
    "linear_attention": lambda q, k, v, **kw: ea.linear_attention(q, k, v, **kw),
    "favor_attention": lambda q, k, v, **kw: ea.favor_attention(
        q, k, v, _w(q.shape[-1]).to(q.dtype) if q.is_floating_point() else _w(), **kw),
    "banded_attention": lambda q, k, v, **kw: ea.banded_attention(q, k, v, 2, **kw),
    "fmm_attention": lambda q, k, v, **kw: ea.fmm_attention(
        q, k, v, bandwidth=2, feature_maps=ea.elu_feature_map, near_weight=1.0,
        far_weight=1.0, **kw),
    "nystrom_attention": lambda q, k, v, **kw: ea.nystrom_attention(q, k, v, 2, **kw),
    "tiled_attention": lambda q, k, v, **kw: ea.tiled_attention(q, k, v, block_size=2, **kw),
    "FavorAttention": lambda q, k, v, **kw: ea.FavorAttention(4, 8, seed=0).double()(
        q, k, v, **kw),
    "FMMAttention": lambda q, k, v, **kw: ea.FMMAttention(2).double()(q, k, v, **kw),
    "NystromAttention": lambda q, k, v, **kw: ea.NystromAttention(2)(q, k, v, **kw),
}
CAUSAL = [name for name in ATTENTION if "ystrom" not in name]


# --- the helpers themselves ---------------------------------------------------------------


def test_scalar_validators():
    assert _checks.check_bool(True, "flag") is True
    for bad in ("yes", 1, None, 0.0):
        with pytest.raises(TypeError, match="flag must be a bool"):
            _checks.check_bool(bad, "flag")
    assert _checks.check_positive_int(3, "n") == 3
    with pytest.raises(TypeError, match="n must be a positive int, got bool True"):
        _checks.check_positive_int(True, "n")
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        _checks.check_positive_int(0, "n")
    assert _checks.check_nonnegative_int(0, "n") == 0
    assert _checks.check_nonnegative_float(0, "eps") == 0.0
    for bad in (float("inf"), float("nan"), -1e-9):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            _checks.check_nonnegative_float(bad, "eps")
    with pytest.raises(ValueError, match="sigma must be a positive finite number"):
        _checks.check_positive_float(float("inf"), "sigma")
    with pytest.raises(TypeError, match="sigma must be a positive number, got str"):
        _checks.check_positive_float("1", "sigma")
    assert _checks.check_fraction(0.5, "t") == 0.5
    with pytest.raises(ValueError, match="t must lie strictly between 0 and 1, got 1.0"):
        _checks.check_fraction(1, "t")
    assert _checks.check_real(float("nan"), "scale") != 0  # NaN is a real number here
    with pytest.raises(TypeError, match="scale must be a real number"):
        _checks.check_real(True, "scale")


def test_compute_dtype_is_float32_for_half_and_promotes_otherwise():
    half = torch.zeros(1, dtype=torch.float16)
    assert _checks.compute_dtype(half) == torch.float32
    assert _checks.compute_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert _checks.compute_dtype(half, torch.zeros(1, dtype=F64)) == F64
    assert _checks.compute_dtype(torch.zeros(1)) == torch.float32


def test_check_tensor_accepts_only_real_floating_point():
    assert _checks.check_tensor(torch.zeros(2), "x") is not None
    for dtype in (torch.complex64, torch.int64, torch.bool):
        with pytest.raises(TypeError, match=f"x must be a real floating-point.*{dtype}"):
            _checks.check_tensor(torch.zeros(2, dtype=dtype), "x")


def test_mask_must_broadcast_to_the_keys():
    key_shape = (2, 3, 5, 4)
    for shape in [(5,), (1, 5), (2, 1, 5), (2, 3, 5), (2, 1, 1), (1,), ()]:
        mask = torch.zeros(shape, dtype=torch.bool)
        assert _checks.check_key_padding_mask(mask, key_shape, torch.device("cpu")).shape \
            == (2, 3, 5)
    with pytest.raises(ValueError, match=r"broadcastable to the keys' \(2, 3, 5\).*\(2, 4\)"):
        _checks.check_key_padding_mask(torch.zeros(2, 4, dtype=torch.bool), key_shape, "cpu")
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        _checks.check_key_padding_mask(torch.zeros(5), key_shape, torch.device("cpu"))


# --- the same rules in every public function ----------------------------------------------


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_causal_must_be_a_bool_everywhere(name, flag):
    """Issue 14: causal="yes" was accepted by softmax/banded/kernelized and rejected by
    linear/favor."""
    with pytest.raises(TypeError, match="causal must be a bool"):
        ATTENTION[name](*_qkv(), causal=flag)


@pytest.mark.parametrize("name", list(ATTENTION))
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int64])
def test_complex_and_integer_inputs_are_rejected_everywhere(name, dtype):
    """Issue 14: complex tensors passed check_tensor and failed deep in torch."""
    q, k, v = (t.to(dtype) for t in _qkv())
    with pytest.raises(TypeError, match=r"q must be a real floating-point tensor"):
        ATTENTION[name](q, k, v)


@pytest.mark.parametrize("name", list(ATTENTION))
def test_a_mask_that_broadcasts_is_accepted_everywhere(name):
    """Issue 14: a (b, 1) mask broadcastable to (b, n_k) was rejected. It means "every
    key of batch element b alike": all padded (zeros) or none padded."""
    q, k, v = _qkv()
    column = torch.tensor([[False], [True]])  # (b, 1)
    full = column.expand(2, 6)
    got = ATTENTION[name](q, k, v, key_padding_mask=column)
    torch.testing.assert_close(got, ATTENTION[name](q, k, v, key_padding_mask=full))
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_eps_must_be_finite():
    """Issue 14: linear_attention(eps=inf) returned zeros."""
    q, k, v = _qkv()
    for eps in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            ea.linear_attention(q, k, v, eps=eps)
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            ea.RecurrentLinearAttention(eps=eps)


def test_fmm_weights_are_checked():
    """Issue 14: far_weight's shape was not checked and negative weights were accepted
    though documented positive."""
    q, k, v = _qkv()
    maps = [ea.elu_feature_map, ea.elu_negative_feature_map]
    kw = dict(bandwidth=1, feature_maps=maps, near_weight=1.0)
    with pytest.raises(ValueError, match=r"far_weight must have one weight per feature map "
                                         r"\(2\), got shape \(2, 1\)"):
        ea.fmm_attention(q, k, v, far_weight=torch.ones(2, 1, dtype=F64), **kw)
    with pytest.raises(ValueError, match=r"got shape \(3,\)"):
        ea.fmm_attention(q, k, v, far_weight=torch.ones(3, dtype=F64), **kw)
    with pytest.raises(ValueError, match="far_weight must be >= 0"):
        ea.fmm_attention(q, k, v, far_weight=torch.tensor([1.0, -0.5], dtype=F64), **kw)
    with pytest.raises(ValueError, match=r"far_weight\[1\] must be a finite number >= 0"):
        ea.fmm_attention(q, k, v, far_weight=[1.0, -0.5], **kw)
    with pytest.raises(ValueError, match="near_weight must be a finite number >= 0"):
        ea.fmm_attention(q, k, v, far_weight=[1.0, 1.0], **{**kw, "near_weight": -1.0})
    with pytest.raises(TypeError, match="far_weight must be a real floating-point tensor"):
        ea.fmm_attention(q, k, v, far_weight=torch.ones(2, dtype=torch.long), **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nystrom_exact_pinv_works_in_half_precision(dtype):
    """Issue 14: pinv_iterations=None failed in fp16/bf16 with torch's own error."""
    q, k, v = (t.to(dtype) for t in _qkv(n=16))
    out = ea.nystrom_attention(q, k, v, 4, pinv_iterations=None)
    assert out.dtype == dtype and torch.isfinite(out).all()
    reference = ea.nystrom_attention(*_qkv(n=16), 4, pinv_iterations=None)
    torch.testing.assert_close(out.double(), reference, rtol=0.05, atol=0.05)


# --- point 6: names, signatures, registered feature maps ---------------------------------


def test_no_module_shares_its_name_with_a_function_it_exports():
    """Issue 14: `import efficient_attention.linear_attention as la` bound the function."""
    import efficient_attention.linearized as linearized

    assert isinstance(linearized, types.ModuleType)
    modules = [getattr(ea, name) for name in ea._MODULES]  # the package's one list
    assert {"attention", "linearized", "tiling", "memory"} <= set(ea._MODULES)
    for module in modules:
        assert isinstance(module, types.ModuleType)
        short = module.__name__.rsplit(".", 1)[-1]
        assert short not in module.__all__
        assert set(module.__all__) <= set(ea.__all__)
    assert callable(ea.linear_attention) and ea.linearized.linear_attention is ea.linear_attention


def test_the_attention_modules_share_one_forward_signature():
    """Issue 14: NystromAttention.forward(q, k, v, key_padding_mask, causal) ordered its
    arguments differently from FavorAttention and FMMAttention."""
    signatures = {
        cls.__name__: [(p.name, p.kind, p.default)
                       for p in inspect.signature(cls.forward).parameters.values()]
        for cls in (ea.NystromAttention, ea.FavorAttention, ea.FMMAttention)
    }
    expected = [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("q", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("k", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("v", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("causal", inspect.Parameter.KEYWORD_ONLY, False),
        ("key_padding_mask", inspect.Parameter.KEYWORD_ONLY, None),
    ]
    for name, parameters in signatures.items():
        assert parameters == expected, name


class _ScaledElu(nn.Module):
    """A learnable feature map: elu(a x) + 1 with a trainable a."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.nn.functional.elu(self.a * x) + 1.0


def test_fmm_module_registers_its_feature_maps():
    """Issue 14: FMMAttention kept feature_maps in a plain list, so learnable maps were not
    trained, saved or moved."""
    learnable = _ScaledElu()
    module = ea.FMMAttention(2, [learnable, ea.elu_feature_map])
    assert isinstance(module.feature_maps, nn.ModuleList)
    names = dict(module.named_parameters())
    assert "feature_maps.0.a" in names and "feature_maps.0.a" in module.state_dict()
    q, k, v = (torch.randn(2, 10, 4) for _ in range(3))
    module(q, k, v).square().sum().backward()
    assert learnable.a.grad is not None and learnable.a.grad != 0  # it is trained
    module.double()
    assert learnable.a.dtype == F64  # it moves with the module
    copy = ea.FMMAttention(2, [_ScaledElu(), ea.elu_feature_map]).double()
    with torch.no_grad():
        learnable.a.fill_(0.25)
    copy.load_state_dict(module.state_dict())  # it is saved and restored
    assert copy.feature_maps[0].a.item() == 0.25
    assert "elu_feature_map" in repr(module)


# --- issue 27: helpers for clear errors ---------------------------------------------------


def test_check_tensor_states_the_expected_shape():
    with pytest.raises(TypeError, match=r"beta must be a torch.Tensor of shape \(\.\.\., n\), "
                                        r"got NoneType"):
        _checks.check_tensor(None, "beta", shape="(..., n)")
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        _checks.check_tensor([1.0], "x")


def test_check_module_input_names_both_dtypes_and_the_fix():
    module = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert _checks.check_module_input(x, "x", module) is x
    with pytest.raises(TypeError, match=r"x must have the dtype of the module's parameters "
                                        r"\(torch.float32\), got torch.float64: convert the "
                                        r"inputs \(.to\(torch.float32\)\) or the module "
                                        r"\(.to\(torch.float64\)\)"):
        _checks.check_module_input(x.double(), "x", module)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: not an error
        _checks.check_module_input(x.bfloat16(), "x", module)
    assert _checks.check_module_input(x.double(), "x", nn.ReLU()) is not None  # no parameter


def test_check_representable():
    assert _checks.check_representable(-1e30, "b", torch.float32) == -1e30
    for bad in (-1e39, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"b must be finite and within the range of "
                                             r"torch.float32 \(\|x\| <= 3.4e\+38\)"):
            _checks.check_representable(bad, "b", torch.float32)


# --- broadcast_shapes: torch's rules, without torch's import of sympy --------------------------

_dims = st.lists(st.sampled_from([1, 2, 3]), max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.lists(_dims, min_size=1, max_size=4))
def test_broadcast_shapes_agrees_with_torch(shapes):
    try:
        expected = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="do not broadcast"):
            _checks.broadcast_shapes(*shapes)
    else:
        assert _checks.broadcast_shapes(*shapes) == expected


def test_validating_inputs_does_not_import_sympy():
    """torch.broadcast_shapes imports sympy (about a second of CPU per process); every
    process that validates attention inputs (chapter kernels, distributed ranks) pays it
    unless the library broadcasts shapes itself."""
    code = ("import sys, torch, efficient_attention as ea\n"
            "q = torch.randn(2, 4, 64, 16)\n"
            "ea.softmax_attention(q, q, q); ea.tiled_attention(q, q, q)\n"
            "ea.block_sparse_attention(q, q, q, torch.ones(2, 2, dtype=torch.bool),"
            " block_size=32)\n"
            "ea.topk_block_attention(q, q, q, block_size=16, top_k=2)\n"
            "ea.linear_attention(q, q, q, causal=True)\n"
            "ea.gated_linear_attention(q, q, q, -torch.rand(2, 4, 64))\n"
            "print('sympy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
