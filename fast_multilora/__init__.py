"""fast-multilora: train and evaluate many PEFT LoRA adapters in one mixed batch.

    import fast_multilora
    report = fast_multilora.patch(peft_model)          # swaps PEFT LoRA Linear layers in place
    out = peft_model(**batch, adapter_names=names)     # one name per sample, "__base__" for none; train or eval
    loss = fast_multilora.per_adapter_loss(out.logits, batch["labels"], names)
    loss = fast_multilora.fused_causal_lm_loss(peft_model, {**batch, "adapter_names": names})  # no logits built
"""

import importlib.util as _ilu
import os as _os
import sys as _sys

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_kdir = _os.path.join(_root, "kernels")
_checkout = _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(_os.path.join(_kdir,
                                                                                                   "segments.py"))
if _checkout:
    _found = _ilu.find_spec(__name__ + ".kernels")
    _here = _found is not None and _os.path.dirname(_os.path.abspath(_found.origin or "")) == _kdir
else:  # an installed package: fast_multilora/kernels/ is its own
    _here = True
if _checkout:
    import importlib.machinery as _ilm

    class _PyPIKernels:
        """The top-level name ``kernels`` is PyPI's package (transformers imports it for its hub kernels), never this
        checkout's root folder kernels/ (``fast_multilora.kernels``), which Python would find first whenever the
        checkout's root is on ``sys.path`` (``python -m`` or a REPL run from it, pytest-xdist's workers). Where PyPI's
        is not installed, the import proceeds as without this finder."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "kernels":
                return None
            return _ilm.PathFinder.find_spec(name, [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])

    if not any(isinstance(f, type) and f.__name__ == "_PyPIKernels" for f in _sys.meta_path):  # once per process
        _sys.meta_path.insert(0, _PyPIKernels)
    if _os.path.dirname(_os.path.abspath(getattr(_sys.modules.get("kernels"), "__file__", None) or _os.sep)) == _kdir:
        del _sys.modules["kernels"]  # imported from this checkout before this guard: found afresh on the next import
if not _here:
    # A source tree imported from sys.path (a plain checkout, a second worktree beside an editable install, an old
    # setuptools' legacy editable install): load this tree's root folder kernels/ as fast_multilora.kernels, as the
    # installed package has it -- never another tree's.
    _spec = _ilu.spec_from_file_location(__name__ + ".kernels", _os.path.join(_kdir, "__init__.py"),
                                         submodule_search_locations=[_kdir])
    _mod = _ilu.module_from_spec(_spec)
    _sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)

from .adapters import add_adapters, load_adapters, save_adapters  # noqa: E402
from .config import PatchConfig  # noqa: E402
from .fused_loss import fused_causal_lm_loss, per_adapter_loss_from_hidden  # noqa: E402
from .loss import per_adapter_loss, per_adapter_mean  # noqa: E402
from .optim import AdamW  # noqa: E402
from .patching import PatchReport, patch, route, unpatch  # noqa: E402
from .plan import BASE, mark_changed  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AdamW", "BASE", "PatchConfig", "PatchReport", "add_adapters", "fused_causal_lm_loss", "load_adapters",
           "mark_changed", "patch", "per_adapter_loss", "per_adapter_loss_from_hidden", "per_adapter_mean", "route",
           "save_adapters", "unpatch"]
