"""Triton kernels for segmented multi-LoRA and their thin launchers (imports torch and triton only).

Installed as ``fast_multilora.kernels``.
"""

from .adamw import CHUNK, ChunkTable, adamw_scalars_, adamw_step_, chunk_table, grad_sq_norms, scale_grads_
from .backward import lora_expand_bwd, lora_shrink_bwd
from .decode import DECODE_MAX_ROWS, lora_shrink_expand
from .dropout import keep_bits_buffer
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
           "keep_bits_buffer",
           "CHUNK", "ChunkTable", "chunk_table", "adamw_scalars_", "adamw_step_", "grad_sq_norms", "scale_grads_"]
