"""The host-synchronisation counter the CP harness uses (sglang_cp_shared_kv_testing/host_syncs.py): it counts
the torch calls that synchronise on CUDA when a plugin module makes them, filed by the
phase the rig reports, and leaves torch as it was."""

import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.owned_rows import owned_rows_of
from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map
from sglang_cp_shared_kv_testing.host_syncs import HostSyncCounter


def test_counts_the_plugins_synchronising_calls_by_phase_and_site():
    layout = CpSharedKVLayout(64, 3, 1)
    counter = HostSyncCounter()
    with counter.counting():
        counter.at_layer(None, forward_start=True)
        page_map = build_dense_page_map(layout, torch.arange(1, 11), 4, read_also=(torch.tensor(7),))
        counter.at_layer(0)
        owned_rows_of(layout, None, torch.arange(64, 64 * 9))  # a location tensor of its own: nonzero
        counter.at_layer(1)
        torch.arange(5).nonzero().tolist()  # this test's own calls are not the plugin's
        bool(torch.tensor(True))
        counter.at_layer(None)
    report = counter.report()
    assert page_map.read_also == (7,)
    assert set(report) == {"forward start", "layer 0"}
    (site, calls), = report["forward start"].items()
    assert site.startswith("forward/dense_layout.py:") and site.endswith("Tensor.tolist") and calls == 1
    assert [s.split(" ", 1)[1] for s in report["layer 0"]] == ["Tensor.nonzero"]
    assert all(s.startswith("pool/owned_rows.py:") for s in report["layer 0"])


def test_a_view_of_the_batchs_out_cache_loc_reuses_its_owned_rows_without_a_host_read():
    from types import SimpleNamespace

    layout = CpSharedKVLayout(64, 3, 1)
    loc = torch.arange(64, 64 * 9)
    rows, physical = owned_rows_of(layout, None, loc)
    state = SimpleNamespace(out_cache_loc=loc, owned_rows=rows, owned_physical_locs=physical)
    counter = HostSyncCounter()
    with counter.counting():
        counter.at_layer(0)
        for same in (loc, loc.contiguous(), loc.view(-1), loc[:]):
            assert owned_rows_of(layout, state, same)[0] is rows
        assert not counter.report()
        copy_rows, copy_physical = owned_rows_of(layout, state, loc.clone())  # another tensor: filtered
        assert torch.equal(copy_rows, rows) and torch.equal(copy_physical, physical)
        assert owned_rows_of(layout, state, loc[1:])[0] is not rows  # another range of the memory
        counter.at_layer(None)
    assert sum(counter.report()["layer 0"].values()) == 2


def test_boolean_masks_and_repeat_interleave_without_a_size_count_the_rest_does_not():
    from sglang_cp_shared_kv_testing import host_syncs

    counter = HostSyncCounter()
    # calls made as if from a plugin module: route them through a function compiled with a
    # plugin file name (the counter looks at the direct caller's file)
    code = compile("def f(t, m):\n    t[m]; t[1:]; t.repeat_interleave(2); t.repeat_interleave(2, output_size=6)\n",
                   host_syncs._PLUGIN_DIR + "/forward/pretend.py", "exec")
    scope = {}
    exec(code, scope)
    with counter.counting():
        counter.at_layer(3)
        scope["f"](torch.arange(3), torch.tensor([True, False, True]))
    sites = counter.report()["later layers"]
    assert sorted(s.split(" ", 1)[1] for s in sites) == ["Tensor.repeat_interleave", "boolean-mask indexing"]


def test_torch_is_restored_after_counting():
    before = (torch.Tensor.item, torch.Tensor.__getitem__, torch.equal, torch.nonzero)
    counter = HostSyncCounter()
    with counter.counting():
        assert torch.Tensor.item is not before[0]
    assert (torch.Tensor.item, torch.Tensor.__getitem__, torch.equal, torch.nonzero) == before
    assert torch.tensor([2, 3])[torch.tensor([False, True])].tolist() == [3]
