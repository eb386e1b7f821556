"""Register the plugin's hooks and prove, at startup, that each one is in place.

SGLang's ``HookRegistry.apply_hooks`` logs a failing target and carries on, so a
renamed method would silently turn the feature into a no-op (or half of one). With
the flag on, :func:`require_hooks_applied` stops startup instead, naming each hook
that is missing. A hook counts as applied when the attribute now on its target wraps
our hook function -- read from the target itself, not from the registry's private
records, so a later plugin that replaced the attribute again is caught too.

Registration is process-wide by nature (SGLang's ``HookRegistry`` is a class-level
registry); :func:`registered_hooks` lists what this process registered.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.settings.config import FLAG


class CpSharedKVHookError(RuntimeError):
    """A plugin hook required by ``--enable-nsa-prefill-cp-shared-kv`` is not in place."""


#: A wrapper of one of SGLang 0.5.23's named ServerArgs resolution steps
#: (``arg_groups/resolution_hooks.py``): ``fn(server_args, previous)``, registered with
#: ``register_resolution_hook(step)``; HookRegistry cannot reach those steps (the pipeline
#: holds the functions it runs).
RESOLUTION = "resolution"


@dataclass(frozen=True)
class HookSpec:
    target: str  # dotted path, as HookRegistry.register takes it; for RESOLUTION the step's name
    hook: Callable
    hook_type: str  # "before" | "after" | "around" | "replace" (HookType values), or RESOLUTION


_registered: List[HookSpec] = []


def register_hooks(specs: Iterable[HookSpec]) -> None:
    for spec in specs:
        if spec in _registered:  # a second load_plugins() in one process must not stack hooks
            continue
        if spec.hook_type == RESOLUTION:
            sg.resolution_hooks.register_resolution_hook(spec.target)(spec.hook)
        else:
            sg.HookRegistry.register(spec.target, spec.hook, sg.HookType(spec.hook_type))
        _registered.append(spec)


def registered_hooks() -> Sequence[HookSpec]:
    return tuple(_registered)


def _installed_attribute(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    value = inspect.getattr_static(owner, attr)
    return getattr(value, "__func__", value)  # classmethod / staticmethod


def _wraps_hook(installed, hook: Callable) -> bool:
    seen = 0
    fn = installed
    while fn is not None and seen < 64:
        if fn is hook:
            return True
        if getattr(fn, "__closure__", None):
            if inspect.getclosurevars(fn).nonlocals.get("hook") is hook:
                return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def missing_hooks(specs: Optional[Iterable[HookSpec]] = None) -> List[str]:
    """One line per hook of ``specs`` (default: all registered) that is not in place."""
    problems = []
    for spec in registered_hooks() if specs is None else specs:
        name = f"{spec.hook_type.upper()} {spec.target}"
        if spec.hook_type == RESOLUTION:
            # NOTE: SGLang exposes no query; its registry is the module's step -> wrappers dict
            if spec.hook not in getattr(sg.resolution_hooks, "_HOOKS", {}).get(spec.target, ()):
                problems.append(f"{name}: not registered with SGLang's resolution hooks")
            continue
        try:
            installed = _installed_attribute(spec.target)
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"{name}: not applied, the target does not resolve ({exc}; see the "
                            f"'Failed to apply hooks to {spec.target}' log)")
            continue
        if not _wraps_hook(installed, spec.hook):
            problems.append(f"{name}: the attribute on the target no longer wraps our hook (replaced later?)")
    return problems


def _why_hooks_miss() -> str:
    version = installed.INSTALLED_VERSION
    if installed.INSTALLED is None:
        return installed.unsupported_base_problem(version)
    return (f"sglang {version} is a release the plugin has hooks for, so another plugin or a patched SGLang replaced "
            "these targets: load sglang-cp-shared-kv alone (SGLANG_PLUGINS=cp_shared_kv) or drop the flag")


def require_hooks_applied(where: str, specs: Optional[Iterable[HookSpec]] = None) -> None:
    """Raise :class:`CpSharedKVHookError` unless every hook is in place."""
    specs = registered_hooks() if specs is None else tuple(specs)
    if not specs:
        raise CpSharedKVHookError(
            f"{FLAG} is set but the sglang-cp-shared-kv plugin registered no hooks in the {where}; "
            "check that the package is installed and that SGLANG_PLUGINS (if set) lists 'cp_shared_kv'."
        )
    problems = missing_hooks(specs)
    if problems:
        raise CpSharedKVHookError(
            f"{FLAG}: {len(problems)} of {len(specs)} plugin hooks are not in place in the {where}, "
            f"so the feature cannot run correctly; {_why_hooks_miss()}.\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
