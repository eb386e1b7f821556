"""A real Mooncake store on loopback for the HiCache storage tests: ``mooncake_master`` (the
store's master, with its HTTP metadata server) started on free ports of 127.0.0.1, and the
``--hicache-storage-backend-extra-config`` SGLang's Mooncake backend reads to reach it over TCP.

Use::

    with mooncake_master() as master:
        extra = master.extra_config(prefetch_threshold=64)   # a dict; json.dumps it for ServerArgs
        ...   # every process that builds a MooncakeStore with ``extra`` shares this store

Each process that sets up a store client contributes ``global_segment_size`` bytes of its
memory to the store (SGLang divides it by the TP size). A rig that ends a client before its
process ends, or runs groups one after another on one master, closes its clients with
:func:`close_store_clients` (why: its docstring).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

from sglang_cp_shared_kv_testing.support import free_port


@dataclasses.dataclass(frozen=True)
class MooncakeMaster:
    rpc_port: int
    metadata_port: int
    log_path: str

    def extra_config(self, *, global_segment_size: int = 64 << 20, **overrides) -> dict:
        """SGLang's Mooncake backend configuration for this master (TCP on loopback), with
        ``overrides`` (e.g. ``prefetch_threshold``, which HiRadixCache takes from the same JSON)."""
        return {"master_server_address": f"127.0.0.1:{self.rpc_port}",
                "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
                "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
                "global_segment_size": global_segment_size, "check_server": False, **overrides}


def master_binary() -> str:
    """``mooncake_master`` beside this interpreter (a venv's), in the ``mooncake`` package (the
    GPU site of ``STORE=1 scripts/build_gpu_mooncake.sh``), else on PATH; raises if none."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    places = [os.path.dirname(sys.executable), *(spec.submodule_search_locations or [] if spec else [])]
    for place in places:
        candidate = os.path.join(place, "mooncake_master")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError("mooncake_master not found beside the interpreter, in the mooncake package or on "
                                "PATH (it comes with mooncake-transfer-engine; scripts/bootstrap.sh installs it)")
    return found


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def mooncake_master(*, start_timeout_s: float = 20.0) -> Iterator[MooncakeMaster]:
    """A ``mooncake_master`` for the block (stopped after it); its log in a temporary file."""
    rpc_port, metadata_port, metrics_port = free_port(), free_port(), free_port()
    log_path = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")[1]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [master_binary(), f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={metadata_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={metrics_port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not (_listening(rpc_port) and _listening(metadata_port)):
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as log:
                    raise RuntimeError(f"mooncake_master did not start (exit {process.poll()}):\n{log.read()[-2000:]}")
            time.sleep(0.1)
        yield MooncakeMaster(rpc_port, metadata_port, log_path)
    finally:
        process.kill()
        process.wait(timeout=10)


def close_store_clients(stores, cpu_group) -> None:
    """Close this rank's Mooncake store clients ``stores`` (each a ``MooncakeDistributedStore``;
    closing unmounts its segment at once), then wait on ``cpu_group`` until every rank has
    closed its own.

    NOTE: the master puts an object on any mounted segment, the writing client's own or another
    client's, and drops what a segment holds when its client goes. A client left to its
    destructor or to the end of its process stays mounted until the master expires it
    (``client_ttl``, seconds later) and then takes with it whatever later clients put on its
    segment meanwhile: SGLang's store warmup (``put`` then ``assert is_exist(key) == 1``) failed
    that way on one rank (CI of c3e0bc6, 0.5.23 L3 rig, N=4; here, N=3), and so could any page a
    later case stored. Closed at one agreed point, no segment of a finished case or group is
    left for the next one's objects."""
    for store in stores:
        code = store.close()
        if code:
            raise RuntimeError(f"closing the Mooncake store client failed (code {code})")
    import torch.distributed

    torch.distributed.barrier(group=cpu_group)


__all__ = ["MooncakeMaster", "close_store_clients", "mooncake_master", "master_binary"]
