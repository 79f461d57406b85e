"""The default CPU thread count: physical cores, as llama.cpp picks for llama-server."""

from __future__ import annotations

from pathlib import Path

from decider.settings import Settings, physical_cores


def _sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, listed in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    return root


def test_two_hardware_threads_per_core_count_as_one_core(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})  # an ml.c7i.xlarge: 4 vCPUs, 2 cores
    assert physical_cores(sysfs, {0, 1, 2, 3}) == 2
    assert physical_cores(sysfs, {0, 2}) == 1  # a cpuset of one core's two threads
    assert physical_cores(_sysfs(tmp_path / "one", {0: "0", 1: "1"}), {0, 1}) == 2  # one thread per core


def test_without_topology_the_count_is_unknown(tmp_path: Path) -> None:
    assert physical_cores(tmp_path, {0, 1}) is None
    assert physical_cores(tmp_path, set()) is None


def test_the_setting_wins_over_the_default() -> None:
    assert Settings(model_path="/m.gguf", n_threads=3).threads() == 3
    assert Settings(model_path="/m.gguf").threads() >= 1
