"""Setting attributes for the duration of one block, and restoring them however it ends."""

from __future__ import annotations

from contextlib import contextmanager

_ABSENT = object()


def _own_value(obj, name):
    """``obj``'s own value of ``name``, or ``_ABSENT`` where ``obj`` only inherits it.

    NOTE: an inherited attribute (a method of a base class, a class attribute seen through
    an instance) must be deleted afterwards, not set: setting it would leave a copy on
    ``obj`` that hides any later change to the one it inherits from.
    """
    own = getattr(obj, "__dict__", None)
    if own is None:  # __slots__ and the like: nothing can be inherited past them
        return getattr(obj, name)
    return own.get(name, _ABSENT)


@contextmanager
def attributes_set(obj, **values):
    """Within the block, ``obj.<name>`` is ``values[name]``; afterwards ``obj`` is as it was.

    Every name must exist on ``obj`` (own or inherited): a misspelt name raises
    ``AttributeError`` before anything is set.
    """
    for name in values:
        getattr(obj, name)
    saved = {name: _own_value(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in saved.items():
            if value is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
