"""fast-multilora: train and evaluate many PEFT LoRA adapters in one mixed batch.

    import fast_multilora
    report = fast_multilora.patch(peft_model)          # swaps PEFT LoRA Linear layers in place
    out = peft_model(**batch, adapter_names=names)     # one name per sample, "__base__" for none; train or eval
    loss = fast_multilora.per_adapter_loss(out.logits, batch["labels"], names)
"""

from .loss import per_adapter_loss, per_adapter_mean
from .patching import PatchReport, patch, route, unpatch
from .plan import BASE

__version__ = "0.1.0"

__all__ = ["BASE", "PatchReport", "patch", "per_adapter_loss", "per_adapter_mean", "route", "unpatch"]
