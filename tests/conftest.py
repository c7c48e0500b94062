import os
import sys

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FOR_TESTS_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))
