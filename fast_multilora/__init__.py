"""fast-multilora: train and evaluate many PEFT LoRA adapters in one mixed batch."""

__version__ = "0.1.0"
