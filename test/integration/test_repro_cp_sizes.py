"""scripts/repro_cp_sizes.py on CPU: the model it writes per CP size, the prompts it posts, and its
probe loop against stand-in servers (one that serves, one whose scheduler dies on the 1,504-token
prompt with CUDA's error, one that never boots, one that drops connections but keeps running):
every size gets a record, the next size starts after a failure, and the record says what failed."""

import json
import sys
from pathlib import Path

import pytest

from sglang_cp_shared_kv_testing import server
from sglang_cp_shared_kv_testing.shared_gpu import SHARED_GPU_LINE
from sglang_cp_shared_kv_testing.support import SCRIPTS, load_script

ILLEGAL_ACCESS = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
NOT_DIVISIBLE = "ValueError: 8192 is not divisible by 3"

#: a stand-in for one SGLang server: argv = port, tp, behaviour (serve | crash | drop | noboot)
STAND_IN = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, tp, behaviour = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
print("Can not initialize OpenAIServingResponses, error: Traceback (most recent call last):", flush=True)
if behaviour == "noboot":
    print(sys.argv[4], flush=True)
    raise SystemExit(1)
for rank in range(tp):
    print(SHARED_GPU_LINE, "rank", rank, flush=True)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        length = len(body["input_ids"])
        print("prompt", length, flush=True)
        if behaviour == "crash" and length == 1504:  # a traceback's source line, then its message
            print("Traceback (most recent call last):", "    raise RuntimeError(err)", sys.argv[4], sep="\n", flush=True)
            os._exit(1)  # no answer: the connection closes under the client
        if behaviour == "drop":
            self.close_connection = True  # the scheduler died, the HTTP process lives on
            return
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(json.dumps({"meta_info": {"finish_reason": {"type": "length"}}}).encode())
HTTPServer(("127.0.0.1", port), H).serve_forever()
""".replace("SHARED_GPU_LINE", repr(SHARED_GPU_LINE))

BEHAVIOUR = {2: ("serve", ""), 3: ("crash", ILLEGAL_ACCESS), 5: ("noboot", NOT_DIVISIBLE), 6: ("drop", "")}


@pytest.fixture(scope="module")
def cp_sizes():
    sys.path.insert(0, str(SCRIPTS))  # the script imports its sibling scripts, as when run from scripts/
    try:
        yield load_script("repro_cp_sizes")
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize("n", range(2, 9))
def test_each_model_shards_evenly_and_cp_2_4_8_keep_the_e2e_model(cp_sizes, n):
    config = cp_sizes.model_for(n)
    base = cp_sizes.e2e.MODEL
    for dim, align in cp_sizes.SHARDED_DIMS.items():
        assert config[dim] % n == 0 and config[dim] % align == 0, (dim, config[dim])
        assert base[dim] <= config[dim] < base[dim] + n * align, dim  # the next such size, not a bigger one
    assert {k: v for k, v in config.items() if k not in cp_sizes.SHARDED_DIMS} == \
        {k: v for k, v in base.items() if k not in cp_sizes.SHARDED_DIMS}
    assert (config == base) == (n in (2, 4, 8))


@pytest.mark.parametrize("n", range(2, 9))
def test_the_prompts_separate_padding_from_odd_segments(cp_sizes, n):
    """SGLang pads a chunk to a multiple of N and cuts it into 2N segments: the probe's first
    prompts have neither, odd segments alone, padding alone, then the 1,504 tokens of the crash."""
    (even_name, even), (odd_name, odd), (padded_name, padded), *rest = cp_sizes.prompts(n).items()
    segments = 2 * n
    assert even % (segments * 64) == 0 and 0 < even <= cp_sizes.e2e.CHUNK and even_name.endswith(str(even))
    assert odd % segments == 0 and (odd // segments) % 2 == 1 and odd <= 1504 < odd + 2 * segments
    assert padded % n != 0 and -(-padded // n) * n == even and padded_name.endswith(str(padded))
    assert odd_name.endswith(str(odd)) and rest == [("one_chunk_1504", 1504), ("two_chunks_3008", 3008)]


def test_every_size_is_probed_in_turn_and_each_failure_recorded(cp_sizes, monkeypatch, tmp_path):
    launched = []

    def stand_in(name, flag_on, corrupt, pool, model, port, args, log_path):
        assert not flag_on and corrupt is None and args.share_gpu and not args.stable_topk
        launched.append((name, args.tp, json.loads((Path(model) / "config.json").read_text())))
        behaviour, line = BEHAVIOUR[args.tp]
        cmd = [sys.executable, "-c", STAND_IN, str(port), str(args.tp), behaviour, line]
        return server.start_server(name, cmd, server.e2e_env(), port, log_path, args.boot_timeout)

    monkeypatch.setattr(cp_sizes.e2e, "launch", stand_in)
    out = tmp_path / "report.json"
    argv = ["--sizes", "5,3,6,2", "--port", str(_port_base()), "--boot-timeout", "60",
            "--prompt-timeout", "20", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert cp_sizes.main(argv) == 0
    assert [(name, tp) for name, tp, _ in launched] == [("cp5", 5), ("cp3", 3), ("cp6", 6), ("cp2", 2)]
    assert all(config == cp_sizes.model_for(tp) for _, tp, config in launched)

    report = json.loads(out.read_text())
    assert report["share_gpu"] and report["flag"] == "off" and report["sizes"] == [5, 3, 6, 2]
    assert report["served"] == [2] and sorted(report["not_served"]) == [3, 5, 6] and report["failed_runs"] == {}
    runs = report["runs"]
    assert runs["cp2"]["booted"] and runs["cp2"]["server_alive"] and runs["cp2"]["first_error"] is None
    assert set(runs["cp2"]["prompts"].values()) == {"answered"} and "log_tail" not in runs["cp2"]
    assert runs["cp2"]["share_gpu_problem"] is None and runs["cp2"]["model"]["vocab_size"] == 8192

    crashed = runs["cp3"]
    assert crashed["booted"] and not crashed["server_alive"] and crashed["first_error"] == ILLEGAL_ACCESS
    assert crashed["prompts"]["one_chunk_1504"].startswith("no answer:")
    after = crashed["prompts"]["two_chunks_3008"]  # the process may not have ended yet when it is posted
    assert after == "not sent: the server had exited" or after.startswith("no answer:"), after
    assert [crashed["prompts"][name] for name in list(cp_sizes.prompts(3))[:3]] == ["answered"] * 3
    assert ILLEGAL_ACCESS in crashed["log_tail"] and crashed["model"]["vocab_size"] == 8256

    unbooted = runs["cp5"]
    assert not unbooted["booted"] and not unbooted["server_alive"] and unbooted["prompts"] == {}
    assert "server exited with 1" in unbooted["boot_error"] and unbooted["first_error"] == NOT_DIVISIBLE
    assert "share_gpu_problem" not in unbooted

    dropped = runs["cp6"]  # a scheduler gone under a live HTTP process: every prompt unanswered
    assert dropped["booted"] and dropped["server_alive"] and dropped["first_error"] is None
    assert all(answer.startswith("no answer:") for answer in dropped["prompts"].values())
    assert (tmp_path / "work" / "cp3.log").exists() and len(dropped["log_tail"]) > 0


def test_sizes_outside_what_in_seq_split_can_take_are_refused(cp_sizes, tmp_path):
    with pytest.raises(SystemExit):
        cp_sizes.main(["--sizes", "1,3", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit):
        cp_sizes.main(["--sizes", "9", "--workdir", str(tmp_path)])


def _port_base() -> int:
    """A base port whose run ports (base + 10 x N, N = 2..8; NCCL's + 5) are free now."""
    import random
    import socket

    def free(port):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(50):
        base = random.randrange(20000, 60000, 100)
        if all(free(base + 10 * n) for n in range(2, 9)):
            return base
    raise RuntimeError("no free range of ports")
