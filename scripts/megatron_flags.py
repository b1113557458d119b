#!/usr/bin/env python
"""Regenerate ``megazero/config/megatron_flags.txt``: the names of Megatron-LM's command-line flags.

Megatron-LM defines its flags in ``megatron/training/arguments.py`` (and, for ``pretrain_gpt.py`` with
nvidia-modelopt installed, ``megatron/post_training/arguments.py``), partly as literal
``add_argument('--flag', ...)`` calls and partly from dataclasses (``ArgumentGroupFactory(Config,
exclude=[...])``: a field ``foo_bar`` is ``--foo-bar``, a ``bool`` field that defaults to True is
``--no-foo-bar`` / ``--disable-foo-bar``, ``argparse_meta={"arg_names": [...]}`` renames it).  This
script reads those sources with :mod:`ast` (nothing is imported: Megatron-LM's imports need CUDA
packages), so it works from a checkout, a bare clone or an unpacked ``megatron-core`` package::

    python scripts/megatron_flags.py --source ~/Megatron-LM              # a checkout
    python scripts/megatron_flags.py --git-dir Megatron-LM.git --rev main  # a bare clone
    python scripts/megatron_flags.py --source ~/Megatron-LM --check        # compare with the pinned list

Only the flag *names* are written (one per line, sorted), under a header naming the source.
``tests/test_megatron_flags.py`` checks that megazero answers every one of them.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from megazero.errors import EXIT_FAILURE, EXIT_OK  # noqa: E402 - after the path

PINNED = os.path.join(ROOT, "megazero", "config", "megatron_flags.txt")
ARGUMENTS = "megatron/training/arguments.py"
# pretrain_gpt.py adds these ModelOpt flags (extra_args_provider) when nvidia-modelopt is installed;
# Megatron-LM's own scripts pass them (examples/gptoss, examples/post_training/modelopt)
MODELOPT = "megatron/post_training/arguments.py"


class Source:
    """Read-only access to a Megatron-LM tree: a directory or a git revision."""

    def __init__(self, directory: Optional[str] = None, git_dir: Optional[str] = None, rev: str = "HEAD"):
        self.directory, self.git_dir, self.rev = directory, git_dir, rev

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def python_files(self) -> List[str]:
        """Paths (relative, ``/``-separated) of the Python files under ``megatron/``."""
        if self.git_dir:
            names = self._git("ls-tree", "-r", "--name-only", self.rev, "megatron").splitlines()
            return [n for n in names if n.endswith(".py")]
        out = []
        for dirpath, _, files in os.walk(os.path.join(self.directory, "megatron")):
            rel = os.path.relpath(dirpath, self.directory).replace(os.sep, "/")
            out += [f"{rel}/{f}" for f in files if f.endswith(".py")]
        return sorted(out)

    def read(self, path: str) -> str:
        if self.git_dir:
            return self._git("show", f"{self.rev}:{path}")
        with open(os.path.join(self.directory, path), encoding="utf-8") as fh:
            return fh.read()

    def describe(self) -> str:
        if self.git_dir:
            commit = self._git("rev-parse", self.rev).strip()
            date = self._git("show", "-s", "--format=%cs", commit).strip()
            return f"Megatron-LM git {commit[:12]} ({date})"
        return f"Megatron-LM tree {os.path.basename(os.path.abspath(self.directory))}"


def _literal(node) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def literal_flags(tree: ast.AST) -> Set[str]:
    """The ``--`` option strings of every ``*.add_argument('--a', '--b', ...)`` call in ``tree``
    (with ``action=argparse.BooleanOptionalAction`` also ``--no-a``, as argparse adds)."""
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "add_argument":
            names = {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("--")}
            action = _keyword(node, "action")
            if getattr(action, "attr", getattr(action, "id", None)) == "BooleanOptionalAction":
                names |= {"--no-" + n[2:] for n in names}
            out |= names
    return out


def factory_calls(tree: ast.AST) -> List[Tuple[str, Set[str]]]:
    """``(class name, excluded fields)`` of every ``ArgumentGroupFactory(Class, exclude=...)`` call;
    ``exclude`` may be a literal list or a local variable assigned one."""
    lists: Dict[str, Set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _literal(node.value)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                lists[node.targets[0].id] = set(value)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ArgumentGroupFactory" \
                and node.args:
            cls = node.args[0]
            name = cls.id if isinstance(cls, ast.Name) else getattr(cls, "attr", None)
            exclude = _keyword(node, "exclude")
            if isinstance(exclude, ast.Name):
                excluded = lists.get(exclude.id, set())
            else:
                excluded = set(_literal(exclude) or []) if exclude is not None else set()
            out.append((name, excluded))
    return out


def _field_names(stmt: ast.AnnAssign) -> Optional[List[str]]:
    """The flags of one dataclass field (None when it is not an ``__init__`` field)."""
    name, value = stmt.target.id, stmt.value
    default = value
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        if _literal(_keyword(value, "init")) is False:
            return None
        meta = _literal(_keyword(value, "metadata")) if _keyword(value, "metadata") is not None else None
        names = ((meta or {}).get("argparse_meta") or {}).get("arg_names")
        if names:
            return list(names)
        default = _keyword(value, "default")
    is_bool = isinstance(stmt.annotation, ast.Name) and stmt.annotation.id == "bool"
    if is_bool and default is not None and _literal(default) is True:
        return ["--no-" + name.replace("_", "-"), "--disable-" + name.replace("_", "-")]
    return ["--" + name.replace("_", "-")]


def dataclass_flags(classes: Dict[str, ast.ClassDef], name: str, excluded: Set[str]) -> Set[str]:
    """The flags ``ArgumentGroupFactory`` makes of dataclass ``name`` (its bases' fields first)."""
    cls = classes.get(name)
    if cls is None:
        raise SystemExit(f"megatron_flags.py: dataclass {name} not found in the Megatron-LM sources")
    out: Set[str] = set()
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name in classes:
            out |= dataclass_flags(classes, base_name, excluded)
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and stmt.target.id not in excluded and not stmt.target.id.startswith("_"):
            if "ClassVar" in ast.dump(stmt.annotation):
                continue
            names = _field_names(stmt)
            out |= set(names or [])
    return out


def megatron_flags(source: Source, parse: Callable[[str], ast.AST] = ast.parse) -> List[str]:
    """Every flag Megatron-LM's ``add_megatron_arguments`` defines, and the ModelOpt flags its
    ``pretrain_gpt.py`` adds, sorted."""
    arguments = parse(source.read(ARGUMENTS))
    flags = literal_flags(arguments)
    if MODELOPT in source.python_files():
        flags |= literal_flags(parse(source.read(MODELOPT)))
    calls = factory_calls(arguments)
    wanted = {name for name, _ in calls}
    classes: Dict[str, ast.ClassDef] = {}
    for path in source.python_files():
        text = source.read(path)
        if "class " not in text or "@dataclass" not in text:
            continue
        for node in ast.walk(parse(text)):
            if isinstance(node, ast.ClassDef) and (node.name not in classes or node.name in wanted):
                classes.setdefault(node.name, node)
    for name, excluded in calls:
        flags |= dataclass_flags(classes, name, excluded)
    return sorted(f for f in flags if f.startswith("--"))


def write_list(flags: Iterable[str], origin: str, path: str = PINNED) -> None:
    flags = list(flags)
    with open(path, "w") as fh:
        fh.write(f"# Megatron-LM's command-line flags (names only), {len(flags)} of them.\n"
                 f"# Generated by scripts/megatron_flags.py from {origin}; do not edit by hand.\n")
        fh.writelines(f + "\n" for f in flags)


def read_list(path: str = PINNED) -> List[str]:
    """The pinned flag names (header comments skipped)."""
    with open(path) as fh:
        return [line.strip() for line in fh if line.strip() and not line.startswith("#")]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", help="A Megatron-LM checkout (or a directory holding megatron/).")
    where.add_argument("--git-dir", help="A (bare) Megatron-LM git directory; read at --rev.")
    p.add_argument("--rev", default="HEAD", help="Revision to read with --git-dir.")
    p.add_argument("--output", default=PINNED, help="Where to write the list.")
    p.add_argument("--check", action="store_true", help="Only compare with --output; exit 1 if it differs.")
    args = p.parse_args(argv)
    if args.source and not os.path.isfile(os.path.join(args.source, ARGUMENTS)):
        p.error(f"--source {args.source}: no {ARGUMENTS} there; give a Megatron-LM checkout")
    source = Source(args.source, args.git_dir, args.rev)
    flags = megatron_flags(source)
    if args.check:
        pinned = set(read_list(args.output))
        added, removed = sorted(set(flags) - pinned), sorted(pinned - set(flags))
        for sign, names in (("+", added), ("-", removed)):
            for name in names:
                print(f"{sign} {name}")
        print(f"{len(flags)} flags in {source.describe()}; {len(added)} new, {len(removed)} gone")
        return EXIT_FAILURE if added or removed else EXIT_OK
    write_list(flags, source.describe(), args.output)
    print(f"wrote {len(flags)} flags from {source.describe()} to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
