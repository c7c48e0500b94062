"""QLoRA on CUDA (needs bitsandbytes' CUDA build: the GPU run installs a carried wheel): the checks of
test_quantized.py in bf16 on the GPU, where the Triton kernels run bf16 dots -- per sample against stock PEFT
(logits, input and LoRA gradients, train and eval, 4-bit nf4 with double quantization and 8-bit bases, PEFT's fp32
adapters and bf16 adapters) with the same tolerance rule -- and the QLoRA training recipe with bitsandbytes'
``PagedAdamW8bit`` paging its states (on the CPU it falls back to unpaged)."""

import pytest
from test_quantized import BF16, _4bit, check_dtypes_match_peft, checkpoint, needs_bnb, run_qlora_recipe

pytestmark = [pytest.mark.gpu, needs_bnb, pytest.mark.filterwarnings("ignore::UserWarning")]
__all__ = ["checkpoint"]  # the module-scoped tiny Llama checkpoint fixture

CASES = [
    pytest.param(_4bit("nf4", BF16, True), None, id="nf4-dq-bf16-fp32lora"),
    pytest.param(_4bit("nf4", BF16, True), BF16, id="nf4-dq-bf16-bf16lora"),
    pytest.param(_4bit("fp4", BF16), None, id="fp4-bf16-fp32lora"),
    pytest.param(dict(load_in_8bit=True), None, id="int8-bf16-fp32lora"),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("quant, lora_dtype", CASES)
def test_qlora_bf16_matches_peft_on_cuda(checkpoint, backend, quant, lora_dtype, train):
    check_dtypes_match_peft(checkpoint, backend, quant, BF16, lora_dtype, None, train, device="cuda")


def test_qlora_recipe_paged_adamw_on_cuda(checkpoint, tmp_path):
    run_qlora_recipe(checkpoint, tmp_path, device="cuda")
