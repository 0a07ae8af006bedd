from __future__ import annotations

import os

# Nothing may reach a hub during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU is present (the
# kernel tests compare them with their torch twins). Set before anything imports triton.
if os.environ.get("DRAFTWISE_TEST_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
