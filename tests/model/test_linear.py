import pytest
import torch
import torch.nn.functional as F

from splitlm.model import linear
from splitlm.model.linear import Linear

needs_onednn = pytest.mark.skipif(not linear.ENABLED, reason="oneDNN's packed linear is not in this torch build")


@pytest.fixture(autouse=True)
def any_weight_size(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)  # these layers are small; the size rule has its own test


def layer(seed: int = 0, bias: bool = True) -> Linear:
    torch.manual_seed(seed)
    return Linear(96, 160, bias=bias)


@needs_onednn
@pytest.mark.parametrize("rows", [1, linear.MIN_ROWS, 11, 40, linear.MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_product_matches_the_plain_one(rows, bias):
    lin = layer(bias=bias)
    x = torch.randn(1, rows, 96)  # [B, T, in]
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == (1, rows, 160)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert (lin.packed is not None) == (linear.MIN_ROWS <= rows <= linear.MAX_ROWS)


@needs_onednn
def test_the_blocked_copy_is_remade_when_the_weight_changes_in_place():
    lin = layer()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # what merging an adapter into the weight does
    with torch.inference_mode():
        after = lin(x)
    torch.testing.assert_close(after - lin.bias, 2 * (before - lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_small_weight_keeps_the_plain_product(monkeypatch):
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 96 * 160 + 1)
    lin = layer()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        got = lin(x)
    assert lin.packed is None
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))
    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 96 * 160)
    with torch.inference_mode():
        lin(x)
    assert lin.packed is not None


def test_autograd_goes_through_the_plain_product():
    lin = layer()
    x = torch.randn(12, 96, requires_grad=True)
    lin(x).sum().backward()
    assert lin.packed is None
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(12, 96))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 6])
def test_bf16_goes_blocked_at_every_row_count_where_the_layer_allows_it(rows):
    lin = layer().to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = lin(x)
        assert lin.packed is None  # a model's bf16 layers: no second copy
        lin.bf16_blocked = True
        got = lin(x)
    # an AVX2-only CPU has no blocked bf16 weights in oneDNN: the plain product there
    assert (lin.packed is not None) == linear.bf16_blocked_supported() and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, plain, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("supported", [True, False])
def test_a_frozen_bf16_product_falls_back_where_onednn_refuses_bf16(supported, monkeypatch):
    if supported and not linear.bf16_blocked_supported():
        pytest.skip("this CPU has no blocked bf16 weights")
    monkeypatch.setattr(linear, "bf16_blocked_supported", lambda: supported)
    w = torch.randn(40, 96).to(torch.bfloat16)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        got = linear.frozen_product(w)(x)
    torch.testing.assert_close(got, F.linear(x.to(torch.bfloat16), w), rtol=2e-2, atol=2e-2)


def test_other_dtypes_use_the_plain_product():
    lin = layer().to(torch.float16)
    x = torch.randn(12, 96, dtype=torch.float16)
    with torch.inference_mode():
        got = lin(x)
    assert lin.packed is None and got.dtype == torch.float16
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 11])
def test_project_multiplies_several_layers_as_one(rows):
    torch.manual_seed(3)
    layers = [Linear(64, 80, bias=True), Linear(64, 16, bias=False), Linear(64, 16, bias=True)]
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        outs = linear.project(x, *layers)
    for out, m in zip(outs, layers, strict=True):
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    assert (layers[0].packed is not None) == (rows >= linear.MIN_ROWS)
    assert layers[1].packed is None and layers[2].packed is None  # one blocked copy, on the first


def test_project_calls_a_wrapped_layer_itself():
    torch.manual_seed(4)
    plain, inner = Linear(32, 8), Linear(32, 8)
    wrapped = torch.nn.Sequential(inner, torch.nn.ReLU())  # stands in for an adapter around a layer
    x = torch.randn(12, 32)
    with torch.inference_mode():
        a, b = linear.project(x, plain, wrapped)
    torch.testing.assert_close(a, F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, F.linear(x, inner.weight, inner.bias).relu(), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_replaced_weight_is_seen_even_at_a_reused_address():
    lin = layer()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        lin(x)
        for scale in (2.0, 3.0, 4.0):  # replace the weight again and again: an allocator may reuse addresses
            lin.weight = torch.nn.Parameter(torch.full_like(lin.weight, scale))
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            lin.weight.data = torch.zeros_like(lin.weight)
        torch.testing.assert_close(lin(x), lin.bias.expand(12, 160))


@needs_onednn
def test_a_layer_with_a_blocked_copy_can_be_deep_copied_and_pickled():
    import copy
    import pickle

    lin = layer()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        want = lin(x)
    assert lin.packed is not None
    for twin in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert twin.packed is None
        with torch.inference_mode():
            torch.testing.assert_close(twin(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_forget_blocked_after_a_change_through_data():
    lin = layer()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        lin(x)
    lin.weight.data.mul_(0)  # what peft's merge does: no version bump
    linear.forget_blocked(torch.nn.Sequential(lin))
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), lin.bias.expand(12, 160))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_product_matches_the_plain_one(dtype):
    torch.manual_seed(5)
    w = torch.randn(300, 64).to(dtype)
    product = linear.frozen_product(w)
    for rows in (1, 7, 40):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = product(x)
        assert got.dtype == dtype and got.shape == (rows, 300)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), F.linear(x.to(dtype), w).float(), rtol=tol, atol=tol)


@needs_onednn
def test_kept_weight_product_blocks_only_products_of_several_rows():
    torch.manual_seed(6)
    w = torch.randn(300, 64)
    product = linear.KeptWeightProduct(w)
    one = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(product(one), F.linear(one, w), rtol=1e-5, atol=1e-5)
    assert product.blocked is None  # a sequential decoder never pays the second copy
    for rows in (2, 9, 70):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            torch.testing.assert_close(product(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert product.blocked is not None


def test_kept_weight_product_stays_plain_where_gradients_flow():
    w = torch.randn(300, 64, requires_grad=True)
    product = linear.KeptWeightProduct(w)
    product(torch.randn(5, 64)).sum().backward()
    assert product.blocked is None and w.grad is not None
