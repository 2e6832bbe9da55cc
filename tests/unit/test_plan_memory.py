"""The memory tier in ``ds-async-ckpt plan`` (formula 11 of ``tools/formulas.py``): two
Young/Daly intervals, the ``persist_every`` between them, the work lost per failure with and
without the tier, the host memory per node, and the ``async_checkpoint.memory`` object it
suggests. Every expected number is worked out by hand next to it."""

import json
import math

import pytest

from deepspeed_async_ckpt.memory.config import parse_memory
from deepspeed_async_ckpt.tools import cli
from deepspeed_async_ckpt.tools.capacity import PlanInputError, PlanInputs, make_plan
from deepspeed_async_ckpt.tools.formulas import memory_lost_fraction, memory_node_bytes

approx = pytest.approx


def one_gpu(**overrides) -> PlanInputs:
    # 1 GPU, M = mtbf = 10,000 s; 1e6 params (14 MB) at 1000 GB/s: no floor binds
    kw = dict(params=1_000_000, tp=1, pp=1, dp=1, gpus_per_node=1, storage_write_gbps=1000.0,
              mtbf_hours=10_000 / 3600, memory=True, memory_survives_fraction=0.5,
              memory_save_s=0.5, disk_save_s=8.0)
    kw.update(overrides)
    return PlanInputs(**kw)


def test_each_interval_is_young_daly_with_its_own_cost_and_the_failures_that_fall_back_to_it():
    m = make_plan(one_gpu()).memory
    # memory: sqrt(2 * 0.5 * 10000 / 0.5) = sqrt(20000) = 141.42 s
    assert m.memory_interval_s == approx(math.sqrt(20_000))
    # disk: sqrt(2 * 8 * 10000 / 0.5) = sqrt(320000) = 565.69 s = 4.000 memory intervals
    assert m.young_daly_disk_interval_s == approx(math.sqrt(320_000))
    assert m.persist_every == 4 and m.disk_interval_s == approx(4 * math.sqrt(20_000))
    # disk only at the same cost: sqrt(2 * 8 * 10000) = 400 s
    assert m.interval_without_s == approx(400.0)
    # lost per failure: 0.5 * 141.42/2 + 0.5 * 565.69/2 = 176.78 s, against 400/2 = 200 s
    assert m.lost_per_failure_s == approx(0.25 * (math.sqrt(20_000) + math.sqrt(320_000)))
    assert m.lost_per_failure_without_s == approx(200.0)
    assert m.lost_per_failure_s / m.lost_per_failure_without_s == approx(0.8839, abs=1e-4)
    # per day: 86400 / 10000 = 8.64 failures
    assert m.lost_per_day_without_s == approx(8.64 * 200.0)
    # lost fraction: 0.5/141.42 + 8/565.69 + 0.5*141.42/20000 + 0.5*565.69/20000
    want = (0.5 / math.sqrt(20_000) + 8 / math.sqrt(320_000)
            + 0.5 * math.sqrt(20_000) / 20_000 + 0.5 * math.sqrt(320_000) / 20_000)
    assert m.lost_fraction == approx(want)
    assert m.lost_fraction == approx(memory_lost_fraction(0.5, 8.0, math.sqrt(20_000), 4, 10_000, 0.5))
    assert m.lost_fraction_without == approx(8 / 400 + 400 / 20_000)  # 4 %
    assert m.lost_fraction < m.lost_fraction_without


def test_more_failures_served_from_memory_shorten_the_memory_interval_and_lengthen_the_disk_one():
    low, high = make_plan(one_gpu(memory_survives_fraction=0.2)).memory, make_plan(one_gpu(
        memory_survives_fraction=0.8)).memory
    assert low.memory_interval_s / high.memory_interval_s == approx(2.0)  # sqrt(0.8 / 0.2)
    assert high.young_daly_disk_interval_s / low.young_daly_disk_interval_s == approx(2.0)  # sqrt(0.8 / 0.2)
    assert high.lost_per_failure_s < low.lost_per_failure_s


def test_disk_saves_never_queue_up_behind_a_write_longer_than_their_interval():
    # 1e9 params * 14 B = 14 GB at 0.1 GB/s: a 140 s write; memory interval 141.42 s, disk YD 565.69 s
    m = make_plan(one_gpu(params=1_000_000_000, storage_write_gbps=0.1, disk_save_s=0.6)).memory
    # disk YD sqrt(2 * 0.6 * 10000 / 0.5) = 154.9 s -> round(154.9 / 141.42) = 1, and 141.42 >= 140
    assert m.persist_every == 1
    m = make_plan(one_gpu(params=1_000_000_000, storage_write_gbps=0.05, disk_save_s=0.6)).memory
    # a 280 s write: the disk interval is floored there (280 / 141.42 = 1.98 -> 2)
    assert m.disk_interval_s >= 280 and m.persist_every == 2


def test_memory_intervals_are_whole_steps_covering_the_copy():
    m = make_plan(one_gpu(step_time_s=10.0)).memory
    assert m.memory_interval_steps == 14 and m.memory_interval_s == approx(140.0)  # round(14.14)


def test_a_node_holds_its_optimizer_shards_and_one_copy_of_each_weight_shard_on_it():
    # 16 GPUs, 8 per node, tp 2: 8 * 1600/16 of optimizer state + 2 of 2 weight shards of 100 each
    assert memory_node_bytes(200.0, 1600.0, 16, 8, 2) == approx(800.0 + 200.0)
    # tp 8 x pp 2 = 16 shards, 8 on the node: half of the weights
    assert memory_node_bytes(160.0, 0.0, 32, 8, 16) == approx(80.0)
    plan = make_plan(one_gpu(memory_keep_last=3))
    assert plan.memory.host_bytes_per_node == approx(4 * plan.total_bytes)  # one GPU holds it all


def test_the_suggested_config_is_one_the_engine_parses(capsys):
    argv = ["plan", "--params", "7e9", "--dp", "64", "--write-gbps", "20", "--mtbf-hours", "50000",
            "--memory", "--memory-keep-last", "3", "--disk-save-s", "2", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    config = parse_memory(out["memory"]["config"])
    assert config.enabled and config.keep_last == 3 and config.persist_every == out["memory"]["persist_every"]
    assert config.max_bytes >= out["memory"]["host_bytes_per_node"]
    assert cli.main(argv[:-1]) == 0
    table = capsys.readouterr().out
    assert "Memory tier" in table and f'"persist_every": {config.persist_every}' in table


def test_without_the_flag_the_plan_has_no_memory_tier(capsys):
    assert make_plan(one_gpu(memory=False)).memory is None
    assert cli.main(["plan", "--params", "7e9", "--write-gbps", "20", "--mtbf-hours", "50000"]) == 0
    assert "Memory tier" not in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, field", [
    ("--memory-survives", "1", "memory_survives_fraction"),
    ("--memory-survives", "0", "memory_survives_fraction"),
    ("--memory-keep-last", "0", "memory_keep_last"),
    ("--memory-save-s", "-1", "memory_save_s"),
    ("--disk-save-s", "0", "disk_save_s"),
    ("--host-memory-gb", "0", "host_memory_gb_per_node"),
])
def test_bad_memory_flags_are_refused_naming_the_flag(capsys, flag, value, field):
    argv = ["plan", "--params", "7e9", "--write-gbps", "20", "--mtbf-hours", "50000", "--memory", flag, value]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and flag in err


def test_a_node_short_of_host_memory_is_warned_naming_the_flags():
    plan = make_plan(one_gpu(params=10_000_000_000, host_memory_gb_per_node=100.0))
    # 10e9 * 14 B = 140 GB per checkpoint; 3 of them and 140 GB of pinned staging: 560 GB
    assert any("560 GB" in w and "--host-memory-gb" in w and "--memory-keep-last" in w for w in plan.warnings)
    with pytest.raises(PlanInputError, match="memory_survives_fraction"):
        one_gpu(memory_survives_fraction=1.5)


def test_a_restart_from_memory_counts_for_the_failures_memory_serves():
    slow, fast = (make_plan(one_gpu(restart_s=600.0, memory_restart_s=r)).memory for r in (600.0, 60.0))
    # 0.5 of the failures restart 540 s sooner: 270 s per failure, 270 / 10000 of the time
    assert slow.lost_per_failure_s - fast.lost_per_failure_s == approx(270.0)
    assert slow.lost_fraction - fast.lost_fraction == approx(0.027)
    assert fast.lost_per_failure_without_s == approx(200.0 + 600.0)
