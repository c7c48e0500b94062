"""fast-multilora: train and evaluate many PEFT LoRA adapters in one mixed batch.

    import fast_multilora
    report = fast_multilora.patch(peft_model)          # swaps PEFT LoRA Linear layers in place
    out = peft_model(**batch, adapter_names=names)     # one name per sample, "__base__" for none; train or eval
    loss = fast_multilora.per_adapter_loss(out.logits, batch["labels"], names)
    loss = fast_multilora.fused_causal_lm_loss(peft_model, {**batch, "adapter_names": names})  # no logits built
"""

import importlib.machinery as _ilm
import importlib.util as _ilu
import os as _os
import sys as _sys

import torch as _torch  # noqa: F401  (before _quiet_import: torch sets its own loggers up as it is imported)

from ._third_party import hint_patch_in_peft_training_error as _hint_patch_in_peft_training_error
from ._third_party import quiet_import as _quiet_import

# fast_multilora.kernels, the Triton kernels: an installed wheel has them in fast_multilora/kernels/, a source tree in
# its root folder kernels/ (pyproject's package-dir maps it). That folder has no __init__.py, so from a checkout's root
# the top-level name ``kernels`` stays PyPI's distribution (transformers imports it). A source tree's package declares
# its own tree's folder here, as the namespace package Python makes of such a folder: setuptools' editable finder
# cannot map a folder without __init__.py, and would hand a second checkout imported from sys.path (a worktree beside
# an editable install of another) the installed tree's kernels.
_tree_kernels = _os.path.join(_os.path.dirname(__path__[0]), "kernels")
if not _os.path.isdir(_os.path.join(__path__[0], "kernels")) and _os.path.isdir(_tree_kernels):
    _spec = _ilm.ModuleSpec(__name__ + ".kernels", None, is_package=True)
    _spec.submodule_search_locations = [_tree_kernels]
    kernels = _sys.modules[_spec.name] = _ilu.module_from_spec(_spec)


with _quiet_import():  # what peft's import logs about transformers', torchao's and bitsandbytes' set-up
    import peft as _peft  # noqa: E402, F401  (the library's first third-party import after torch)
_hint_patch_in_peft_training_error()  # PEFT's refusal of `adapter_names` in training names the fix

from .adapters import add_adapters, delete_adapters, load_adapters, save_adapters  # noqa: E402
from .config import PatchConfig  # noqa: E402
from .ddp import fsdp_ignored_params  # noqa: E402
from .fused_loss import fused_causal_lm_loss, per_adapter_loss_from_hidden  # noqa: E402
from .loss import per_adapter_loss, per_adapter_mean  # noqa: E402
from .optim import AdamW  # noqa: E402
from .paging import prefetch  # noqa: E402
from .patching import PatchReport, patch, route, unpatch  # noqa: E402
from .plan import BASE, mark_changed  # noqa: E402
from .training import trainer_kwargs  # noqa: E402

__version__ = "0.1.0"

__all__ = ["AdamW", "BASE", "PatchConfig", "PatchReport", "add_adapters", "delete_adapters", "fsdp_ignored_params",
           "fused_causal_lm_loss", "load_adapters", "mark_changed", "patch", "per_adapter_loss",
           "per_adapter_loss_from_hidden", "per_adapter_mean", "prefetch", "route", "save_adapters", "trainer_kwargs",
           "unpatch"]
