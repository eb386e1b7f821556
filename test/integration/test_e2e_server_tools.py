"""The real-server tooling on CPU: starting, health wait, JSON over HTTP and stopping (a
stand-in HTTP server in place of SGLang's), and scripts/bench_e2e_ttft.py: its pure parts and its
measurement loop against stand-in servers whose forward times are known."""

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_shared_kv_testing import server
from sglang_cp_shared_kv_testing.support import free_port, load_script

ROOT = Path(__file__).resolve().parents[2]

FAKE_SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
time.sleep(float(sys.argv[2]))  # a slow boot
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body, ctype="application/json"):
        self.send_response(200); self.send_header("Content-Type", ctype); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/metrics":  # two scheduler processes' samples, Prometheus text format
            self._send(b'# HELP sglang:cp_shared_kv_prefill_forwards_total ...\n'
                       b'sglang:cp_shared_kv_prefill_forwards_total{cp_rank="0",index="local",mla="local"} 3.0\n'
                       b'sglang:cp_shared_kv_prefill_forwards_total{cp_rank="1",index="local",mla="local"} 3.0\n'
                       b'sglang:cp_shared_kv_prefill_forwards_total{cp_rank="0",index="gathered",mla="gathered"} 1.0\n'
                       b'sglang:other_total{cp_rank="0"} 7.0\n', "text/plain")
            return
        self._send(b"" if self.path == "/health" else b"plain text answer", "text/plain")
    def do_POST(self):
        n = int(self.headers["Content-Length"]); body = json.loads(self.rfile.read(n))
        self._send(json.dumps({"echo": body, "path": self.path}).encode())
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _start(tmp_path, *extra, boot_timeout=60):
    port = free_port()
    cmd = [sys.executable, "-c", FAKE_SERVER, str(port), *extra]
    return server.start_server("fake", cmd, server.e2e_env({"X": "1"}), port, tmp_path / "fake.log", boot_timeout), port


def test_start_post_stop(tmp_path):
    proc, port = _start(tmp_path, "1.5")  # healthy only after its slow boot
    try:
        assert server.post(port, "/generate", {"input_ids": [1, 2]}) == {"echo": {"input_ids": [1, 2]},
                                                                          "path": "/generate"}
        assert server.post(port, "/flush_cache") == "plain text answer"
    finally:
        server.stop(proc)
    assert proc.poll() is not None


@pytest.mark.parametrize("child_ignores_sigterm", [False, True])
def test_stop_waits_until_every_process_of_the_server_is_gone(child_ignores_sigterm):
    # SGLang's launcher starts its scheduler processes in its group; one still alive holds GPU
    # memory the next server needs, so stop() must not return while any of them lives
    import time

    trap = 'trap "" TERM; ' if child_ignores_sigterm else ""
    proc = subprocess.Popen(["sh", "-c", f"{trap}sleep 300 & sleep 300 & wait"], start_new_session=True)
    time.sleep(0.5)
    t0 = time.monotonic()
    server.stop(proc, grace_s=2)
    assert server.live_group_members(proc.pid) == []  # nothing of the group runs (zombies aside)
    assert proc.poll() is not None
    assert (time.monotonic() - t0 >= 2) == child_ignores_sigterm  # SIGKILL only after the grace


def test_stopping_a_server_that_already_ended_says_nothing(capsys):
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()  # exited and reaped: its group is gone
    server.stop(proc, grace_s=1)
    assert "WARNING" not in capsys.readouterr().out


def test_prometheus_samples_of_one_metric(tmp_path):
    proc, port = _start(tmp_path, "0")
    try:
        samples = server.prometheus_samples(port, server.WRITE_PATHS_METRIC)
    finally:
        server.stop(proc)
    assert samples == {'{cp_rank="0",index="local",mla="local"}': 3.0, '{cp_rank="1",index="local",mla="local"}': 3.0,
                       '{cp_rank="0",index="gathered",mla="gathered"}': 1.0}


def test_a_server_that_exits_or_never_gets_healthy_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="server exited with 1; see .*fake.log"):
        server.start_server("fake", [sys.executable, "-c", "raise SystemExit(1)"], server.e2e_env(),
                            free_port(), tmp_path / "fake.log", 30)
    hang = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(RuntimeError, match="not healthy within 2s"):
        server.start_server("fake", hang, server.e2e_env(), free_port(), tmp_path / "fake.log", 2)


def test_e2e_env_puts_the_sitecustomize_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = server.e2e_env({"A": "b"})
    assert env["CPSKV_E2E"] == "1" and env["A"] == "b"
    assert env["PYTHONPATH"].split(":") == [str(ROOT / "scripts" / "e2e"), "/elsewhere"]
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "sitecustomize.py").exists()


def _bench():
    return load_script("bench_e2e_ttft")


def test_ttft_schedule_interleaves_and_rotates():
    bench = _bench()
    order = bench.schedule([16, 32], 3, ["off", "on", "on_prefetch"])
    assert len(order) == 3 * 2 * 3
    firsts = [v for (rnd, length, v) in order if length == 16][::3]
    assert firsts == ["off", "on", "on_prefetch"]  # each variant leads one round
    for rnd in range(3):  # every variant once per length per round
        for length in (16, 32):
            assert sorted(v for r, n, v in order if (r, n) == (rnd, length)) == ["off", "on", "on_prefetch"]


def test_ttft_summary_and_stage_delta():
    bench = _bench()
    summary = bench.summarize({"off": {16: [1.0, 1.2, 1.1]}, "on": {16: [1.1, 1.155, 1.3]}})
    assert summary["off"]["16"] == {"runs": 3, "median_s": 1.1, "min_s": 1.0, "max_s": 1.2, "spread_pct": 18.18}
    assert summary["on"]["16"]["overhead_pct"] == 5.0 and "overhead_pct" not in summary["off"]["16"]
    before = {"forwards": 4, "stages": {"owner_write": {"calls": 64, "total_ms": 10.0}}}
    after = {"forwards": 6, "stages": {"owner_write": {"calls": 96, "total_ms": 14.0},
                                       "prefetch:wait": {"calls": 14, "total_ms": 0.7}}}
    delta = bench.stage_delta(before, after, layers=8)
    assert delta["forwards"] == 2
    assert delta["stages"]["owner_write"] == {"calls": 32, "ms": 4.0, "ms_per_forward": 2.0, "ms_per_layer": 0.25}
    assert delta["stages"]["prefetch:wait"]["ms_per_layer"] == 0.0437


def test_ttft_forward_seconds_are_the_slowest_ranks_extend_time():
    bench = _bench()
    r0, r1, dec = '{category="extend",tp_rank="0"}', '{category="extend",tp_rank="1"}', '{category="decode",tp_rank="0"}'
    before = {r0: 10.0, r1: 9.0, dec: 1.0}
    # rank 0 stays ahead in total, but rank 1 took longer in between: its 1.75 s, not rank 0's 1.5 s
    after = {r0: 11.5, r1: 10.75, dec: 9.0}
    assert bench.extend_seconds_between(before, after) == 1.75
    assert bench.extend_seconds_between({}, {r0: 0.5}) == 0.5  # a rank's first report
    assert bench.extend_seconds_between({}, {}) == 0.0  # no forward reported yet


def test_ttft_model_has_deepseek_v32_dims_and_only_dense_layers():
    config = _bench().model_config(8)
    assert config["num_hidden_layers"] == config["first_k_dense_replace"] == 8
    assert (config["hidden_size"], config["num_attention_heads"], config["kv_lora_rank"], config["index_topk"]) \
        == (7168, 128, 512, 2048)
    assert config["max_position_embeddings"] >= 114688 + 1


def test_ttft_bench_refuses_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e_ttft.py"), "--cp-size", "0",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cp-size must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e_ttft.py"), "--only-stage-times",
                           "--cp-size", "1", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--only-stage-times needs --cp-size 2" in proc.stderr


class _LaggedForwardServer:
    """A stand-in for one SGLang server's HTTP side as bench_e2e_ttft reads it: /generate runs
    the prompt as 8,192-token forwards of ``seconds_per_token`` device time each, and, like
    SGLang's DeviceTimer, each forward reports the ones before it when it ends (its own
    interval has not completed yet); /metrics serves the counters two TP ranks wrote."""

    def __init__(self, seconds_per_token: float, flag_on: bool, timing_dir: Path = None):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.reported, self.pending, self.forwards = 0.0, [], 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                lines = [f'sglang:forward_execution_seconds_total{{category="extend",tp_rank="{r}"}} '
                         f'{fake.reported * (1.0 if r == 0 else 0.5)}' for r in (0, 1)]
                if flag_on:
                    lines.append(f'{server.WRITE_PATHS_METRIC}{{cp_rank="0",index="local",mla="local"}} '
                                 f'{fake.forwards}')
                self._send("\n".join(lines).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                tokens = len(body["input_ids"])
                for start in range(0, tokens, 8192):
                    fake.reported += sum(fake.pending)
                    fake.pending = [min(8192, tokens - start) * seconds_per_token]
                    fake.forwards += 1
                if timing_dir is not None:  # the stage timer's files, as CP ranks 0 and 1 rewrite them
                    timing_dir.mkdir(parents=True, exist_ok=True)
                    for rank, scale in ((0, 1.0), (1, 2.0)):  # rank 1's work takes twice as long
                        (timing_dir / f"stage-times-cp{rank}.json").write_text(json.dumps({
                            "forwards": fake.forwards, "stages": {
                                "owner_write": {"calls": 8 * fake.forwards, "total_ms": 0.5 * scale * fake.forwards},
                                # a container and the leaf timed inside it (forward.prefetch)
                                "prefetch:issue": {"calls": 7 * fake.forwards, "total_ms": 0.3 * scale * fake.forwards},
                                "materialize:mla:gather": {"calls": 7 * fake.forwards,
                                                           "total_ms": 0.1 * scale * fake.forwards}}}))
                self._send(b"{}")

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def test_ttft_bench_reads_each_prompts_forward_time_from_the_servers(monkeypatch, tmp_path):
    """measure_ttft on stand-in servers whose forward time is known: the server-side figure is
    exactly the prompt's forwards (the lag of SGLang's device timer and the 64-token flush
    accounted for), its overhead % the stand-ins' ratio, the write paths the flag-on servers'."""
    import argparse
    import math

    bench = _bench()
    per_token = {"off": 1e-4, "on": 1.02e-4, "on_prefetch": 1.01e-4}
    fakes = {}

    def launch(name, variant, model, args, index, work, timing_dir=None):
        fakes[variant] = _LaggedForwardServer(per_token[variant], bench.VARIANTS[variant][0])
        return fakes[variant], fakes[variant].port

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "stop", lambda fake: fake.http.shutdown())
    args = argparse.Namespace(lengths=[100, 20000], runs=3, cp_size=2)
    out = bench.measure_ttft(args, tmp_path / "model", tmp_path)
    for variant, seconds in per_token.items():
        assert math.isclose(out["flush_forward_s"][variant], 64 * seconds)
        for length in args.lengths:
            forwards = out["forward_raw_s"][variant][str(length)]
            assert len(forwards) == 3 and all(math.isclose(f, length * seconds) for f in forwards), forwards
            assert len(out["raw_s"][variant][str(length)]) == 3
    assert out["forward_summary"]["on"]["20000"]["overhead_pct"] == 2.0
    assert out["forward_per_chunk_ms"]["off"] == {"100": 10.0, "20000": round(2000.0 / 3, 3)}  # 3 chunks of 8K
    assert out["forward_summary"]["on_prefetch"]["100"]["overhead_pct"] == 1.0
    # the goal verdicts: the forward overheads are the stand-ins' (2 %: missed, 1 %: met)
    assert out["forward_summary"]["on"]["20000"]["meets_goal"] is False
    assert out["forward_summary"]["on_prefetch"]["100"]["meets_goal"] is True
    for variant in ("on", "on_prefetch"):
        for length in ("100", "20000"):
            verdict = out["goal"][variant][length]
            assert verdict["forward_overhead_pct"] == out["forward_summary"][variant][length]["overhead_pct"]
            assert verdict["ttft_overhead_pct"] == out["summary"][variant][length]["overhead_pct"]
            assert verdict["meets_goal"] == (verdict["ttft_overhead_pct"] <= 1.0 and verdict["forward_overhead_pct"] <= 1.0)
    assert out["goal"]["on"]["20000"]["meets_goal"] is False and set(out["goal"]) == {"on", "on_prefetch"}
    assert set(out["write_paths"]) == {"on", "on_prefetch"}
    assert all(sample > 0 for paths in out["write_paths"].values() for sample in paths.values())


def test_ttft_bench_keeps_measuring_the_servers_that_work_and_checkpoints_every_round(monkeypatch, tmp_path):
    """A flag-on server that does not start, and one whose requests start failing in round 1,
    leave the comparison with their errors; the stock server is measured in every round, and
    the result so far is handed to the checkpoint after the warm-up and after each round."""
    import argparse

    bench = _bench()
    fakes = {}

    def launch(name, variant, model, args, index, work, timing_dir=None):
        if variant == "on":
            raise RuntimeError("on: server exited with 1; see on.log")
        fakes[variant] = _LaggedForwardServer(1e-4, bench.VARIANTS[variant][0])
        return fakes[variant], fakes[variant].port

    generate, calls = bench.generate, {"n": 0}

    def flaky_generate(port, ids):
        if port == fakes["on_prefetch"].port and len(ids) == 20000:
            calls["n"] += 1
            if calls["n"] > 2:  # its warm-up and round 0 work, round 1 fails
                raise OSError("connection reset")
        return generate(port, ids)

    stopped = []
    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "generate", flaky_generate)
    monkeypatch.setattr(bench, "stop", lambda fake: (stopped.append(fake), fake.http.shutdown()))
    seen = []
    args = argparse.Namespace(lengths=[20000], runs=3, cp_size=2)
    out = bench.measure_ttft(args, tmp_path / "model", tmp_path,
                             checkpoint=lambda r: seen.append(len(r["raw_s"]["off"]["20000"])))
    assert out["errors"]["on"] == "start: RuntimeError: on: server exited with 1; see on.log"
    assert out["errors"]["on_prefetch"] == "round 1, 20000 tokens: OSError: connection reset"
    assert len(out["raw_s"]["off"]["20000"]) == 3 and len(out["raw_s"]["on_prefetch"]["20000"]) == 1
    assert out["raw_s"]["on"]["20000"] == []
    assert seen == [0, 1, 2]  # after the warm-up, round 0 and round 1 (the last round is the return value)
    assert sorted(stopped, key=id) == sorted(fakes.values(), key=id)  # every server stopped once


def test_ttft_bench_at_cp_size_1_runs_the_stock_server_alone():
    bench = _bench()
    assert bench.variants_for(1) == ["off"] and bench.variants_for(2) == ["off", "on", "on_prefetch"]


def test_ttft_stage_times_keep_what_a_failed_variant_measured_and_go_on(monkeypatch, tmp_path):
    """A flag-on timed server that does not come up is reported in the JSON (``error``) and
    the other variant is still measured; main's exit status says so."""
    import argparse

    bench = _bench()
    fakes = []

    def launch(name, variant, model, args, index, work, timing_dir=None):
        if variant == "on":
            raise RuntimeError("on-timed: server exited with 1; see on-timed.log")
        fakes.append(_LaggedForwardServer(1e-4, True, timing_dir))
        return fakes[-1], fakes[-1].port

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "stop", lambda fake: fake.http.shutdown())
    args = argparse.Namespace(lengths=[64, 20000], layers=8)
    out = bench.measure_stage_times(args, tmp_path / "model", tmp_path)
    assert out["on"] == {"error": "RuntimeError: on-timed: server exited with 1; see on-timed.log"}
    # the measured request and the 64-token one after it: 3 + 1 forwards of 8 layers
    assert out["on_prefetch"]["20000"]["cp0"]["forwards"] == 4
    assert out["on_prefetch"]["20000"]["cp0"]["stages"]["owner_write"] == {
        "calls": 32, "ms": 2.0, "ms_per_forward": 0.5, "ms_per_layer": 0.0625}
    assert out["on_prefetch"]["64"]["cp0"]["forwards"] == 2
    # exposed: the leaves (owner writes, the gather inside prefetch:issue), the container left out
    assert out["on_prefetch"]["20000"]["cp0"]["exposed_ms_per_layer"] == 0.075  # (0.5 + 0.1) ms / 8 layers
    assert out["on_prefetch"]["20000"]["cp1"]["exposed_ms_per_layer"] == 0.15
    exposed = bench.exposed_side_by_side(out)
    assert exposed["20000"] == {"on_prefetch": {"cp0": 0.075, "cp1": 0.15, "slowest_rank": "cp1",
                                                "slowest_ms_per_layer": 0.15}}  # "on" failed: no comparison


def test_exposed_time_per_layer_sums_the_leaf_stages_side_by_side():
    """exposed_ms_per_layer = leaf stages' ms / forwards / layers (prefetch:issue contains
    the next layer's view, pack and gather: counting it too would count them twice); per
    length the two flag-on variants side by side, per rank and the slowest."""
    bench = _bench()
    before = {"forwards": 0, "stages": {}}

    def delta(owner_write, issue, gather, wait):
        stages = {"owner_write": owner_write, "prefetch:issue": issue, "materialize:mla:gather": gather,
                  "prefetch:wait": wait}
        return bench.stage_delta(before, {"forwards": 2, "stages": {
            k: {"calls": 1, "total_ms": v} for k, v in stages.items() if v is not None}}, layers=4)

    on = delta(4.0, None, 2.0, None)
    assert on["exposed_ms"] == 6.0 and on["exposed_ms_per_layer"] == 0.75
    prefetched = delta(4.0, 1.5, 0.4, 0.4)  # the gather's launch inside the issue, its exposed rest the wait
    assert prefetched["exposed_ms"] == 4.8 and prefetched["exposed_ms_per_layer"] == 0.6
    slower = delta(5.6, 1.5, 0.4, 0.4)
    assert bench.stage_delta(before, {"forwards": 0, "stages": {}}, layers=4)["exposed_ms_per_layer"] is None
    side = bench.exposed_side_by_side({"on": {"32768": {"cp0": on, "cp1": on}, "error": "ignored"},
                                       "on_prefetch": {"32768": {"cp0": prefetched, "cp1": slower}}})
    assert side == {"32768": {
        "on": {"cp0": 0.75, "cp1": 0.75, "slowest_rank": "cp0", "slowest_ms_per_layer": 0.75},
        "on_prefetch": {"cp0": 0.6, "cp1": 0.8, "slowest_rank": "cp1", "slowest_ms_per_layer": 0.8},
        "prefetch_saves_ms_per_layer": -0.05}}


def test_ttft_goal_verdict_shows_both_overheads_and_needs_both():
    """goal: overhead <= 1 % (issue 12 at CP2) for the HTTP TTFT and the server-side forward
    time, both numbers kept beside the verdicts; a length where only one of them is within
    the goal does not meet it."""
    bench = _bench()
    ttft = bench.summarize({"off": {16: [1.0], 32: [2.0]}, "on": {16: [1.01], 32: [2.01]}})
    forward = bench.summarize({"off": {16: [0.5], 32: [1.0]}, "on": {16: [0.505], 32: [1.02]}})
    assert ttft["on"]["16"]["goal_overhead_pct"] == 1.0 and ttft["on"]["16"]["meets_goal"] is True
    assert forward["on"]["32"]["overhead_pct"] == 2.0 and forward["on"]["32"]["meets_goal"] is False
    assert "meets_goal" not in ttft["off"]["16"]  # the base is not judged against itself
    goal = bench.goal_verdict(ttft, forward)
    assert set(goal) == {"on"}
    assert goal["on"]["16"] == {"ttft_overhead_pct": 1.0, "forward_overhead_pct": 1.0, "goal_overhead_pct": 1.0,
                                "ttft_meets_goal": True, "forward_meets_goal": True, "runs": 1, "meets_goal": True}
    assert goal["on"]["32"]["ttft_overhead_pct"] == 0.5 and goal["on"]["32"]["forward_overhead_pct"] == 2.0
    assert goal["on"]["32"]["meets_goal"] is False
    only_ttft = bench.goal_verdict(ttft, {})
    assert only_ttft["on"]["16"]["missing"] == ["forward"] and only_ttft["on"]["16"]["meets_goal"] is False


@pytest.mark.parametrize("runs", [3, 5])
def test_ttft_report_says_whether_the_runs_reach_the_issues_minimum(runs):
    import argparse

    bench = _bench()
    args = argparse.Namespace(layers=8, cp_size=2, kv_cache_dtype="bfloat16", lengths=[16384], runs=runs)
    header = bench.report_header(args, "bench")
    assert header["runs"] == runs and header["runs_meet_issue_minimum"] is (runs >= 5)
    assert header["goal_overhead_pct"] == 1.0
