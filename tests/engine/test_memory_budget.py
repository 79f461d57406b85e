"""The host tier's default and the instance fit (decider.memory_budget): the formula on known numbers,
and the measurement read from /proc and /sys trees laid out as Linux lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from decider.memory_budget import (
    GIB,
    HOST_TIER_CAP,
    MIB,
    RESERVE,
    Footprint,
    fit_problems,
    host_tier_bytes,
    memory_limit,
    memory_need,
    size_host_tier,
)
from decider.settings import Settings

# Qwen3.5-4B Q4_K_M (cdk.json's model): 8 of 32 layers attend, 4 KV heads of 256; 24 delta-net layers
QWEN35_4B = Footprint(
    file_bytes=3_013_027_808,
    kv_bytes_per_token=8 * 2 * 4 * 256 * 2,
    recurrent_bytes_per_sequence=24 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 4),
    n_vocab=248_320,
)


def machine(tmp_path: Path, *, total_kib: int, rss_anon_kib: int, cgroup: str | None = None) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       {total_kib} kB\nMemFree:  1 kB\n")
    (tmp_path / "proc/self/status").write_text(f"Name:\tpython\nRssAnon:\t{rss_anon_kib} kB\nRssFile: 5 kB\n")
    if cgroup is not None:
        (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
        (tmp_path / "sys/fs/cgroup/memory.max").write_text(cgroup + "\n")
    return tmp_path


def test_half_of_what_is_left_after_the_engine_the_model_and_the_reserve():
    # an 8 GiB instance, the 4B model's file, 1 GiB of engine memory: (8 - 1 - 2.8 - 1) / 2
    size = host_tier_bytes(8 * GIB, 1 * GIB, QWEN35_4B.file_bytes)
    assert size == int(0.5 * (8 * GIB - 1 * GIB - QWEN35_4B.file_bytes - RESERVE))
    assert 1.5 * GIB < size < 1.7 * GIB  # the old fixed 2 GiB would not have fitted beside the rest
    assert host_tier_bytes(512 * GIB, 1 * GIB, QWEN35_4B.file_bytes) == HOST_TIER_CAP
    assert host_tier_bytes(4 * GIB, 1 * GIB, QWEN35_4B.file_bytes) == 0  # nothing left: no tier


def test_the_cgroup_limit_wins_over_the_machine_and_max_means_none(tmp_path):
    root = machine(tmp_path / "a", total_kib=64 * 1024 * 1024, rss_anon_kib=1024, cgroup=str(8 * GIB))
    assert memory_limit(root) == 8 * GIB
    root = machine(tmp_path / "b", total_kib=64 * 1024 * 1024, rss_anon_kib=1024, cgroup="max")
    assert memory_limit(root) == 64 * GIB


def test_the_size_is_measured_from_the_engine_s_own_memory(tmp_path):
    root = machine(tmp_path, total_kib=16 * 1024 * 1024, rss_anon_kib=2 * 1024 * 1024, cgroup=str(8 * GIB))
    size = size_host_tier(3 * GIB, root)
    assert (size.limit, size.engine, size.model) == (8 * GIB, 2 * GIB, 3 * GIB)
    assert size.bytes == 1 * GIB
    assert (
        "host tier 1.00 GiB = 0.5 x (limit 8.00 GiB - engine 2.00 GiB - model file 3.00 GiB"
        in size.describe()
    )


def test_unset_means_sized_at_start_and_zero_means_off():
    assert Settings(model_path="/m.gguf").cache_budget.host_bytes is None
    assert not Settings(model_path="/m.gguf").cache_budget.host  # until the engine sizes it
    assert Settings(model_path="/m.gguf", state_cache_host_mib=512).cache_budget.host_bytes == 512 * MIB


def test_the_4b_model_fits_an_8_gib_cpu_instance_but_not_beside_the_old_fixed_2_gib_tier():
    need = memory_need(QWEN35_4B, n_ctx=8192, n_seq_max=32, n_batch=2048, host_tier=0, on_gpu=False)
    assert need.kv == 256 * MIB and 50 * MIB < need.recurrent / 32 < 51 * MIB
    assert round(need.outputs / GIB, 2) == 1.89  # 2048 rows of 248,320 f32 logits
    assert fit_problems(need, host_memory=8 * GIB) == []  # the tier is sized from what is left
    fixed = memory_need(QWEN35_4B, n_ctx=8192, n_seq_max=32, n_batch=2048, host_tier=2 * GIB, on_gpu=False)
    (problem,) = fit_problems(fixed, host_memory=8 * GIB)
    assert problem.startswith("host memory: model 2.8 GiB + KV cache 0.2 GiB + recurrent states 1.6 GiB")
    assert "host tier 2.0 GiB + reserve 1.0 GiB = 9.5 GiB > the instance's 8.0 GiB" in problem


@pytest.mark.parametrize(("gpu", "fits"), [(24 * GIB, True), (4 * GIB, False)])
def test_offloaded_layers_are_counted_on_the_gpu(gpu, fits):
    need = memory_need(QWEN35_4B, n_ctx=8192, n_seq_max=32, n_batch=512, host_tier=0, on_gpu=True)
    problems = fit_problems(need, host_memory=16 * GIB, gpu_memory=gpu)
    assert (problems == []) is fits
    if not fits:
        assert problems[0].startswith("GPU memory:")
