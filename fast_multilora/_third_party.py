"""What this library does to its third-party dependencies as it is imported.

``quiet_import``: importing peft imports transformers, torchao and bitsandbytes, which log or warn about their own
set-up; the known messages, none of them about this library, are dropped while ``fast_multilora`` imports peft.
``hint_patch_in_peft_training_error``: PEFT's refusal of ``adapter_names`` in training mode names
``fast_multilora.patch`` (docs/errors.md).
"""

import contextlib
import functools
import logging
import re
import warnings


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# What importing peft (and through it transformers, torchao and bitsandbytes) logs or warns about their own set-up,
# none of it about this library (2026-12: peft 0.21.2, transformers 5.25, torchao 0.18, bitsandbytes 0.50, torch 2.13).
_IMPORT_NOISE = (
    ("torchao", "Failed to load "),  # its CUDA extensions, on a machine without CUDA
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),  # torchao registers two enums
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),  # a hub kernel, on AVX512-BF16 CPUs
)
# bitsandbytes calls torch.compile as it is imported, which imports torch's own torch.utils.mkldnn, which calls the
# deprecated torch.jit.script_method
_IMPORT_WARNINGS = (("`torch.jit.script_method` is deprecated", DeprecationWarning),)


@contextlib.contextmanager
def quiet_import():
    """Those messages (and only those) dropped while the block imports, the loggers and warning filters restored."""
    filters = [(logging.getLogger(name), _Drop(text)) for name, text in _IMPORT_NOISE]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        with warnings.catch_warnings():
            for text, category in _IMPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(text), category=category)
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


# PEFT's LoraModel refuses `adapter_names` in training mode with this sentence (peft 0.21: tuners/lora/model.py)
PEFT_TRAINING_MODE = "Cannot pass `adapter_names` when the model is in training mode."
PATCH_HINT = (" This model is not patched by fast_multilora: call fast_multilora.patch(model) on the PeftModel to "
              "train a mixed batch of adapters (model.eval() runs PEFT's own per-sample loop instead).")


def hint_patch_in_peft_training_error() -> None:
    """PEFT's training-mode refusal of ``adapter_names`` (raised by ``LoraModel._enable_peft_forward_hooks``) goes on
    to name the fix where fast_multilora is imported: PEFT's sentence first, so code matching it still matches; every
    other error of that method, and everything else it does, unchanged. Wraps the method once per process."""
    from peft.tuners.lora.model import LoraModel

    hooks = LoraModel.__dict__["_enable_peft_forward_hooks"]
    if getattr(hooks, "_fml_patch_hint", False):
        return

    @contextlib.contextmanager
    @functools.wraps(hooks)
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hooks(self, *args, **kwargs))
            except ValueError as e:
                if e.args and isinstance(e.args[0], str) and e.args[0].startswith(PEFT_TRAINING_MODE):
                    e.args = (e.args[0] + PATCH_HINT, *e.args[1:])
                raise
            yield

    _enable_peft_forward_hooks._fml_patch_hint = True
    LoraModel._enable_peft_forward_hooks = _enable_peft_forward_hooks
