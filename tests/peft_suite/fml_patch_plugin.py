"""pytest plugin for running PEFT's own test suite against patched models.

Every ``PeftModel`` (``get_peft_model``, ``PeftModel.from_pretrained``, ...) and every ``LoraModel`` the tests build
is passed through :func:`fast_multilora.patch` right after construction, so the tests then exercise the patched
classes: repr, merge/unmerge, disable_adapter, set/add/delete_adapter, get_layer_status, saving and loading, and --
where the tests pass ``adapter_names`` -- our mixed-batch routing. Used by ``tests/peft_suite/run.sh``; not part of
this project's own test run. Patch warnings (layers left on PEFT's path) are silenced so that tests asserting "no
warnings" test PEFT's behaviour, not ours. At the end the plugin prints how many models and layers it patched.
"""

from __future__ import annotations

import warnings

_STATS = {"models": 0, "patched_layers": 0, "fallback_layers": 0, "errors": 0}
_ORIG: dict = {}


def _patch(model) -> None:
    import fast_multilora

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = fast_multilora.patch(model)
    except Exception:  # noqa: BLE001 - counted and re-raised: a patch failure must fail the test
        _STATS["errors"] += 1
        raise
    _STATS["models"] += 1
    _STATS["patched_layers"] += len(report.patched)
    _STATS["fallback_layers"] += len(report.fallback)


_DEPTH = [0]  # constructions in progress: a LoraModel built inside a PeftModel is patched once, as the PeftModel


def _wrap(cls) -> None:
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        _DEPTH[0] += 1
        try:
            orig(self, *args, **kwargs)
        finally:
            _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            _patch(self)

    _ORIG[cls] = orig
    cls.__init__ = __init__


def pytest_configure(config):
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    _wrap(PeftModel)
    _wrap(LoraModel)


def pytest_unconfigure(config):
    for cls, orig in _ORIG.items():
        cls.__init__ = orig
    _ORIG.clear()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"fast_multilora: patched {_STATS['models']} models ({_STATS['patched_layers']} LoRA Linear layers on our "
        f"path, {_STATS['fallback_layers']} on PEFT's), {_STATS['errors']} patch errors")
