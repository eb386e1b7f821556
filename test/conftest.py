"""Shared pytest setup. The plugin, its kernels and its test rigs
(``sglang_cp_shared_kv.testing``) are importable as installed packages
(``scripts/bootstrap.sh test``; on the GPU machine ``scripts/gpu_session.sh`` puts the
checkout on PYTHONPATH): no ``sys.path`` edits here."""
