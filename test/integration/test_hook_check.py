"""Hook verification: with the flag on, a hook that is not in place stops startup."""

import pytest

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv import hook_check, plugin
from sglang_cp_shared_kv.hook_check import CpSharedKVHookError, HookSpec, missing_hooks, require_hooks_applied
from sglang_cp_shared_kv_testing.support import shared_kv_kwargs

pytestmark = pytest.mark.usefixtures("plugin_loaded")


def test_every_plugin_hook_is_in_place():
    assert set(hook_check.registered_hooks()) == set(plugin.HOOKS)
    assert missing_hooks() == []
    require_hooks_applied("test process")


def test_loading_twice_does_not_stack_hooks():
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    assert {t: len(h) for t, h in HookRegistry._hooks.items()} == before


def _noop_after(result, *args, **kwargs):
    return result


def test_broken_target_is_named(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry


    broken = HookSpec("sglang.srt.server_args.ServerArgs.no_such_method", _noop_after, "after")
    HookRegistry.register(broken.target, broken.hook)
    try:
        HookRegistry.apply_hooks()  # SGLang logs the failure and carries on
        with pytest.raises(CpSharedKVHookError) as exc:
            require_hooks_applied("test process", [broken, *plugin.HOOKS])
        message = str(exc.value)
        assert "1 of" in message and "ServerArgs.no_such_method: not applied" in message
        # on a supported release the cause is elsewhere: another plugin or a patched SGLang
        assert f"sglang {installed.INSTALLED_VERSION} is a release the plugin has hooks for" in message
        monkeypatch.setattr(installed, "INSTALLED_VERSION", "0.5.22")
        monkeypatch.setattr(installed, "INSTALLED", None)
        expected = r"runs on sglang==0\.5\.12\.post1 or sglang==0\.5\.23, and the installed sglang is 0\.5\.22"
        with pytest.raises(CpSharedKVHookError, match=expected):
            require_hooks_applied("test process", [broken, *plugin.HOOKS])
    finally:
        HookRegistry._hooks.pop(broken.target, None)


def test_hook_replaced_later_is_caught(monkeypatch):
    import sglang.srt.server_args as sa

    spec = next(s for s in plugin.HOOKS if s.target.endswith("check_server_args"))
    monkeypatch.setattr(sa.ServerArgs, "check_server_args", lambda self: None)
    assert missing_hooks([spec]) == [f"AFTER {spec.target}: the attribute on the target no longer wraps our hook (replaced later?)"]


@pytest.mark.usefixtures("pretend_hopper", "all_cp_ranks_env")
def test_startup_refuses_with_a_missing_hook(tiny_nsa_model, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**shared_kv_kwargs(tiny_nsa_model))
    broken = HookSpec("sglang.srt.server_args.ServerArgs.not_a_method", _noop_after, "after")
    monkeypatch.setattr(hook_check, "_registered", [*hook_check.registered_hooks(), broken])
    with pytest.raises(CpSharedKVHookError, match="not_a_method"):
        server_args.check_server_args()
    # the same configuration without the flag starts: nothing of ours is checked
    ServerArgs(**shared_kv_kwargs(tiny_nsa_model, enable_nsa_prefill_cp_shared_kv=False)).check_server_args()


def test_no_hooks_registered_is_an_error():
    with pytest.raises(CpSharedKVHookError, match="registered no hooks"):
        require_hooks_applied("test process", [])
