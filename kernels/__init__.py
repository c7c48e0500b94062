"""Triton kernels for segmented multi-LoRA and their thin launchers (imports torch and triton only).

Installed as ``fast_multilora.kernels``.
"""

from .backward import lora_expand_bwd, lora_shrink_bwd
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
           "slot_weights", "lora_expand", "lora_shrink", "lora_expand_bwd", "lora_shrink_bwd", "keep_bits_buffer"]
