"""What this library does to its third-party dependencies as it is imported.

``quiet_import``: importing peft imports transformers, torchao and bitsandbytes, which log or warn about their own
set-up; the known messages, none of them about this library, are dropped while ``fast_multilora`` imports peft.
"""

import contextlib
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
