"""Every SGLang symbol the plugin imports, through one table: the installed release's
(:attr:`.releases.release.Release.symbols`; the hook targets are the other table,
:mod:`sglang_cp_shared_kv.plugin`'s).

The plugin's modules never ``import sglang...`` themselves (a unit test walks the package
and enforces it); they read SGLang through this module::

    from sglang_cp_shared_kv import sglang_api as sg

    class CpSharedNSATokenToKVPool(sg.NSATokenToKVPool): ...
    group = sg.get_attention_cp_group()

Each name resolves when it is used (PEP 562 ``__getattr__``), so importing the plugin costs
nothing until a symbol is needed: the plugin loader imports ``plugin.py`` in every SGLang
process, the tokenizer and the router included.
"""

from __future__ import annotations

import importlib

from sglang_cp_shared_kv.releases.installed import INSTALLED, RECOMMENDED

#: The installed release's table (the recommended release's where the installed one is not
#: served: that path resolves no symbol, its flag only refuses).
SYMBOLS = (INSTALLED or RECOMMENDED).symbols


def resolve(name: str):
    """The SGLang object ``name`` of :data:`SYMBOLS` (its module imported on first use)."""
    module_name, attribute = SYMBOLS[name]
    value = importlib.import_module(module_name)
    for part in (attribute.split(".") if attribute is not None else ()):
        value = getattr(value, part)
    return value


def __getattr__(name: str):
    if name not in SYMBOLS:
        raise AttributeError(f"{__name__} has no SGLang symbol {name!r}; add it to the release's table (releases/v*.py)")
    # NOTE: looked up on every use, never cached here: the hook registry and the tests
    # rebind module attributes of SGLang, and this must see what SGLang itself sees.
    return resolve(name)
