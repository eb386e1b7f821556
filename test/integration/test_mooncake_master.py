"""The loopback Mooncake store the HiCache storage rigs share (``sglang_cp_shared_kv_testing.mooncake_master``):
``close_store_clients`` unmounts a client's segment before it returns, so what another client put
there is gone at once, not ``client_ttl`` seconds later. The rigs close every case's clients at
one agreed point on this (its docstring: SGLang's store warmup lost its key to a client left to
expire, CI of c3e0bc6)."""


from sglang_cp_shared_kv_testing.mooncake_master import close_store_clients, mooncake_master
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip


def _client(extra: dict, segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(extra["local_hostname"], extra["metadata_server"], segment_bytes, 16 << 20,
                       extra["protocol"], extra["device_name"], extra["master_server_address"])
    assert code == 0, f"store setup failed: {code}"
    return store


def test_closing_a_client_drops_at_once_what_others_put_on_its_segment(gloo_world_of_one):
    mooncake_engine_or_skip()
    with mooncake_master() as master:
        extra = master.extra_config()
        holder = _client(extra, 16 << 20)
        writer = _client(extra, 0)  # mounts no memory: every object it puts lands on the holder's segment
        keys = [f"object-{i}" for i in range(4)]
        assert [writer.put(key, bytes(4096)) for key in keys] == [0] * 4
        assert [writer.is_exist(key) for key in keys] == [1] * 4
        close_store_clients([holder], gloo_world_of_one.cpu_group)
        assert [writer.is_exist(key) for key in keys] == [0] * 4
        writer.close()
