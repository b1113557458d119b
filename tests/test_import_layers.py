"""The import graph: validating a configuration loads no trainer module (``megazero.training``), in a
fresh interpreter, so that ``validate()`` (every front end's first step) stays light; and no package of
megazero imports one on its own floor or above (:data:`FLOORS`)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

CODE = """
import sys
from megazero.config import config_from_dict, validate
validate(config_from_dict(dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4,
                               seq_length=16, vocab_size=100)), 1)
print(" ".join(sorted(m for m in sys.modules if m.startswith("megazero"))))
"""


def test_validate_loads_no_trainer_module():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                         check=True)
    loaded = out.stdout.split()
    assert "megazero.config.validation" in loaded
    assert [m for m in loaded if m.startswith("megazero.training")] == []


# megazero's packages from the bottom floor up: a module may import its own package and any package on
# a lower floor, never one on its own floor or above (docs/design.md, "Floors").  ``megazero`` is the
# package's own __init__ (it re-exports the engine's initialize).
FLOORS = [
    ["errors"],
    ["process", "optim", "mesh"],
    ["offload", "resilience", "tensor_parallel"],
    ["checkpoint", "context_parallel", "data"],
    ["moe", "zero"],
    ["pipeline"],
    ["config"],
    ["planning", "engine"],
    ["training", "deepspeed"],
    ["megazero"],
]


def _imports(path):
    """Every megazero module ``path`` imports, at module level or inside a function."""
    import ast
    rel = path.relative_to(ROOT)
    package = list(rel.parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield from ([module] if node.module else [f"{module}.{a.name}" for a in node.names])


def _floor_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megazero" else parts[0]


def _upward_imports():
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    found = []
    for path in sorted((ROOT / "megazero").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        src = "megazero" if rel.parts[1:] == ("__init__",) else rel.parts[1]
        assert src in floor, f"megazero/{src} is on no floor: add it to FLOORS"
        for module in _imports(path):
            if not module.startswith("megazero."):
                continue
            dst = _floor_name(module)
            assert dst in floor, f"{module} (imported by {rel}) is on no floor"
            if dst != src and floor[dst] >= floor[src]:
                found.append(f"{rel} imports {module}")
    return found


def test_no_package_imports_one_above_it():
    assert _upward_imports() == []


def test_the_floor_check_sees_a_function_level_import(tmp_path, monkeypatch):
    """The check reads imports inside functions too (where most upward ones hid)."""
    tree = tmp_path / "megazero"
    (tree / "zero").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "zero" / "__init__.py").write_text("def f():\n    from megazero.training import loop\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _upward_imports() == ["megazero/zero/__init__ imports megazero.training"]
