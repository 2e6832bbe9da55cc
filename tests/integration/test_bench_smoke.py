"""Smoke test of ``scripts/bench_checkpoint.py``: the smallest run (``--quick``, 1 rank: the
2-rank setting runs the same worker with two processes) produces a JSON with every engine's
figures measured (positive, complete checkpoints on disk) and a PNG; and
``--gpu-report`` says so and exits 0 when there is no GPU."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO  # noqa: E402
BENCH = os.path.join(REPO, "scripts", "bench_checkpoint.py")
MEASURED = ("async", "sync", "ds_torch", "dcp_async")


@pytest.mark.slow
def test_quick_benchmark_measures_every_engine(tmp_path, repo_env):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--settings", "1rank", "--repeats", "2",
                           "--out", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| this engine (async) |" in proc.stdout  # the table
    res = json.loads(out.read_text())
    assert (tmp_path / "quick.png").stat().st_size > 10_000
    assert not (tmp_path / "work").exists()  # checkpoints cleaned up

    micro = res["micro"]
    for key in ("memcpy_gbps", "crc32_gbps", "checksum_gbps", "zip_writer_crc_gbps", "pagecache_write_gbps", "fsync_gbps"):
        assert micro[key] > 0, key
    assert set(res["cells"]) == set(res["config"]["settings"]) == {"1rank"}
    for setting, cells in res["cells"].items():
        assert len(cells) == 1
        cell = next(iter(cells.values()))
        assert "error" not in cell, cell.get("error")
        assert cell["storage"]["fsync_gbps"] > 0 and cell["storage"]["nofsync_gbps"] > 0
        steps = cell["steps"]
        assert steps["step_s"] > 0 and steps["fwd_bwd_s"] > 0 and steps["baseline_window_s"] > 0
        assert 0 < steps["ds_floor_s"] < cell["engines"]["ds_torch"]["stall_s"]  # DeepSpeed's own part
        bare = steps["bare_write"]  # the same bytes written alone during training
        assert bare["bytes"] >= 0.95 * cell["engines"]["async"]["expected_bytes"] and bare["gbps"] > 0
        assert set(cell["engines"]) == {"async", "sync", "ds_torch", "ds_decoupled", "dcp_async"}
        for name in MEASURED:
            e = cell["engines"][name]
            assert e["ok"], f"{setting}/{name}: {e.get('error')}"
            for key in ("stall_s", "first_stall_s", "persist_s", "persist_gbps", "window_s"):
                assert e[key] > 0, f"{setting}/{name}.{key} = {e[key]}"
            # the bytes on disk are the whole state, measured after the save completed
            assert e["bytes"] >= 0.95 * e["expected_bytes"] > 0, (setting, name)
            assert "incomplete" not in e
            assert isinstance(e["overhead"], float)
            # every figure is the median over the repeats, each with its own paired baseline
            assert e["repeats"] == len(e["runs"]) == 2
            for key in ("stall_s", "persist_s", "overhead"):
                assert e[key] == pytest.approx(sum(r[key] for r in e["runs"]) / 2), key
            assert e["runs"][0]["paired_baseline_s"] != e["runs"][1]["paired_baseline_s"]
        a = cell["engines"]["async"]
        assert a["durable"] is True and a["snapshot_s"] > 0 and a["persist_s"] >= a["snapshot_s"]
        assert cell["engines"]["sync"]["persist_s"] <= cell["engines"]["sync"]["stall_s"] + 1e-3
        dec = cell["engines"]["ds_decoupled"]
        assert dec["attempts"], "the decoupled engine was not tried"
        assert dec["ok"] or dec["error"]  # measured, or the reason it cannot run is recorded
        assert set(cell["targets"]) == {"stall_ratio_vs_torch", "persist_fraction_of_storage", "overhead_every_k"}
        b = cell["breakdown"]
        assert all(b[k] > 0 for k in ("copy_s", "checksum_s", "disk_s", "pagecache_write_s", "zip_crc_s"))
        assert cell["storage"]["fsync_gbps"] >= cell["storage"]["fsync_plain_gbps"]  # the best way


def test_gpu_report_without_gpu_exits_zero(tmp_path, repo_env):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, BENCH, "--gpu-report", "--out", str(out)],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    gpu = json.loads(out.read_text())["gpu"]
    if gpu["available"]:
        assert gpu["pinned_d2h_gbps"] > 0 and gpu["nvml"]["samples"] > 0
    else:
        assert "no NVIDIA GPU/driver found: --gpu-report skipped" in proc.stdout
        assert gpu["reason"]


@pytest.mark.slow
def test_load_benchmark_times_every_engine(tmp_path, repo_env):
    """``scripts/bench_load.py`` at its smallest: a table row and JSON times for each engine
    (cold loads only where the page cache can be dropped), its checkpoints removed."""
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_load.py"), "--hidden", "64",
                           "--layers", "2", "--repeats", "1", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["times_s"]) == {"this engine, verify_on_load", "this engine, no verification",
                                   "DS TorchCheckpointEngine"}
    for name, t in res["times_s"].items():
        assert f"| {name} |" in proc.stdout
        assert len(t["warm"]) == 1 and t["warm"][0] > 0
        assert len(t["cold"]) == (1 if res["cold_measured"] else 0)
    assert all(b > 0 for b in res["bytes"].values())
    assert not (tmp_path / "work").exists()


def test_memory_bus_benchmark_reports_each_variant(tmp_path, repo_env):
    """``scripts/bench_membus.py`` at its smallest: a table row and JSON figures per variant, the
    lost time of each round counted as ``lost_time`` counts a save's (no save call)."""
    out = tmp_path / "membus.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_membus.py"), "--gb", "0.02",
                           "--hidden", "256", "--k", "3", "--rounds", "2", "--out", str(out)],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["variants"]) == {"copy", "copy+xxh128"}
    for kind, v in res["variants"].items():
        assert f"| {kind} |" in proc.stdout
        assert len(v["per_round_s"]) == 2 and v["worst_s"] == max(v["per_round_s"])
        assert v["copy_s"] > 0 and (v["hash_s"] > 0) == (kind == "copy+xxh128")
    assert res["gb"] > 0 and res["baseline_step_s"] > 0


@pytest.mark.slow
def test_quick_trainer_benchmark_measures_both_engines(tmp_path, repo_env):
    """``scripts/bench_hf_trainer.py --quick``: a Trainer run per engine, each save timed."""
    out = tmp_path / "hf.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_hf_trainer.py"), "--quick",
                           "--out", str(out), "--work-dir", str(tmp_path)],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| this engine (async) |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["raw"]["torch"]["engine_class"] == "TorchCheckpointEngine"
    assert res["raw"]["async"]["engine_class"] == "AsyncCheckpointEngine"
    for name, raw in res["raw"].items():
        assert len(raw["save"]) == len(raw["save_model"]) == len(raw["deepspeed"]) == 3, name
        # Trainer's save holds its two parts; the checkpoint left holds the whole state
        assert all(s > m + d > 0 for s, m, d in zip(raw["save"], raw["save_model"], raw["deepspeed"])), name
        assert raw["bytes"] > 4 * raw["params"], name  # fp32 weights alone are 4 bytes a parameter
    assert len(res["raw"]["async"]["commit_s"]) == 3 and all(t > 0 for t in res["raw"]["async"]["commit_s"])
    assert os.listdir(tmp_path) == ["hf.json"]  # the runs' directories are removed


@pytest.mark.slow
def test_gpu_check_runs_every_step_and_says_what_it_measured(tmp_path, repo_env):
    """``scripts/gpu_check.py run``, what a lent GPU machine runs in one call: here,
    without a GPU and with no wheels to install (this environment has DeepSpeed), it installs
    this checkout, selects the CUDA tests (they skip, each with its reason), has
    ``--gpu-report`` say there is no GPU, and runs the demo on the CPU with the engine active
    (``keep_last`` leaves three checkpoints), and says the host tests are left to the CPU suite,
    within the eight files the device tool returns."""
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "run", "--quick",
                           "--out", str(out), "--wheels", str(wheels)],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["step"], s["exit"]) for s in summary["steps"]] == \
        [("env", 0), ("pytest", 0), ("gpu_report", 0), ("demo", 0), ("host_tests", 0)]
    assert len(os.listdir(out)) <= 8
    pytest_log = (out / "pytest.log").read_text()
    import torch

    if torch.cuda.is_available():
        assert " passed" in summary["pytest"] and summary["gpu_report"]["available"], summary
        assert " passed" in summary["host_tests"] and "failed" not in summary["host_tests"], summary
        return
    cuda_tests = [line for line in pytest_log.splitlines() if "::test_cuda_" in line]
    assert len(cuda_tests) >= 6 and all(line.endswith("]") and "SKIPPED" in line for line in cuda_tests)
    assert "needs CUDA" in pytest_log and " passed" not in summary["pytest"]
    assert summary["host_tests"] == "not run without a GPU: the CPU suite runs these tests"
    assert summary["gpu_report"]["available"] is False and "no NVIDIA GPU" in summary["gpu_report"]["reason"]
    demo = (out / "demo.log").read_text()
    assert "resumed at step " in demo and summary["demo"].startswith("Training time lost per checkpoint:")
    assert "global_step4, global_step6, global_step8" in demo  # keep_last: the engine's retention


@pytest.mark.parametrize("log, expected", [
    # a host tests' log as an H100 run wrote it (-q: no rules), whose summary was null
    ("$ python3 -m pytest -q ...\n....... [100%]\n246 passed, 10 deselected in 88.15s (0:01:28)\n",
     "246 passed, 10 deselected in 88.15s (0:01:28)"),
    ("x PASSED [100%]\n\n====================== 10 passed, 246 deselected in 8.87s ======================\n",
     "====================== 10 passed, 246 deselected in 8.87s ======================"),
    ("=== FAILURES ===\n=== short test summary info ===\nFAILED t.py::a\n1 failed, 3 passed in 2.01s\n",
     "1 failed, 3 passed in 2.01s"),
    ("=== 7 skipped, 249 deselected in 1.50s ===\n", "=== 7 skipped, 249 deselected in 1.50s ==="),
    ("Timeout\n", None),
])
def test_gpu_check_finds_pytests_closing_line_with_or_without_rules(tmp_path, log, expected):
    from deepspeed_async_ckpt.bench import logs

    path = tmp_path / "x.log"
    path.write_text(log)
    assert logs.pytest_summary(str(path)) == expected


def test_standin_benchmark_reports_every_engine_ab(tmp_path, repo_env):
    """``scripts/bench_standin.py`` at its smallest: per engine, real and sham events in ABBA
    order, every step kept, each event's loss as ``lost_time.event_loss`` counts it, the A/B
    and A/A figures, the threads beside training; the table names every engine."""
    from deepspeed_async_ckpt.bench import lost_time

    out = tmp_path / "standin.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_standin.py"), "--gb", "0.002",
                           "--step-ms", "2", "--interval", "8", "--base", "4", "--events", "4",
                           "--out", str(out), "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not (tmp_path / "work").exists()  # checkpoints removed
    assert res["config"]["ops_per_step"] >= 1
    assert set(res["engines"]) == {"torch", "threads", "process"}
    for name, r in res["engines"].items():
        assert f"| {r['label']} |" in proc.stdout
        assert r["labels"] == ["R", "S", "S", "R"] and [e["kind"] for e in r["events"]] == r["labels"]
        # the warm-up save's steps, the first baseline and every event's steps, all kept
        assert len(r["steps_s"]) == 8 + 4 + 4 * 8 and all(s > 0 for s in r["steps_s"])
        for ev in r["events"]:
            s = ev["step"]
            loss, base = lost_time.event_loss(r["steps_s"][s - 4:s], r["steps_s"][s:s + 8], ev["call_s"], ev["tail_s"])
            assert ev["loss_s"] == loss and ev["baseline_s"] == base
            assert "MainThread" in ev["threads"] and ev["memory_after"]["rss_bytes"] > 0
        summ = r["summary"]
        assert summ["events"] == 4 and summ["real_minus_sham"]["n_a"] == summ["real_minus_sham"]["n_b"] == 2
        assert summ["real_minus_sham"]["lo_s"] <= summ["real_minus_sham"]["diff_s"] <= summ["real_minus_sham"]["hi_s"]
        assert set(r["by_kind"]) == {"R", "S"}
    threads = res["engines"]["threads"]["by_kind"]["R"]["threads"]
    assert "async-ckpt-copier" in threads and "async-ckpt-committer" in threads
    assert any(t.startswith("worker:") for t in res["engines"]["process"]["by_kind"]["R"]["threads"])


def test_gpu_lost_time_measurement_runs_its_smallest_form_and_reports_the_decoupled_engine(tmp_path, repo_env):
    """``scripts/gpu_check.py lost --tiny``, what a lent GPU machine runs for the lost-time
    figure, here on the CPU with a 2-layer GPT-2: it installs this checkout, measures each of
    this package's engines and ``TorchCheckpointEngine`` A/B, and reports DeepSpeed's
    decoupled engine by its error where it cannot save (ZeRO-1's optimizer state cannot cross
    into its writer process) and megatron-core's async save as not measured."""
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "lost", "--tiny",
                           "--out", str(out), "--wheels", str(wheels), "--budget-s", "120"],
                          cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + (out / "lost.log").read_text()[-4000:]
    res = json.loads((out / "lost.json").read_text())
    assert {"torch", "threads", "process"} <= set(res["engines"])
    for r in res["engines"].values():
        assert r["labels"] == ["R", "S", "S", "R"] and len(r["steps_s"]) == 6 + 3 + 4 * 6
        assert r["summary"]["real_minus_sham"]["n_a"] == 2
    if "decoupled" in res["not_run"]:
        assert "Cowardly refusing to serialize non-leaf tensor" in res["not_run"]["decoupled"]["error"]
    assert "not measured" in res["config"]["megatron_async_save"]
    assert json.loads((out / "summary.json").read_text())["steps"][0]["exit"] == 0
