"""One call each of the write-mode expand, the add-mode expand and the shrink at S=16384, K=N=2048 (bf16, r=16,
8 adapters), for ``ncu`` to profile: ``ncu --section SpeedOfLight python benchmarks/ncu_expand.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bandwidth import case  # noqa: E402
from fast_multilora.kernels import api as K  # noqa: E402

segs, table, x, A_cat, B_cat = case(16384, 2048, 2048)
y = torch.empty_like(x)
h = K.lora_shrink(x, A_cat, segs, table)
y.zero_()
K.lora_expand(h, B_cat, segs, table, y, accumulate=False)
K.lora_expand(h, B_cat, segs, table, y)
torch.cuda.synchronize()
