"""The Triton kernels compile for a GPU target (sm_90 PTX) on a machine without one, in a
separate process (no TRITON_INTERPRET), and the rejection kernel divides as torch does."""

from __future__ import annotations

import os
import subprocess
import sys

COMPILE_SCRIPT = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from draftwise.kernels import triton_ops as t

PTR16 = ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")
cases = [
    (t._write_kv_kernel, dict.fromkeys(("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"), "*bf16")
     | {"slot_ptr": "*i64"} | dict.fromkeys(("k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h"), "i32"),
     {"H": 8, "D": 128, "BLOCK_H": 8, "BLOCK_D": 128}),
]
for dtype, has_res in (("*bf16", True), ("*fp16", False), ("*fp32", True)):
    sig = dict.fromkeys(PTR16, dtype) | {"x_stride": "i32", "res_stride": "i32", "N": "i32", "eps": "fp32"}
    cases.append((t._rms_norm_kernel, sig, {"HAS_RES": has_res, "BLOCK": 2048}))
for consts in ({"HAS_Q": True}, {"HAS_Q": False}, {"HAS_Q": True, "K": 1}):  # Triton specialises ints == 1
    sig = dict.fromkeys(("p_ptr", "q_ptr", "u_ptr", "noise_ptr"), "*fp32") | {"greedy_ptr": "*i1"}
    sig |= dict.fromkeys(("ids_ptr", "num_draft_ptr", "num_acc_ptr", "final_ptr"), "*i64")
    sig |= {"K": "i32", "V": "i32", "tiny": "fp32"}
    cases.append((t._rejection_accept_kernel, sig, consts | {"BLOCK_V": 1024}))
for fn, sig, consts in cases:
    sig = sig | dict.fromkeys(consts, "constexpr")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    divs = sorted(set(re.findall(r"\\bdiv\\.[a-z0-9.]+", ptx)))
    print(fn.__name__, consts, divs)
    if fn is t._rejection_accept_kernel:  # the acceptance test and the race divide as torch does
        assert divs == ["div.rn.f32"], divs
"""


def test_kernels_compile_for_a_gpu_target(tmp_path: os.PathLike[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("_rejection_accept_kernel") == 3, res.stdout
