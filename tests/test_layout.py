"""The package layout keeps its rules: the engine imports no application code, no module of the
engine shadows a standard-library module, no import cycle, and command-line programs live in
models/cli/, not in the engine."""
import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> Dict[str, Path]:
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, known=()) -> Set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level imports too).
    ``from a import b`` counts as ``a.b`` when that is one of the ``known`` modules, else as ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return out


def _engine_graph() -> Dict[str, Set[str]]:
    mods = _modules("megazero")
    return {name: {m for m in _imports(name, path, mods) if m in mods} - {name}
            for name, path in mods.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_engine():
    assert _cycles(_engine_graph()) == []


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_engine_imports_no_application_code():
    for name, path in _modules("megazero").items():
        bad = {m for m in _imports(name, path)
               if m.split(".")[0] in ("models", "megazero_models", "scripts", "bench")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_module_shadows_the_standard_library():
    for package in ("megazero", "models"):
        for name in _modules(package):
            assert name.rpartition(".")[2] not in sys.stdlib_module_names, name


def test_command_line_programs_live_outside_the_engine():
    for name, path in _modules("megazero").items():
        tree = ast.parse(path.read_text())
        mains = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and (n.name == "main" or n.name.endswith("_main"))]
        guards = [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and isinstance(n.left, ast.Name)
                  and n.left.id == "__name__"]
        assert not mains and not guards, f"{path.relative_to(ROOT)}: {mains or '__main__ guard'}"


def test_one_source_for_exit_statuses_and_thread_defaults():
    """megazero.errors holds the exit statuses and megazero.process.threads the per-rank thread rule: no
    program of megazero, models or scripts returns a literal status from its main() or sets one thread
    itself."""
    import re
    from megazero.process.threads import THREADS_PER_RANK, rank_thread_env
    assert rank_thread_env({})["OMP_NUM_THREADS"] == str(THREADS_PER_RANK) == "1"
    assert rank_thread_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert rank_thread_env({"OMP_NUM_THREADS": "4"}, force=True)["OMP_NUM_THREADS"] == "1"
    found = []
    for package in ("megazero", "models", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "threads.py" and path.parent.name == "megazero":
                continue
            tree = ast.parse(path.read_text())
            mains = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.endswith("main")]
            found += [f"{path.name}:{r.lineno} return {r.value.value}" for fn in mains for r in ast.walk(fn)
                      if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)
                      and r.value.value in (0, 1, 2) and not isinstance(r.value.value, bool)]
            pattern = r"set_num_threads\(1\)|OMP_NUM_THREADS=\"1\""
            found += [f"{path.name}: {m}" for m in re.findall(pattern, path.read_text())]
    assert not found, found
