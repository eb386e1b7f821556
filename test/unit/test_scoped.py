"""attributes_set leaves every object exactly as it found it, however the block ends."""

import types

import pytest

from sglang_cp_shared_kv.scoped import attributes_set


class Base:
    greeting = "hello"


def test_own_attribute_restored_after_an_exception():
    module = types.SimpleNamespace(value=1)
    with pytest.raises(RuntimeError):
        with attributes_set(module, value=2):
            assert module.value == 2
            raise RuntimeError("boom")
    assert module.value == 1


def test_inherited_attribute_is_deleted_again_not_copied():
    class Parent:
        def method(self):
            return "parent"

    class Heir(Parent):
        pass

    with attributes_set(Heir, method=lambda self: "patched"):
        assert Heir().method() == "patched"
    assert "method" not in vars(Heir)
    # A later change to the parent shows through again, as before the block.
    Parent.method = lambda self: "changed"
    assert Heir().method() == "changed"


def test_class_attribute_seen_through_an_instance():
    obj = Base()
    with attributes_set(obj, greeting="bye"):
        assert obj.greeting == "bye" and Base.greeting == "hello"
    assert "greeting" not in vars(obj)


def test_misspelt_name_raises_before_anything_is_set():
    obj = types.SimpleNamespace(value=1)
    with pytest.raises(AttributeError):
        with attributes_set(obj, value=2, valeu=3):
            pass
    assert obj.value == 1 and not hasattr(obj, "valeu")


def test_slotted_object():
    class Slotted:
        __slots__ = ("value",)

    obj = Slotted()
    obj.value = 1
    with attributes_set(obj, value=2):
        assert obj.value == 2
    assert obj.value == 1
