"""Every measurement script under scripts/ and tools/ still imports: they run outside the suite (the docs
quote their figures), so a module they use that moves would otherwise break them unnoticed."""

import importlib

import pytest

from tests.helpers import ROOT

MODULES = sorted(
    f"{path.parent.name}.{path.stem}"
    for folder in ("scripts", "tools")
    for path in (ROOT / folder).glob("*.py")
    if path.stem != "__init__"
)


def test_there_are_scripts_to_check():
    assert "scripts.compute_restart" in MODULES and "tools.structured_overhead" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_the_script_imports(module):
    imported = importlib.import_module(module)
    assert imported.__file__ == str(ROOT / module.replace(".", "/")) + ".py", imported.__file__
