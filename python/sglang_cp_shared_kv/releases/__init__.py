"""One object per supported SGLang release: everything that differs between releases asks it.

* :mod:`.release` -- :class:`~.release.Release`, what a release is to the plugin (its
  version, its SGLang symbol table, its prefill CP strategy, the CP sizes it serves, whether
  it has run on a GPU, its selfcheck's attention backend, its test environment);
* :mod:`.v0512`, :mod:`.v0523` -- one release each (``RELEASE``);
* :mod:`.installed` -- the releases served and the one installed, read once at import::

      from sglang_cp_shared_kv.releases.installed import INSTALLED   # a Release, or None

No module outside this package names an SGLang version. Release-specific modules elsewhere
carry the release's name as a suffix (``forward/hooks_v0523.py``, ``test_capacity_v0523.py``);
a module without one serves every release.

NOTE: the hook tables are :mod:`sglang_cp_shared_kv.plugin`'s, one per release, keyed by
these objects: the hook modules read SGLang through
:mod:`sglang_cp_shared_kv.sglang_api`, which reads its symbol table from here, so a release
module naming its hook functions would close an import loop.

A new SGLang release: copy the nearest ``vXXXX.py``, change its version and symbols, add it
to :data:`.installed.SUPPORTED`, give ``plugin.py`` its hook table (the hooks whose targets
changed shape in ``*_vXXXX.py`` modules of their concern package), and list its tests in
``test/conftest.py`` (docs/design.md, "Where to change what").

This package's ``__init__`` imports nothing.
"""
