"""``per_adapter_loss``: the sum over adapters of each adapter's mean token loss; ``return_dict`` gives the
per-adapter means as plain floats without autograd warnings."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import KERNEL_DTYPE_PARAMS

import fast_multilora


def test_return_dict_gives_floats_without_warnings():
    g = torch.Generator().manual_seed(0)
    names = ["b", "a", "__base__", "a"]
    logits = torch.randn(4, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (4, 6), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Converting a tensor with requires_grad=True to a scalar"
        loss, per = fast_multilora.per_adapter_loss(logits, labels, names, return_dict=True)
    assert set(per) == {"a", "b"} and all(type(v) is float for v in per.values())
    tok = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), reduction="none").view(4, 5)
    want = {"a": tok[[1, 3]].mean().item(), "b": tok[0].mean().item()}
    for n, v in want.items():
        assert abs(per[n] - v) < 1e-5, (n, per[n], v)
    torch.testing.assert_close(loss, torch.tensor(want["a"] + want["b"]), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert logits.grad[2].abs().sum() == 0  # the base row has no loss


class _NoHostReads(torch.overrides.TorchFunctionMode):
    """Raises on every read of a tensor's values by the host (what makes a CUDA host wait for the GPU)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.__index__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"host read {func.__name__} inside the loss")
        return func(*args, **(kwargs or {}))


def test_return_dict_reads_the_device_only_when_used():
    """The per-adapter means come back without a host read (on a GPU that read would stall the step until the
    forward ran); the values are read once, when first used."""
    g = torch.Generator().manual_seed(0)
    names = ["b", "a", "__base__", "c"]
    logits = torch.randn(4, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (4, 6), generator=g)
    labels[3] = -100  # adapter c: no token, left out of the dict
    with _NoHostReads():
        loss, per = fast_multilora.per_adapter_loss(logits, labels, names, return_dict=True)
        loss.backward()
    assert dict(per).keys() == {"a", "b"} and all(type(v) is float for v in per.values())
    assert "c" not in per and len(per) == 2


# the kernels' dtypes (tests/helpers.py): bf16 on a GPU only (the interpreter truncates to bf16, the GPU rounds)
@pytest.mark.parametrize("dtype", [p.values[0] for p in KERNEL_DTYPE_PARAMS], ids=[p.id for p in KERNEL_DTYPE_PARAMS])
def test_logits_loss_on_both_paths(dtype, monkeypatch, device):
    """The per-token cross-entropy under ``per_adapter_loss`` on each path -- the kernels (on a GPU; here under the
    interpreter) and ``F.cross_entropy(logits.float())`` -- against an fp64 reference: the per-adapter means to fp32
    rounding, the logits' gradient (in their dtype) within twice the PyTorch path's error; ignored labels get no
    gradient; the kernel path is the one taken (calls counted)."""
    import fast_multilora.kernels.cross_entropy as kce

    import fast_multilora.loss as fl

    calls = []
    real = kce.cross_entropy_fwd
    monkeypatch.setattr(kce, "cross_entropy_fwd", lambda z, t: calls.append(z.shape) or real(z, t))
    g = torch.Generator().manual_seed(4)
    names = ["b", "a", "__base__", "a"]
    labels = torch.randint(0, 300, (4, 9), generator=g)
    labels[1, 3:6] = -100
    logits64 = torch.randn(4, 9, 300, generator=g, dtype=torch.float64) * 3
    labels, logits64 = labels.to(device), logits64.to(device)  # (the kernels: on a GPU, or here the interpreter)
    weights = torch.tensor([0.5, 2.0], dtype=torch.float64, device=device)

    def run(x):
        means, _ = fl.adapter_token_means(x, labels, names, ["a", "b"])
        (means.double() * weights).sum().backward()
        return means.detach().double(), x.grad.double()

    x64 = logits64.to(dtype).double().requires_grad_()  # the fp64 reference of the same logits, by hand
    lab = torch.cat([labels[:, 1:], torch.full((4, 1), -100, device=device)], 1)
    ce = F.cross_entropy(x64.reshape(-1, 300), lab.reshape(-1), reduction="none").view(4, 9)
    valid = lab != -100
    means64 = torch.stack([ce[[1, 3]][valid[[1, 3]]].mean(), ce[0][valid[0]].mean()])
    (means64 * weights).sum().backward()
    want = (means64.detach(), x64.grad)
    got = run(logits64.to(dtype).requires_grad_())
    assert len(calls) == 1
    monkeypatch.setattr(fl, "_kernel_for", lambda z: False)
    base = run(logits64.to(dtype).requires_grad_())
    assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(base[0], want[0], rtol=1e-5, atol=0)
    err, base_err = ((v[1] - want[1]).abs().max().item() for v in (got, base))
    # (fp32: PyTorch's path rounds the gradient almost correctly, 1.6e-8 at a largest gradient of 0.25 on an H100;
    # the kernel's log-sum-exp is accumulated in fp32 chunk by chunk, and its rounding enters every exp(z - lse):
    # 6.9e-8, 2.3 ulps of that largest gradient. A floor of 4 fp32 ulps of it; 16-bit: twice PyTorch's error)
    floor = 4 * torch.finfo(torch.float32).eps * want[1].abs().max().item()
    assert err <= 2 * base_err + floor, (err, base_err, floor)
    assert got[1][1, 2:5].abs().sum() == 0 and got[1][2].abs().sum() == 0  # ignored labels, the base row


def test_logits_loss_label_outside_the_vocabulary_is_nan_on_the_kernel_path(device):
    """A label outside ``[0, V)`` (not ``ignore_index``) makes its adapter's mean NaN on the kernels' path (no host
    read to raise on, as the fused loss); the other adapter's mean stays finite."""
    labels = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(5))
    labels[0, 3] = 77
    logits = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(6))
    labels, logits = labels.to(device), logits.to(device)
    means, _ = fast_multilora.loss.adapter_token_means(logits, labels, ["a", "b"], ["a", "b"])
    assert torch.isnan(means[0]) and torch.isfinite(means[1])


def test_token_cross_entropy_equals_torch_and_falls_back_with_a_warning(monkeypatch, device):
    """``loss.token_cross_entropy`` on the kernels equals ``F.cross_entropy(z.float(), reduction="none")`` in value and
    gradient for any upstream gradient (an ignored token's is 0 even where the upstream is not); a kernel that cannot
    compile (Triton's OutOfResources, say), in the backward or the forward, gives one warning, then PyTorch's ops."""
    import fast_multilora.kernels.cross_entropy as kce
    from triton.runtime.errors import OutOfResources

    import fast_multilora.loss as fl

    g = torch.Generator().manual_seed(8)
    z = torch.randn(13, 70, generator=g).to(device).requires_grad_()
    labels = torch.randint(0, 70, (13,), generator=g)
    labels[[2, 7]] = -100
    up = torch.rand(13, generator=g) + 0.5
    labels, up = labels.to(device), up.to(device)
    want = F.cross_entropy(z.float(), labels, reduction="none")
    (want_grad,) = torch.autograd.grad(want, z, up)
    got = fl.token_cross_entropy(z, labels)
    (got_grad,) = torch.autograd.grad(got, z, up)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert got_grad[[2, 7]].abs().sum() == 0

    def fails(*args):
        raise OutOfResources(300000, 232448, "shared memory")

    # the backward's kernel fails first: the gradient from PyTorch's ops, one warning
    monkeypatch.setattr(kce, "cross_entropy_bwd", fails)
    monkeypatch.setattr(fl, "_KERNEL_OFF", [])
    ce = fl.token_cross_entropy(z, labels)
    with pytest.warns(UserWarning, match="cross-entropy kernels could not run on this GPU .*OutOfResources"):
        (late,) = torch.autograd.grad(ce, z, up)
    torch.testing.assert_close(late, want_grad, rtol=1e-5, atol=1e-7)
    assert late[[2, 7]].abs().sum() == 0
    monkeypatch.setattr(kce, "cross_entropy_fwd", fails)
    monkeypatch.setattr(fl, "_KERNEL_OFF", [])
    with pytest.warns(UserWarning, match="cross-entropy kernels could not run on this GPU .*OutOfResources"):
        again = fl.token_cross_entropy(z, labels)
    torch.testing.assert_close(again, want, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl.token_cross_entropy(z, labels)
