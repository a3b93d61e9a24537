"""The import layers (`entmtp.LAYERS`, stated in DESIGN.md *Layers*): every `entmtp` module
imports only from a lower floor or within its own package, and no modules import each other in a
circle. Imports are read from the source with `ast`, lazy ones inside functions included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import entmtp

ROOT = Path(entmtp.__file__).resolve().parent
FLOOR = {unit: i for i, units in enumerate(entmtp.LAYERS) for unit in units}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path) -> dict[str, set[str]]:
    """module -> the `entmtp` modules it imports (a name imported from a package counts as its
    submodule where one exists)."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        found = out.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != root.name:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    is_module = (root.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (root.parent / Path(*sub.split("."))).is_dir()
                    found.add(sub if is_module else target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
    return out


def unit(module: str) -> str:
    """The top-level module or package under `entmtp` that `module` belongs to ("" for entmtp itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import against the floors, and each circle, as a line."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = unit(src), unit(dst)
            if a == b or b == "":
                continue  # within a package, or the package's own __init__ (version, LAYERS)
            if a not in FLOOR or b not in FLOOR:
                bad.append(f"{src} -> {dst}: {a if a not in FLOOR else b!r} is on no floor of entmtp.LAYERS")
            elif FLOOR[b] >= FLOOR[a]:
                bad.append(f"{src} (floor {FLOOR[a]}) imports {dst} (floor {FLOOR[b]})")
    return bad + [f"circle: {' -> '.join(c)}" for c in circles(graph)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down_and_none_closes_a_circle():
    graph = imports(ROOT)
    assert len(graph) > 30 and not violations(graph), "\n".join(violations(graph))
    on_a_floor = {unit(m) for m in graph} - {""}
    assert on_a_floor <= set(FLOOR), f"not on any floor: {sorted(on_a_floor - set(FLOOR))}"


@pytest.mark.parametrize("low, high, lazy", [
    ("model/kv.py", "from entmtp.spec.topology import Tree", False),  # upward, at the top
    ("spec/topology.py", "from entmtp.bank import traces", True),  # upward, inside a function
    ("runtime/baselines.py", "from entmtp.figures import plots", False),  # sideways between siblings
])
def test_a_planted_upward_import_fails(tmp_path, low, high, lazy):
    import shutil

    copy = tmp_path / "entmtp"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / low
    line = f"\n\ndef _planted():\n    {high}\n" if lazy else f"\n{high}\n"
    target.write_text(target.read_text() + line)
    assert any(low.replace("/", ".").removesuffix(".py") in v for v in violations(imports(copy)))
    assert not violations(imports(ROOT))


def test_a_planted_circle_inside_a_package_fails(tmp_path):
    import shutil

    copy = tmp_path / "entmtp"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    kernels = copy / "model" / "kernels.py"
    kernels.write_text(kernels.read_text() + "\n\ndef _planted():\n    from entmtp.model import forward\n")
    assert any(v.startswith("circle:") and "entmtp.model.kernels" in v for v in violations(imports(copy)))


def test_design_states_the_same_floors():
    design = (ROOT.parent / "DESIGN.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", design, flags=re.M)
    stated = tuple(tuple(re.findall(r"`([\w.]+)`", names)) for _, names in rows)
    assert stated == entmtp.LAYERS, f"DESIGN.md *Layers* says {stated}, entmtp.LAYERS is {entmtp.LAYERS}"
