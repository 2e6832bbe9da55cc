"""Unit tests for the capacity planner (``deepspeed_async_ckpt.tools.capacity``, its formulas
and inputs) and the ``plan`` subcommand of the CLI.

Every expected number is worked out by hand in the comments next to it.
Reference layout ("GPT-3"): 175e9 params, bf16 + adam, tp8 pp8 dp16 = 1024
GPUs, 8 GPUs/node, 10 GB/s write and 20 GB/s read per node, MTBF 50,000 h.
"""

import dataclasses
import json
import subprocess
import sys

import pytest

from deepspeed_async_ckpt.tools import cli, plan_cmd, plan_report
from deepspeed_async_ckpt.tools.capacity import ModelShape, PlanInputError, PlanInputs, make_plan
from deepspeed_async_ckpt.tools.formulas import (
    busiest_node_bytes,
    bytes_per_param,
    cluster_mttf_s,
    estimate_params,
    interval_for_k_s,
    lazy_stall_s,
    lost_fraction,
    max_cost_for_overhead_s,
    nodes_for,
    write_time_s,
    writing_gpu_count,
    young_daly_interval_s,
)

from conftest import REPO  # noqa: E402
approx = pytest.approx


def gpt3(**overrides) -> PlanInputs:
    kw = dict(params=175_000_000_000, precision="bf16", optimizer="adam",
              tp=8, pp=8, dp=16, gpus_per_node=8,
              storage_write_gbps_per_node=10.0, storage_read_gbps_per_node=20.0,
              mtbf_hours=50_000.0)
    kw.update(overrides)
    return PlanInputs(**kw)


GPT3_ARGV = ["plan", "--params", "175e9", "--precision", "bf16", "--optimizer", "adam",
             "--tp", "8", "--pp", "8", "--dp", "16", "--gpus-per-node", "8",
             "--write-gbps-per-node", "10", "--read-gbps-per-node", "20",
             "--mtbf-hours", "50000", "--target-time", "60"]

# M = 50,000 h * 3600 s/h / 1024 GPUs = 180,000,000 / 1024 = 175,781.25 s
GPT3_MTTF_S = 175_781.25
# bytes per writing GPU = 2.45e12 / 64 = 38.28125e9; lazy copy at gen5 53 GB/s:
# 38.28125 / 53 = 0.72228773... s
GPT3_LAZY_S = 38.28125 / 53


# ---------------------------------------------------------------- size

def test_bytes_per_param_table():
    assert bytes_per_param("bf16", "adam") == (2, 4, 8)   # 14 B/param
    assert bytes_per_param("fp16", "adamw") == (2, 4, 8)
    assert bytes_per_param("fp32", "adam") == (4, 0, 8)   # no separate master copy
    assert bytes_per_param("bf16", "sgd") == (2, 4, 4)    # momentum only
    assert bytes_per_param("bf16", "none") == (2, 0, 0)   # weights-only: no optimizer, no master
    assert bytes_per_param("fp32", "none") == (4, 0, 0)


def test_175b_bf16_adam_is_2_45e12_bytes():
    p = make_plan(gpt3())
    assert p.weights_bytes == 350_000_000_000           # 175e9 * 2
    assert p.master_weights_bytes == 700_000_000_000    # 175e9 * 4
    assert p.optimizer_bytes == 1_400_000_000_000       # 175e9 * 8
    assert p.total_bytes == 2_450_000_000_000           # 175e9 * 14
    assert p.bytes_per_param == 14


def test_estimate_params_tiny_shape_by_hand():
    # L=2, h=4, f=4h=16, V=10.  Per layer 4h^2 + 2hf + 9h + f
    #   = 64 + 128 + 36 + 16 = 244; x2 layers = 488; + final norm 2h = 8 -> 496;
    #   + embeddings V*h = 40 -> 536
    s = ModelShape(num_layers=2, hidden_size=4, vocab_size=10)
    assert estimate_params(s) == 536
    # untied output layer adds another V*h = 40 -> 576
    assert estimate_params(dataclasses.replace(s, untie_embeddings=True)) == 576
    # SwiGLU: fc1 becomes 2*h*f + 2f = 160 instead of 80 -> +80/layer -> 536 + 160 = 696
    assert estimate_params(dataclasses.replace(s, swiglu=True)) == 696
    # GQA 2 heads, 1 group: kv = 4*1/2 = 2, qkv = 4*(4+4) + 8 = 40 instead of
    # 4*12 + 12 = 60 -> -20/layer -> 536 - 40 = 496
    gqa = ModelShape(num_layers=2, hidden_size=4, vocab_size=10, num_attention_heads=2,
                     num_query_groups=1)
    assert estimate_params(gqa) == 496
    # explicit ffn 8: per layer 64 + 2*4*8 + 36 + 8 = 172; x2 = 344 + 8 + 40 = 392
    assert estimate_params(dataclasses.replace(s, ffn_hidden_size=8)) == 392


def test_estimate_params_gpt3_shape():
    # L=96, h=12288, V=51200: 12h^2 = 1,811,939,328; 13h = 159,744
    # per layer 1,812,099,072; x96 = 173,961,510,912; + 2h 24,576
    # + Vh 629,145,600 = 174,590,681,088
    s = ModelShape(num_layers=96, hidden_size=12288, vocab_size=51200, num_attention_heads=96)
    assert estimate_params(s) == 174_590_681_088
    p = make_plan(gpt3(params=None, shape=s))
    assert p.params == 174_590_681_088 and p.params_estimated
    assert p.total_bytes == 174_590_681_088 * 14


# ---------------------------------------------------------------- writers

def test_writer_helpers():
    assert writing_gpu_count(8, 8, 16) == 64                 # one replica: tp*pp
    assert writing_gpu_count(8, 8, 16, "balanced") == 1024   # all ranks
    assert nodes_for(64, 8) == 8
    assert nodes_for(12, 8) == 2                             # ceil(12/8)
    assert nodes_for(1, 8) == 1
    assert busiest_node_bytes(10.0, 12, 8) == 80.0           # the full node has 8 writers
    assert busiest_node_bytes(10.0, 4, 8) == 40.0            # only 4 writers on the node


def test_gpt3_writers_and_write_time():
    p = make_plan(gpt3())
    assert (p.total_gpus, p.total_nodes) == (1024, 128)      # 8*8*16; 1024/8
    assert (p.writing_gpus, p.writing_nodes) == (64, 8)
    assert p.bytes_per_writing_gpu == approx(38.28125e9)     # 2.45e12 / 64
    assert p.bytes_per_writing_node == approx(306.25e9)      # 8 * 38.28125e9
    assert p.write_time_s == approx(30.625)                  # 306.25 GB / 10 GB/s
    assert p.sync_stall_s == approx(30.625)                  # sync stall = full write


def test_balanced_writers():
    p = make_plan(gpt3(writers="balanced"))
    assert (p.writing_gpus, p.writing_nodes) == (1024, 128)
    assert p.bytes_per_writing_gpu == approx(2.392578125e9)  # 2.45e12 / 1024
    assert p.bytes_per_writing_node == approx(19.140625e9)   # x8
    assert p.write_time_s == approx(1.9140625)               # 19.14 GB / 10 GB/s


def test_write_time_aggregate_per_node_and_both():
    # aggregate: 2.45e12 / 100 GB/s = 24.5 s; per node: 306.25e9 / 10 GB/s = 30.625 s
    assert write_time_s(2.45e12, 306.25e9, 100.0, None) == approx(24.5)
    assert write_time_s(2.45e12, 306.25e9, None, 10.0) == approx(30.625)
    assert write_time_s(2.45e12, 306.25e9, 100.0, 10.0) == approx(30.625)  # the slower one
    assert write_time_s(2.45e12, 306.25e9, 50.0, 10.0) == approx(49.0)     # 2450/50
    assert write_time_s(1.0, 1.0, None, None) is None


def test_required_bandwidth_for_target_time():
    p = make_plan(gpt3(target_checkpoint_time_s=60.0))
    assert p.required_write_gbps == approx(2450 / 60)            # 40.83 GB/s aggregate
    assert p.required_write_gbps_per_node == approx(306.25 / 60)  # 5.104 GB/s
    assert p.required_write_gbps_per_gpu == approx(38.28125 / 60)  # 0.638 GB/s
    assert p.target_met is True                                   # 30.6 s <= 60 s
    p = make_plan(gpt3(target_checkpoint_time_s=20.0))
    assert p.target_met is False and p.required_write_gbps_per_node == approx(15.3125)
    assert any("exceeds target_checkpoint_time_s 20 s" in w for w in p.warnings)


def test_restore_every_replica_reads_everything():
    p = make_plan(gpt3())
    assert p.read_bytes == 39_200_000_000_000                  # 2.45e12 * dp 16
    assert p.read_bytes_per_node == approx(306.25e9)           # 8 GPUs x 38.28 GB
    assert p.restore_time_s == approx(15.3125)                 # 306.25 / 20
    # aggregate read 1000 GB/s: 39.2e12 / 1e12 = 39.2 s
    assert make_plan(gpt3(storage_read_gbps=1000.0, storage_read_gbps_per_node=None)
                     ).restore_time_s == approx(39.2)
    assert make_plan(gpt3(storage_read_gbps_per_node=None)).restore_time_s is None


# ---------------------------------------------------------------- failures & interval

def test_cluster_mttf():
    assert cluster_mttf_s(50_000, 1024) == approx(GPT3_MTTF_S)
    assert cluster_mttf_s(50_000, 1) == approx(1.8e8)          # 50,000 * 3600


def test_young_daly():
    # sqrt(2 * 30.625 * 175,781.25) = sqrt(10,766,601.6) = 3281.2 s
    assert young_daly_interval_s(30.625, GPT3_MTTF_S) == approx(3281.2, rel=1e-4)
    # sqrt(2 * 8 * 100) = 40
    assert young_daly_interval_s(8.0, 100.0) == approx(40.0)


def test_gpt3_lazy_plan_interval_and_loss():
    p = make_plan(gpt3())
    assert p.mttf_s == approx(GPT3_MTTF_S)
    assert p.lazy_copy_s == approx(0.7222877, rel=1e-6)        # 38.28125 / 53
    assert p.stall_s == approx(GPT3_LAZY_S)                    # lazy is the default mode
    # tau = sqrt(2 * 0.7222877 * 175,781.25) = sqrt(253,929.3) = 503.914 s
    assert p.young_daly_interval_s == approx(503.914, rel=1e-5)
    assert p.interval_s == p.young_daly_interval_s and p.interval_basis == "young_daly"
    # at the Young/Daly optimum both terms are equal: C/tau = tau/2M = 0.0014334
    assert p.checkpoint_overhead_fraction == approx(0.00143336, rel=1e-4)
    assert p.rework_fraction == approx(0.00143336, rel=1e-4)
    assert p.lost_fraction == approx(0.00286671, rel=1e-5)     # = sqrt(2C/M)
    assert p.checkpoints_per_day == approx(86400 / 503.914, rel=1e-5)  # 171.46
    assert p.write_bytes_per_day == approx(2.45e12 * 86400 / 503.914, rel=1e-5)  # 420 TB
    assert p.avg_write_gbps == approx(2450 / 503.914, rel=1e-5)  # 4.862 GB/s
    assert p.checkpoints_per_failure == approx(175781.25 / 503.914, rel=1e-5)  # 348.8
    # sync side by side: tau = 3281.2 s, loss = sqrt(2*30.625/175781.25) = 1.8666 %
    assert p.sync_interval_s == approx(3281.2, rel=1e-4)
    assert p.sync_lost_fraction == approx(0.018666, rel=1e-4)
    assert p.lazy_interval_s == p.interval_s


def test_sync_mode_uses_sync_stall():
    p = make_plan(gpt3(mode="sync"))
    assert p.stall_s == approx(30.625)
    assert p.interval_s == approx(3281.2, rel=1e-4)
    assert p.lost_fraction == approx(0.018666, rel=1e-4)


def test_lost_fraction_formula():
    # C=10, tau=100, M=1000: 10/100 + 100/2000 = 0.1 + 0.05 = 0.15; R=50 adds 0.05
    assert lost_fraction(10, 100, 1000) == approx(0.15)
    assert lost_fraction(10, 100, 1000, restart_s=50) == approx(0.20)


def test_restart_time_adds_r_over_m():
    p = make_plan(gpt3(restart_s=600.0))
    assert p.restart_fraction == approx(600 / 175781.25)      # 0.0034133
    assert p.lost_fraction == approx(0.00286671 + 0.0034133, rel=1e-4)


def test_k_per_failure():
    assert interval_for_k_s(1000.0, 4) == 250.0
    # M/k = 175,781.25 / 100 = 1757.8125 s
    p = make_plan(gpt3(target_checkpoints_per_failure=100))
    assert p.interval_s == approx(1757.8125) and p.interval_basis == "k_per_failure"
    assert p.checkpoints_per_failure == approx(100)
    # loss: 0.7222877/1757.8125 + 1757.8125/351562.5 = 0.000410902 + 0.005 = 0.005410902
    assert p.lost_fraction == approx(0.005410902, rel=1e-6)
    assert p.target_met is True                                # 30.6 s write fits in 1758 s
    # k = 10,000: interval 17.58 s < 30.6 s write time -> infeasible, warned
    p = make_plan(gpt3(target_checkpoints_per_failure=10_000))
    assert p.target_met is False
    assert any("shorter than the write time" in w for w in p.warnings)


def test_overhead_target_inversion():
    # C_max = F^2 * M / 2 = 0.01^2 * 175,781.25 / 2 = 8.7890625 s
    assert max_cost_for_overhead_s(0.01, GPT3_MTTF_S) == approx(8.7890625)
    # plugging C_max back in at tau = sqrt(2CM) gives exactly the target
    c = 8.7890625
    assert lost_fraction(c, young_daly_interval_s(c, GPT3_MTTF_S), GPT3_MTTF_S) == approx(0.01)
    # with restart R: (F - R/M)^2 M/2; R = 0.005*M -> (0.005)^2 * M/2 = 2.197265625 s
    assert max_cost_for_overhead_s(0.01, GPT3_MTTF_S, 0.005 * GPT3_MTTF_S) == approx(2.197265625)
    assert max_cost_for_overhead_s(0.01, GPT3_MTTF_S, 0.02 * GPT3_MTTF_S) == 0.0

    p = make_plan(gpt3(target_overhead_fraction=0.01))
    assert p.max_stall_for_target_s == approx(8.7890625)
    assert p.required_checkpoint_time_s == approx(8.7890625)
    assert p.required_write_gbps == approx(278.7556, rel=1e-6)         # 2450 / 8.789
    assert p.required_write_gbps_per_node == approx(34.84444, rel=1e-6)  # 306.25 / 8.789
    assert p.required_d2h_gbps == approx(4.355556, rel=1e-6)           # 38.28 / 8.789
    assert p.target_met is True                                         # 0.29 % <= 1 %
    p = make_plan(gpt3(target_overhead_fraction=0.01, mode="sync"))      # 1.87 % > 1 %
    assert p.target_met is False
    assert any("exceeds target_overhead_fraction 0.01" in w for w in p.warnings)
    # restart alone (0.02 * M per failure = 2 %) exceeds a 1 % target: no C can meet it
    p = make_plan(gpt3(target_overhead_fraction=0.01, restart_s=0.02 * GPT3_MTTF_S))
    assert p.max_stall_for_target_s == 0.0 and p.required_write_gbps is None
    assert any("restart time alone" in w for w in p.warnings)


def test_lazy_stall_with_and_without_step_time():
    assert lazy_stall_s(53e9, 53.0) == approx(1.0)                     # 53 GB / 53 GB/s
    assert lazy_stall_s(53e9, 53.0, step_time_s=0.25) == approx(0.75)  # 1.0 - 0.25
    assert lazy_stall_s(53e9, 53.0, step_time_s=2.0) == 0.0            # fully hidden
    p = make_plan(gpt3(step_time_s=0.5))
    assert p.lazy_stall_s == approx(GPT3_LAZY_S - 0.5)                 # 0.2222877 s
    assert p.lazy_copy_s == approx(GPT3_LAZY_S)
    # tau = sqrt(2 * 0.2222877 * 175781.25) = 279.55 s -> 559 steps of 0.5 s
    assert p.interval_s == approx(279.55, rel=1e-4)
    assert p.save_interval_steps == 559


def test_fully_hidden_copy_floors_interval_at_write_time():
    p = make_plan(gpt3(step_time_s=5.0))                       # 0.72 s copy < 5 s step
    assert p.lazy_stall_s == 0.0 and p.young_daly_interval_s == 0.0
    assert p.interval_s == approx(30.625) and p.interval_basis == "write_time_floor"
    assert p.lost_fraction == approx(30.625 / (2 * 175781.25))  # rework only: 0.0087 %
    assert p.save_interval_steps == 7  # 35 s: 6 steps (30 s, round()) were shorter than the write


def test_d2h_defaults_per_pcie_generation():
    assert make_plan(gpt3(pcie_gen=3)).lazy_copy_s == approx(38.28125 / 12)
    assert make_plan(gpt3(pcie_gen=4)).lazy_copy_s == approx(38.28125 / 25)
    assert make_plan(gpt3(d2h_gbps=20.0, pcie_gen=3)).lazy_copy_s == approx(38.28125 / 20)


def test_dp1():
    p = make_plan(gpt3(dp=1))
    assert (p.total_gpus, p.writing_gpus, p.writing_nodes) == (64, 64, 8)
    assert p.read_bytes == p.total_bytes                       # one replica reads once
    assert p.mttf_s == approx(2_812_500.0)                     # 1.8e8 / 64
    assert p.restore_time_s == approx(15.3125)                 # per node unchanged


def test_single_gpu():
    # 1e9 bf16 adam = 14e9 B on one GPU; 2 GB/s aggregate -> 7 s; gen4 D2H 25 GB/s -> 0.56 s
    p = make_plan(PlanInputs(params=1_000_000_000, tp=1, pp=1, dp=1, gpus_per_node=8,
                             storage_write_gbps=2.0, mtbf_hours=50_000, pcie_gen=4))
    assert (p.total_gpus, p.total_nodes, p.writing_gpus, p.writing_nodes) == (1, 1, 1, 1)
    assert p.bytes_per_writing_gpu == p.bytes_per_writing_node == 14e9
    assert p.write_time_s == approx(7.0)
    assert p.lazy_stall_s == approx(0.56)
    assert p.mttf_s == approx(1.8e8)                            # 50,000 h
    # tau = sqrt(2 * 0.56 * 1.8e8) = sqrt(2.016e8) = 14198.6 s
    assert p.interval_s == approx(14198.59, rel=1e-6)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides, field, text", [
    (dict(params=0), "params", "params must be >= 1, got 0"),
    (dict(storage_write_gbps_per_node=0), "storage_write_gbps_per_node",
     "storage_write_gbps_per_node must be > 0, got 0"),
    (dict(storage_write_gbps=0, storage_write_gbps_per_node=None), "storage_write_gbps",
     "storage_write_gbps must be > 0, got 0"),
    (dict(storage_read_gbps_per_node=-5.0), "storage_read_gbps_per_node",
     "storage_read_gbps_per_node must be > 0, got -5"),
    (dict(storage_write_gbps_per_node=None), "storage_write_gbps", "is required"),
    (dict(mtbf_hours=0), "mtbf_hours", "mtbf_hours must be > 0, got 0"),
    (dict(mtbf_hours=-1.0), "mtbf_hours", "mtbf_hours must be > 0, got -1"),
    (dict(mtbf_hours=float("nan")), "mtbf_hours", "mtbf_hours must be > 0"),
    (dict(dp=0), "dp", "dp must be >= 1, got 0"),
    (dict(tp=0), "tp", "tp must be >= 1"),
    (dict(pp=-2), "pp", "pp must be >= 1"),
    (dict(tp=True), "tp", "tp must be an integer"),
    (dict(gpus_per_node=0), "gpus_per_node", "gpus_per_node must be >= 1"),
    (dict(precision="int8"), "precision", "precision must be one of 'bf16', 'fp16', 'fp32'"),
    (dict(optimizer="lion"), "optimizer", "optimizer must be one of 'adam', 'adamw', 'sgd', 'none'"),
    (dict(mode="eager"), "mode", "'lazy', 'sync'"),
    (dict(writers="all"), "writers", "'replica', 'balanced'"),
    (dict(pcie_gen=6), "pcie_gen", "pcie_gen must be one of 3, 4, 5"),
    (dict(d2h_gbps=0), "d2h_gbps", "d2h_gbps must be > 0"),
    (dict(step_time_s=-1.0), "step_time_s", "step_time_s must be >= 0"),
    (dict(target_overhead_fraction=1.5), "target_overhead_fraction", "in (0, 1)"),
    (dict(target_checkpoint_time_s=0), "target_checkpoint_time_s", "> 0"),
    (dict(target_checkpoint_time_s=60, target_checkpoints_per_failure=3),
     "target_checkpoints_per_failure", "at most one target"),
    (dict(params=None), "params", "exactly one of params or shape"),
    (dict(shape=ModelShape(num_layers=1, hidden_size=8, vocab_size=8)), "params",
     "exactly one of params or shape"),
    (dict(params=1.5e9), "params", "params must be an integer"),
    (dict(tp=4.0), "tp", "tp must be an integer >= 1, got 4.0"),  # not "got 4": it is not one
])
def test_invalid_inputs_name_the_field(overrides, field, text):
    with pytest.raises(PlanInputError) as e:
        gpt3(**overrides)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    assert text in str(e.value)


def test_invalid_shape():
    with pytest.raises(PlanInputError, match="shape.hidden_size must be >= 1, got 0"):
        ModelShape(num_layers=2, hidden_size=0, vocab_size=10)
    with pytest.raises(PlanInputError, match="shape.num_attention_heads must divide"):
        ModelShape(num_layers=2, hidden_size=10, vocab_size=10, num_attention_heads=3)


def test_dataclasses_are_frozen_and_kw_only():
    inputs = gpt3()
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.tp = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_plan(inputs).total_bytes = 0
    with pytest.raises(TypeError):
        PlanInputs(175_000_000_000)  # positional arguments are rejected


# ---------------------------------------------------------------- CLI

def test_cli_json_matches_api(capsys):
    assert cli.main(GPT3_ARGV + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = make_plan(gpt3(target_checkpoint_time_s=60.0)).to_dict()
    assert out == json.loads(json.dumps(expected))
    assert out["total_bytes"] == 2_450_000_000_000
    assert out["write_time_s"] == approx(30.625)
    assert out["mttf_s"] == approx(GPT3_MTTF_S)
    assert out["required_write_gbps_per_node"] == approx(306.25 / 60)


def test_cli_table(capsys):
    assert cli.main(GPT3_ARGV) == 0
    out = capsys.readouterr().out
    for section in ("Size", "Writers", "Bandwidth", "Failures & interval", "Stall"):
        assert f"\n{section}\n" in f"\n{out}"
    assert "2.45 TB" in out            # checkpoint total
    assert "38.3 GB" in out            # per writing GPU
    assert "30.6 s" in out             # write time
    assert "48.8 h" in out             # cluster MTTF
    assert "8.40 min (504 s)" in out   # Young/Daly, lazy
    assert "54.7 min (3281 s)" in out  # Young/Daly, sync
    assert "0.287 %" in out            # lost fraction


@pytest.mark.parametrize("flag, value, field", [
    ("--write-gbps-per-node", "0", "storage_write_gbps_per_node"),
    ("--mtbf-hours", "0", "mtbf_hours"),
    ("--params", "0", "params"),
    ("--dp", "0", "dp"),
    ("--precision", "int8", "precision"),
])
def test_cli_bad_input_returns_2(capsys, flag, value, field):
    argv = list(GPT3_ARGV)
    argv[argv.index(flag) + 1] = value
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ")
    assert field in captured.err and flag in captured.err


def test_cli_usage_errors_return_2(capsys):
    assert cli.main(["plan", "--params", "1e9", "--write-gbps", "1"]) == 2  # no --mtbf-hours
    assert "--mtbf-hours" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "lots", "--write-gbps", "1", "--mtbf-hours", "1"]) == 2
    assert "--params" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_cli_params_suffixes():
    assert plan_cmd._params_arg("175e9") == 175_000_000_000
    assert plan_cmd._params_arg("175B") == 175_000_000_000
    assert plan_cmd._params_arg("1.5T") == 1_500_000_000_000
    assert plan_cmd._params_arg("350M") == 350_000_000


def test_cli_overhead_percent_equals_fraction(capsys):
    base = GPT3_ARGV[:-2] + ["--json"]
    cli.main(base + ["--target-overhead", "0.01"])
    a = json.loads(capsys.readouterr().out)
    cli.main(base + ["--target-overhead-pct", "1"])
    b = json.loads(capsys.readouterr().out)
    assert a["max_stall_for_target_s"] == approx(8.7890625)
    assert a == b


def test_cli_model_and_ds_config(tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96,
                                 "vocab_size": 50257, "padded_vocab_size": 51200, "seq_length": 2048}))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"fp16": {"enabled": True}, "optimizer": {"type": "AdamW"}}))
    argv = ["plan", "--model-config", str(model), "--ds-config", str(ds), "--write-gbps", "100",
            "--mtbf-hours", "50000", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 174_590_681_088                   # see test_estimate_params_gpt3_shape
    assert out["inputs"]["precision"] == "fp16"
    assert out["inputs"]["optimizer"] == "adamw"
    assert out["total_bytes"] == 174_590_681_088 * 14
    # explicit flags override the config files
    assert cli.main(argv + ["--precision", "fp32", "--num-layers", "48"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["precision"] == "fp32" and out["inputs"]["shape"]["num_layers"] == 48
    assert out["bytes_per_param"] == 12                        # fp32 4 + adamw 8

    ds.write_text(json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}}))
    assert cli.main(argv) == 2
    assert "both bf16 and fp16" in capsys.readouterr().err
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))    # no optimizer -> default adam
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["inputs"]["precision"], out["inputs"]["optimizer"]) == ("bf16", "adam")
    assert cli.main(argv + ["--params", "1e9"]) == 2           # both params and a shape
    assert "not both" in capsys.readouterr().err


def test_cli_format_helpers():
    assert plan_report.fmt_bytes(2.45e12) == "2.45 TB"
    assert plan_report.fmt_bytes(306.25e9) == "306 GB"
    assert plan_report.fmt_duration(30.625) == "30.6 s"
    assert plan_report.fmt_duration(3281.2) == "54.7 min (3281 s)"
    assert plan_report.fmt_duration(175781.25) == "48.8 h (175781 s)"
    assert plan_report.fmt_gbps(0.638) == "0.638 GB/s"
    assert plan_report.fmt_pct(0.0028667) == "0.287 %"


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "deepspeed_async_ckpt.tools.cli"] + GPT3_ARGV + ["--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_bytes"] == 2_450_000_000_000
    r = subprocess.run([sys.executable, "-m", "deepspeed_async_ckpt.tools.cli", "plan", "--params", "1e9",
                        "--write-gbps", "0", "--mtbf-hours", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "storage_write_gbps must be > 0, got 0" in r.stderr


# --------------------------------------------- the plan CLI at the edges of its inputs
PLAN_175B = ["plan", "--params", "175e9", "--write-gbps", "10", "--mtbf-hours", "50000"]


@pytest.mark.parametrize("step_time", [7.0, 4.9, 9.8, 3.27])
def test_the_interval_in_steps_is_never_shorter_than_the_write(step_time):
    """Formula 8: the interval is never shorter than the write time, in whole steps too
    (``round(interval / step)`` alone would give 1 step of 7 s for a 9.8 s write)."""
    p = make_plan(PlanInputs(params=7_000_000_000, storage_write_gbps=10.0, mtbf_hours=50000.0,
                             step_time_s=step_time))
    assert p.interval_basis == "write_time_floor"
    assert p.save_interval_steps * step_time >= p.write_time_s
    assert (p.save_interval_steps - 1) * step_time < p.write_time_s  # and no more than that


@pytest.mark.parametrize("argv,flag", [(["--tp", "1" + "0" * 320], "--tp"),
                                       (["--dp", "-" + "9" * 400], "--dp")])
def test_an_integer_too_large_for_a_float_is_refused_naming_the_flag(capsys, argv, flag):
    """The bound's message shows the value by its magnitude: formatted as a float, it would
    raise OverflowError."""
    assert cli.main(["plan", "--params", "7e9", "--write-gbps", "10", "--mtbf-hours", "50000", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err and len(err) < 200, err
    exponent = len(argv[1].lstrip("-")) - 1
    assert f"got {'-' if argv[1][0] == '-' else ''}~1e{exponent} " in err, err


@pytest.mark.parametrize("value,shown", [(lambda: 10**20, "~1e20"), (lambda: 10**20 - 1, "~1e19"),
                                         (lambda: -(10**5000), "-~1e5000"), (lambda: 10**320, "~1e320")],
                         ids=["1e20", "1e20-1", "-1e5000", "1e320"])
def test_a_huge_integer_is_shown_by_its_magnitude(value, shown):
    """(an integer past 4300 digits cannot even be turned into a string)"""
    from deepspeed_async_ckpt.tools.plan_inputs import _show

    value = value()
    assert _show(value) == shown
    assert _show(-1234567) == "-1234567"  # a small one in full
    with pytest.raises(PlanInputError, match="tp must be"):
        PlanInputs(params=7_000_000_000, storage_write_gbps=10.0, mtbf_hours=5.0, tp=value)


def test_target_overhead_pct_below_its_floor_names_the_flag_in_percent(capsys):
    """The message names the flag given, in its unit (percent), not the fraction it becomes
    and its flag --target-overhead."""
    assert cli.main(PLAN_175B + ["--target-overhead-pct", "0.00005"]) == 2
    err = capsys.readouterr().err
    assert "at least 0.0001 percent, got 5e-05 (--target-overhead-pct)" in err, err


def test_target_overhead_pct_error_names_the_flag_given(capsys):
    """--target-overhead-pct 150 is refused naming --target-overhead-pct, not the
    --target-overhead the user did not pass, with a value they did not type."""
    assert cli.main(PLAN_175B + ["--target-overhead-pct", "150"]) == 2
    err = capsys.readouterr().err
    assert "--target-overhead-pct" in err, err


@pytest.mark.parametrize("flag", ["--model-config", "--ds-config"])
def test_a_config_file_that_is_not_utf8_is_a_cli_error(tmp_path, capsys, flag):
    """A binary file given by mistake (a .pt, a gzip) is an ``error:`` naming the flag, not a
    UnicodeDecodeError out of main()."""
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{\x00\x80")
    argv = ["plan", flag, str(bad), "--write-gbps", "10", "--mtbf-hours", "50000"]
    if flag == "--ds-config":
        argv += ["--params", "1e9"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err, err


def test_a_null_padded_vocab_size_falls_back_to_vocab_size(tmp_path, capsys):
    """README: "padded_vocab_size wins if present". A config with "padded_vocab_size": null
    (an args dump taken before Megatron pads the vocabulary) uses vocab_size."""
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "vocab_size": 100,
                                 "padded_vocab_size": None}))
    assert cli.main(["plan", "--model-config", str(model), "--write-gbps", "10",
                     "--mtbf-hours", "5", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["inputs"]["shape"]["vocab_size"] == 100


@pytest.mark.parametrize("extra,flag", [
    (["--dp", "1000000000000"], "--dp"),
    (["--read-gbps", "1e-320"], "--read-gbps"),
    (["--write-gbps", "1e-300"], "--write-gbps"),
    (["--mtbf-hours", "1e-300"], "--mtbf-hours"),
    (["--step-time", "1e300"], "--step-time"),
    (["--restart-s", "1e300"], "--restart-s"),
    (["--params", "1e308"], "--params"),
    (["--target-time", "1e-300"], "--target-time"),
    (["--target-k", "1e-300"], "--target-k"),
    (["--step-time", "1e-310"], "--step-time"),  # below the floors that keep the arithmetic finite
    (["--target-overhead", "1e-160"], "--target-overhead"),
    (["--target-overhead", "1e-200"], "--target-overhead"),
    (["--target-overhead-pct", "1e-200"], "--target-overhead"),
])
def test_magnitudes_no_cluster_has_are_refused_naming_the_flag(capsys, extra, flag):
    """Absurd magnitudes are refused naming the flag: in the plan's arithmetic they would
    overflow, divide by zero, or give a plan of nonsense ('interval 0 s')."""
    assert cli.main(PLAN_175B + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag in err, err


def test_a_shape_with_more_parameters_than_any_model_is_refused(capsys):
    argv = ["plan", "--num-layers", "100000", "--hidden-size", "100000000", "--vocab-size", "1000",
            "--write-gbps", "10", "--mtbf-hours", "50000"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--hidden-size" in err, err


def test_every_corner_of_the_bounds_gives_a_finite_plan():
    """Inputs at the bounds' extremes, in every combination: no overflow, no division by
    zero, nothing infinite or NaN in the plan or its table. The targets take turns over the
    combinations (7, coprime with every corner's period, so each target meets each value of
    each input), and all of them at the all-low and all-high corners."""
    import itertools
    import math

    from deepspeed_async_ckpt.tools.plan_inputs import MAX_COUNT, MAX_GBPS, MAX_PARAMS, MAX_SECONDS, MIN_GBPS

    corners = dict(params=[1, MAX_PARAMS], tp=[1, MAX_COUNT], pp=[1, MAX_COUNT], dp=[1, MAX_COUNT],
                   gpus_per_node=[1, MAX_COUNT], storage_write_gbps=[MIN_GBPS, MAX_GBPS],
                   storage_read_gbps=[None, MIN_GBPS, MAX_GBPS],
                   mtbf_hours=[1e-6, MAX_SECONDS / 3600], restart_s=[0, MAX_SECONDS],
                   step_time_s=[None, 0, 1e-6, MAX_SECONDS], d2h_gbps=[None, MIN_GBPS, MAX_GBPS])
    targets = [{}, {"target_checkpoint_time_s": MAX_SECONDS}, {"target_checkpoint_time_s": 1e-6},
               {"target_overhead_fraction": 1e-6}, {"target_overhead_fraction": 1 - 1e-9},
               {"target_checkpoints_per_failure": MAX_SECONDS},
               {"target_checkpoints_per_failure": 1e-6}]
    combos = list(itertools.product(*corners.values()))
    runs = [(combo, targets[i % len(targets)]) for i, combo in enumerate(combos)]
    runs += [(combo, target) for combo in (combos[0], combos[-1]) for target in targets]
    for combo, target in runs:
        kw = {k: v for k, v in zip(corners, combo) if v is not None}
        plan = make_plan(PlanInputs(**kw, **target))
        plan_report.format_plan(plan)
        values = json.loads(json.dumps(plan.to_dict(), allow_nan=False))  # raises on inf/NaN
        assert all(math.isfinite(v) for v in values.values() if isinstance(v, float)), (kw, target)
