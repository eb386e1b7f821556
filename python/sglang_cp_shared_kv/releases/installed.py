"""The releases the flag serves, and the one installed (read once, at import)."""

from __future__ import annotations

from typing import Optional, Tuple

from sglang_cp_shared_kv.releases import v0512, v0523
from sglang_cp_shared_kv.releases.release import Release, installed_sglang_version

#: Every release the flag serves; the GPU-verified first.
SUPPORTED: Tuple[Release, ...] = (v0512.RELEASE, v0523.RELEASE)
#: The release a user should install where the installed one is not served.
RECOMMENDED: Release = next(r for r in SUPPORTED if r.gpu_verified)


def for_version(version: Optional[str]) -> Optional[Release]:
    """The release whose version is ``version`` exactly (None: not served)."""
    return next((r for r in SUPPORTED if r.version == version), None)


#: The installed SGLang's version (None: not installed) and its release (None: not served).
INSTALLED_VERSION: Optional[str] = installed_sglang_version()
INSTALLED: Optional[Release] = for_version(INSTALLED_VERSION)


def unsupported_base_problem(version: Optional[str]) -> str:
    """What the flag says on an SGLang it does not serve."""
    others = " or ".join(f"sglang=={r.version}" for r in SUPPORTED if r is not RECOMMENDED)
    supported = " or ".join(f"sglang=={r.version}" for r in SUPPORTED)
    return (f"this sglang-cp-shared-kv release runs on {supported}, and the installed sglang is "
            f"{version or 'not found'}: install sglang=={RECOMMENDED.version} (scripts/bootstrap.sh; the GPU-verified "
            f"one) or {others}, or drop the flag")
