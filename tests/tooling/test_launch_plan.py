"""Launch planning for the attention kernels (``draftwise.kernels.launch_plan``): plain Python
that imports no Triton, so the model runner plans its start-up warm-up without it; the same
choices Triton's own helpers would give."""

from __future__ import annotations

import os
import subprocess
import sys

import triton

from draftwise.kernels import launch_plan as plan


def test_planning_imports_no_triton():
    """In a fresh process without CUDA: the planning and recording modules import no Triton,
    nor does the model runner, which plans its start-up warm-up with them (run here on the
    torch twin standing in for a compiling backend)."""
    code = """
import sys
import draftwise.kernels.launch_plan, draftwise.kernels.launch_record
assert 'triton' not in sys.modules, 'launch planning imported triton'
import torch
from draftwise.worker import default_model_path
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner
loaded = load_model(default_model_path("draft"), dtype="float32")
runner = ModelRunner(loaded, KVCache(loaded.config, 8, 16, torch.float32, "cpu"))
runner.backend.name = "stand-in"  # plan and run the warm-up as a compiling backend would
steps = runner.warm_up(max_num_seqs=2, max_num_tokens=4, max_context=64)
assert steps >= 2, steps
assert 'triton' not in sys.modules, 'the warm-up imported triton'
print('ok')
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_next_power_of_2_is_tritons():
    for n in range(1, 5000):
        assert plan.next_power_of_2(n) == triton.next_power_of_2(n), n
    assert plan.next_power_of_2(0) == 1


def test_prefill_block_m():
    assert [plan.prefill_block_m(q, 1) for q in (1, 2, 16, 17, 64, 65, 4096)] == [16, 16, 16, 32, 64, 64, 64]
    assert plan.prefill_block_m(2, 8) == 16 and plan.prefill_block_m(3, 8) == 32
    assert plan.prefill_block_m(1, 128) == 128  # one group of query heads taller than 64 rows


def test_decode_num_partitions_follows_the_batch_not_max_model_len():
    """Splits fill the device at small batches and vanish at large ones; the tables' width
    only caps them (one per MIN_PARTITION_TOKENS), so a graph's wide static tables give the
    same plan as a step's narrow ones once the context allows it."""
    f = plan.decode_num_partitions
    assert f(1, 8, 32768, num_sms=132) == 64  # 528 programs wanted, 8 KV heads: 66 -> 64
    assert f(1, 8, 2048, num_sms=132) == 8  # the context caps it: 2048 / 256
    assert f(16, 8, 32768, num_sms=132) == 4
    assert f(64, 8, 32768, num_sms=132) == 1  # 512 programs already: no split, no merge
    assert f(256, 3, 1 << 20, num_sms=132) == 1
    assert f(4, 3, 8192, num_sms=132) == 32  # 44 wanted -> 32 (a power of two)
    assert f(1, 1, 1) == 1 and f(1, 1, 0) == 1
    for s in (1, 2, 3, 5, 8, 13, 64, 200):
        for ctx in (16, 300, 4096, 131072):
            p = f(s, 4, ctx, num_sms=132)
            assert (
                p & (p - 1) == 0 and 1 <= p <= plan.MAX_PARTITIONS and (p == 1 or p * plan.MIN_PARTITION_TOKENS <= ctx)
            )
