"""``per_adapter_loss``: the sum over adapters of each adapter's mean token loss; ``return_dict`` gives the
per-adapter means as plain floats without autograd warnings."""

import warnings

import torch
import torch.nn.functional as F

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
