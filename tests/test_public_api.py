"""The README's API table is true: every module it names imports and has every name it lists,
and every public module declares ``__all__`` naming only things it has."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def api_rows() -> list[tuple[str, list[str]]]:
    start = README.index("| module", README.index("## API"))
    table = README[start : README.index("\n\n", start)]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        module = cells[0].strip("`")
        names = re.findall(r"`([^`]+)`", cells[1])
        rows.append((module, names))
    return rows


ROWS = api_rows()


def test_the_table_was_read():
    modules = [m for m, _ in ROWS]
    assert "eaglepangu_jax.engine" in modules and "eaglepangu_jax.tree" in modules
    assert all(names for _, names in ROWS)


@pytest.mark.parametrize("module,names", ROWS, ids=[m for m, _ in ROWS])
def test_every_listed_name_exists(module, names):
    if module == "npu_backend":
        pytest.importorskip("torch")
    mod = importlib.import_module(module)
    for dotted in names:
        target = mod
        for part in dotted.split("."):
            if not hasattr(target, part):  # a submodule not imported by the package
                target = importlib.import_module(f"{target.__name__}.{part}")
            else:
                target = getattr(target, part)


def public_modules() -> list[str]:
    import eaglepangu_jax

    names = ["eaglepangu_jax"]
    for info in pkgutil.walk_packages(eaglepangu_jax.__path__, "eaglepangu_jax."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", public_modules())
def test_every_public_module_declares_all(name):
    mod = importlib.import_module(name)
    assert hasattr(mod, "__all__"), f"{name} declares no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"
