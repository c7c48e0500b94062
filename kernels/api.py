"""The launchers and tables of the Triton kernels for segmented multi-LoRA, in one namespace (torch and triton only).

The folder kernels/ is ``fast_multilora.kernels`` (pyproject's package-dir; a source tree's ``fast_multilora`` maps
it so itself) and has no ``__init__.py`` on purpose: a regular package there would be the top-level name ``kernels``
whenever a checkout's root is on ``sys.path`` and hide PyPI's distribution of that name, which transformers imports.
The library and the tests import these names from here (``from fast_multilora.kernels import api as K``) or from
the module that defines each.
"""

from .adamw import (
    CHUNK,
    ChunkTable,
    adamw_scalars_,
    adamw_step_,
    adapter_chunks,
    chunk_table,
    grad_sq_norms,
    scale_grads_,
)
from .backward import lora_expand_bwd, lora_shrink_bwd
from .cross_entropy import cross_entropy_, cross_entropy_bwd, cross_entropy_fwd
from .decode import DECODE_MAX_ROWS, lora_shrink_expand
from .dora import dora_combine, dora_combine_bwd, dora_gates
from .dropout import keep_bits_buffer, scale_by_keep
from .forward import lora_expand, lora_shrink
from .segments import (
    AdapterTable,
    Segments,
    SlotWeights,
    grouped_segments,
    row_segments,
    segments_from_token_slots,
    slot_weights,
)

__all__ = ["AdapterTable", "Segments", "SlotWeights", "grouped_segments", "row_segments", "segments_from_token_slots",
           "slot_weights", "lora_expand", "lora_shrink", "lora_expand_bwd", "lora_shrink_bwd",
           "DECODE_MAX_ROWS", "lora_shrink_expand",
           "keep_bits_buffer", "scale_by_keep", "dora_combine", "dora_combine_bwd", "dora_gates",
           "CHUNK", "ChunkTable", "chunk_table", "adamw_scalars_", "adamw_step_", "adapter_chunks", "grad_sq_norms",
           "scale_grads_", "cross_entropy_", "cross_entropy_fwd", "cross_entropy_bwd"]
