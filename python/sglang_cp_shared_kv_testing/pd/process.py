"""One rig process: its role over the plan's rooms, and its JSON results.

Owns :func:`main` (what ``python -m sglang_cp_shared_kv_testing.pd_rig --plan PLAN
--proc NAME`` runs), :func:`_serve` (set up SGLang's Mooncake engine and the plugin's
transfer hooks, then either receive every room as the decode or host this process's
prefill ranks -- and for rank 0 the instance's ``MooncakeKVBootstrapServer`` -- and send
the rooms they serve) and :func:`_write_results` (``results-NAME.json`` in the plan's
workdir, rewritten after every prefill room). A prefill process stays up until the
launcher marks the run finished; every process ends with ``os._exit`` (SGLang's manager
threads are not daemons).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict

from sglang_cp_shared_kv_testing.pd.decode import DecodeSide
from sglang_cp_shared_kv_testing.pd.geometry import Geometry
from sglang_cp_shared_kv_testing.pd.prefill import PrefillInstance
from sglang_cp_shared_kv_testing.pd.releases import release
from sglang_cp_shared_kv_testing.pd.sglang_side import apply_transfer_hooks


def _write_results(plan: Dict[str, Any], proc: str, results: Dict[str, Any]) -> None:
    # After every room, so a process killed on purpose still reports its earlier rooms.
    path = Path(plan["workdir"]) / f"results-{proc}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, path)


def _serve(plan: Dict[str, Any], proc: str) -> Dict[str, Any]:
    spec = plan["processes"][proc]
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "INFO")),
                        format=f"%(asctime)s {proc} %(name)s %(levelname)s %(message)s")
    import torch
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    # Small copies with torch's intra-op pool cost ~7 ms each on a 2-core box (vs 10 us).
    torch.set_num_threads(1)
    release().setup_process(plan["workdir"], "decode" if spec["role"] == "decode" else "prefill")
    apply_transfer_hooks()
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    geometry = Geometry(**plan["geometry"])
    instances = plan["instances"]
    results: Dict[str, Any] = {"rooms": {}}
    if spec["role"] == "decode":
        decode = DecodeSide(plan, geometry)
        for spec_i in instances.values():
            decode.connect(spec_i["bootstrap_port"])
        for room in plan["rooms"]:
            try:
                outcome = decode.receive(room, instances[room["instance"]]["bootstrap_port"])
            except Exception as exc:
                logging.getLogger(__name__).exception("room %s failed in the rig", room["room"])
                outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "elapsed_s": -1}
            results["rooms"][str(room["room"])] = outcome
            print(f"{time.strftime('%H:%M:%S')} room {room['room']} ({room['name']}): {outcome['status']} "
                  f"in {outcome['elapsed_s']:.2f}s {outcome.get('error', '')}", flush=True)
        results["stray_writes"] = decode.stray_writes()
        return results

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

    mine = {name: s["procs"].index(proc) for name, s in instances.items() if proc in s["procs"]}
    servers = [MooncakeKVBootstrapServer(host="127.0.0.1", port=instances[name]["bootstrap_port"])
               for name, rank in mine.items() if rank == 0]
    hosted = {name: PrefillInstance(name, instances[name], rank, geometry, plan["max_seq_len"], workdir=plan["workdir"])
              for name, rank in mine.items()}
    for room in plan["rooms"]:
        instance = hosted.get(room["instance"])
        if instance is None:
            continue
        try:
            outcome = instance.send(room, proc)
        except Exception as exc:  # keep going: later rooms and decode must not hang on this one
            logging.getLogger(__name__).exception("room %s failed in the rig", room["room"])
            outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        results["rooms"][str(room["room"])] = outcome
        _write_results(plan, proc, results)
        print(f"{time.strftime('%H:%M:%S')} room {room['room']} ({room['name']}) rank {instance.cp_rank}: "
              f"{outcome['status']} {outcome.get('error', '')}", flush=True)
    results["bootstrap_servers"] = len(servers)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--proc", required=True)
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    workdir = Path(plan["workdir"])
    code = 0
    try:
        results = _serve(plan, args.proc)
    except BaseException as exc:  # report, then leave without waiting for SGLang's threads
        import traceback

        traceback.print_exc()
        results = {"error": f"{type(exc).__name__}: {exc}"}
        code = 1
    _write_results(plan, args.proc, results)
    print("DONE", flush=True)
    if plan["processes"][args.proc]["role"] != "decode":
        # Stay up (bootstrap servers, managers) until decode is through with every room.
        end = time.monotonic() + 600
        while not (workdir / "finished").exists() and time.monotonic() < end:
            time.sleep(0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
