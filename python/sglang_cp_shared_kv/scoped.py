"""Setting attributes for the duration of one block, and restoring them however it ends."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def attributes_set(obj, **values):
    """Within the block, ``obj.<name>`` is ``values[name]``; the old values come back after."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)
