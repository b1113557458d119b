"""The commands in README.md and docs/*.md are written as the programs accept them.

Every fenced ```bash block is read.  For each ``scripts/*.py`` or ``megazero-*`` command, every
``--flag`` it passes must appear in that program's ``--help``.  For each shell script named
(``scripts/*.sh``, ``launch/*.sh``, ``launch/*.sbatch``) the file must exist and parse
(``bash -n``), and each ``--flag`` must be one the script handles itself (it appears in its text)
or, for a script that hands its arguments to ``pretrain_gpt.py``, one ``pretrain_gpt.py --help``
lists; after a ``--`` only the latter.  Nothing is run beyond ``--help`` and ``bash -n``.

Every command that runs ``pretrain_gpt.py`` (directly, as ``megazero-pretrain``, under torchrun or
``scripts/launch.py``, or through a launcher: ``launch/run_local.sh``, ``run_multinode.sh``,
``slurm.sbatch``, ``scripts/demo.sh``) is also validated with ``--dry-run`` at its own world size, so a
changed default cannot break a documented command unseen: the shell launchers run for real under
bash, with ``python`` (and ``srun``, ``scontrol``, ``nvidia-smi``) replaced by stubs that record the
command line they were given, which is then dry-run in this process; files the command reads (data,
tokenizers, a checkpoint to fine-tune) are small stand-ins made in a scratch directory
(:mod:`doc_commands`).

README.md and docs/usage.md are checked in the fast tier; the other pages, whose commands name
the benchmark scripts, and the dry runs (which build stand-ins) are marked slow.
"""
import configparser
import os
import re
import shlex
import subprocess
import sys

import pytest

from doc_commands import CommandError, make_stand_ins, pretrain_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_DOCS = ["README.md", "docs/usage.md"]
OTHER_DOCS = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                    if f.endswith(".md") and os.path.join("docs", f) not in FAST_DOCS)
PRETRAIN = "scripts/pretrain_gpt.py"
# console scripts (setup.cfg) and the checkout's script each one is
CONSOLE = {"megazero-pretrain": PRETRAIN, "megazero-estimate-memory": "scripts/estimate_memory.py",
           "megazero-plan": "scripts/plan.py"}
# their --help lists their own flags and says that the model and layout flags are pretrain_gpt.py's
TAKES_PRETRAIN_FLAGS = {"scripts/estimate_memory.py", "scripts/plan.py"}
SEPARATORS = {"|", "||", "&&", ";", "&"}
PY_SCRIPT = re.compile(r"(?:^|/)(scripts/[\w/]+\.py)$")
SH_SCRIPT = re.compile(r"(?:^|/)((?:scripts|launch)/[\w/.-]+\.(?:sh|sbatch))$")

COMMAND_START = re.compile(r"^(?:[A-Z_]+=\S* )*(?:\.venv/bin/)?(?:python3?|torchrun|bash|sbatch|srun|"
                           r"mkdir|megazero-\S+|(?:\./)?(?:scripts|launch)/\S+) ")

_helps = {}


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def _help_in_process(script):
    """``script --help`` run in this process (torch is imported already, which is most of a fresh
    interpreter's start-up); None when it does not end in ``SystemExit(0)``."""
    import contextlib
    import io
    import runpy
    out, argv, path = io.StringIO(), sys.argv, list(sys.path)
    sys.argv = [os.path.join(ROOT, script), "--help"]
    sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as the interpreter does for a script
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        return out.getvalue() if done.code in (0, None) else None
    except Exception:  # noqa: BLE001 - the subprocess run below reports it
        return None
    finally:
        sys.argv, sys.path[:] = argv, path
    return None


def help_texts(scripts):
    """``--help`` of each script (in this process where it can, else one interpreter per script,
    all at once)."""
    todo = sorted(set(scripts) - set(_helps))
    for s in todo:
        text = _help_in_process(s)
        if text is not None:
            _helps[s] = text
    procs = {s: subprocess.Popen([sys.executable, os.path.join(ROOT, s), "--help"], cwd=ROOT, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for s in todo if s not in _helps}
    for s, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{s} --help exited with {p.returncode}:\n{out[-2000:]}"
        _helps[s] = out
    return {s: _helps[s] for s in scripts}


def bash_blocks(text):
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def fenced_blocks(text):
    """``(language, text)`` of every fenced block, in order (language "" for a plain one)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def command_lines_outside_bash_blocks(text):
    """Lines of other fenced blocks (not python) that start like a command: such a command would
    escape these checks (output lines start otherwise)."""
    found = []
    for lang, block in fenced_blocks(text):
        if lang not in ("bash", "python"):
            found += [line for line in block.splitlines() if COMMAND_START.match(line)]
    return found


def commands(block):
    """Each command of a bash block as a token list (continuations joined, comments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens, current = shlex.split(line, comments=True), []
        for t in tokens + [";"]:
            if t in SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(t)
    return out


def program(tokens):
    """(kind, path, arguments) of the first megazero program in a command, or None."""
    for i, t in enumerate(tokens):
        if t in CONSOLE or t.startswith("megazero-"):
            return "console", t, tokens[i + 1:]
        m = PY_SCRIPT.search(t)
        if m:
            return "python", m.group(1), tokens[i + 1:]
        m = SH_SCRIPT.search(t)
        if m:
            return "shell", m.group(1), tokens[i + 1:]
    return None


def flags(args):
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def has_flag(text, flag):
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def has_option(help_text, flag):
    """Whether ``--help`` declares ``flag`` (at the start of an option line, not only in some text)."""
    return re.search(r"(?m)^  (?:-\S+(?: \S+)*?, )*" + re.escape(flag) + r"(?![\w-])", help_text) is not None


def documented_token_lists(doc):
    """Each command of ``doc``'s bash blocks that names a megazero program, as a token list."""
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    return [tokens for block in bash_blocks(text) for tokens in commands(block) if program(tokens)]


def documented_commands(doc):
    return [(" ".join(tokens), *program(tokens)) for tokens in documented_token_lists(doc)]


def console_scripts():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {line.split("=")[0].strip() for line in lines if line.strip()}


def problems(found):
    """What is wrong with ``found`` (from :func:`documented_commands`): a list of messages."""
    bad = []
    declared = console_scripts()
    scripts = {PRETRAIN}
    for _, kind, path, _ in found:
        if kind == "console" and path in CONSOLE:
            scripts.add(CONSOLE[path])
        elif kind == "python" and os.path.isfile(os.path.join(ROOT, path)):
            scripts.add(path)
    helps = help_texts(scripts)
    for cmd, kind, path, args in found:
        if kind == "console":
            if path not in declared:
                bad.append(f"{cmd}: {path} is not a console script in setup.cfg")
                continue
            if path not in CONSOLE:
                bad.append(f"{cmd}: {path}: add it to CONSOLE in this test")
                continue
            path = CONSOLE[path]
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            bad.append(f"{cmd}: {path} does not exist")
            continue
        if kind == "shell":
            check = subprocess.run(["bash", "-n", full], capture_output=True, text=True)
            if check.returncode != 0:
                bad.append(f"{cmd}: bash -n {path}: {check.stderr.strip()}")
            with open(full) as f:
                own = f.read()
            if "-m pytest" in own:
                continue  # its arguments go to pytest
            forwards = PRETRAIN in own
            split = args.index("--") if "--" in args else len(args)
            for i, arg in enumerate(args):
                if not flags([arg]):
                    continue
                flag = flags([arg])[0]
                own_flag = i < split and has_flag(own, flag)  # after "--" everything is pretrain_gpt.py's
                if not (own_flag or forwards and has_option(helps[PRETRAIN], flag)):
                    bad.append(f"{cmd}: {path} does not take {flag}")
            continue
        text = helps[path] + (helps[PRETRAIN] if path in TAKES_PRETRAIN_FLAGS else "")
        if path in ("scripts/launch.py", "scripts/deepspeed_launch.py"):  # the user's script takes the rest
            args = args[:next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))]
        for flag in flags(args):
            if not has_option(text, flag):
                bad.append(f"{cmd}: {flag} is not in {path} --help")
    return bad


def slug(heading):
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path):
    """A markdown file without its fenced blocks."""
    with open(path) as f:
        return re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)


def test_links_between_the_docs_reach_a_file_and_heading():
    bad = []
    for doc in FAST_DOCS + OTHER_DOCS:
        text = prose(os.path.join(ROOT, doc))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else \
                os.path.join(ROOT, doc)
            if not os.path.exists(full):
                bad.append(f"{doc}: {target}: no such file")
            elif anchor:
                headings = {slug(h) for h in re.findall(r"^#+ (.*)$", prose(full), re.M)}
                if anchor not in headings:
                    bad.append(f"{doc}: {target}: no such heading")
    assert bad == []


def test_commands_are_in_bash_blocks_where_they_are_checked():
    bad = {}
    for doc in FAST_DOCS + OTHER_DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            lines = command_lines_outside_bash_blocks(f.read())
        if lines:
            bad[doc] = lines
    assert bad == {}
    block = "```\npython scripts/plan.py --gpus 8\n[rank0]: done\n```\n"
    assert command_lines_outside_bash_blocks(block) == ["python scripts/plan.py --gpus 8"]


@pytest.mark.parametrize("doc", FAST_DOCS)
def test_commands_in_the_readme_and_usage_guide_match_the_programs(doc):
    found = documented_commands(doc)
    assert found, f"no commands found in {doc}"
    assert problems(found) == []


@pytest.mark.slow
@pytest.mark.parametrize("doc", OTHER_DOCS)
def test_commands_in_the_other_docs_match_the_programs(doc):
    assert problems(documented_commands(doc)) == []


def test_the_check_reads_the_readme_and_catches_a_wrong_flag():
    found = {path for _, _, path, _ in documented_commands("README.md")}
    assert {"scripts/demo.sh", "scripts/test.sh", PRETRAIN, "launch/run_local.sh"} <= found
    block = ("python scripts/generate.py --load ckpt --no-such-flag 1   # comment --ignored\n"
             "NPROC=2 launch/run_local.sh --max-restarts 1 -- --max-restarts 2 \\\n    --mock-data\n"
             "bash scripts/no_such_script.sh\n"
             "python scripts/launch.py --standalone --no-such 2 train.py --deepspeed\n")
    found = [(" ".join(t), *program(t)) for t in commands(block)]
    assert problems(found) == [
        "python scripts/generate.py --load ckpt --no-such-flag 1: --no-such-flag is not in "
        "scripts/generate.py --help",
        "NPROC=2 launch/run_local.sh --max-restarts 1 -- --max-restarts 2 --mock-data: "
        "launch/run_local.sh does not take --max-restarts",
        "bash scripts/no_such_script.sh: scripts/no_such_script.sh does not exist",
        # a launcher's flags stop at the user's script, whose own (--deepspeed) are not the launcher's
        "python scripts/launch.py --standalone --no-such 2 train.py --deepspeed: --no-such is not in "
        "scripts/launch.py --help",
    ]


def dry_run_problems(token_lists, scratch, monkeypatch, capsys):
    """Dry-run every pretrain_gpt.py run of the commands at its world size, in ``scratch`` (stand-ins
    for the files they read made there); returns (the runs checked, what failed)."""
    from models.cli import pretrain_main
    checked, bad = [], []
    monkeypatch.chdir(scratch)
    for tokens in token_lists:
        what = " ".join(tokens)
        try:
            runs = pretrain_runs(tokens, str(scratch))
        except CommandError as err:
            bad.append(str(err))
            continue
        for world, args in runs:
            make_stand_ins(args)
            monkeypatch.setenv("WORLD_SIZE", str(world))
            code = pretrain_main(args + ["--dry-run"])
            out = capsys.readouterr()
            checked.append((world, what))
            if code != 0 or f"valid for {world} ranks" not in out.out:
                said = (out.out + out.err).strip()
                bad.append(f"{what}: at {world} ranks, --dry-run exited {code}: {said}")
    return checked, bad


@pytest.mark.slow
def test_every_documented_training_command_passes_a_dry_run_at_its_world_size(tmp_path, monkeypatch, capsys):
    lists = [(doc, tokens) for doc in FAST_DOCS + OTHER_DOCS for tokens in documented_token_lists(doc)]
    checked, bad = dry_run_problems([t for _, t in lists], tmp_path, monkeypatch, capsys)
    assert bad == []
    # the check found the commands that start training, each at its own world size
    anchors = [(8, "bash scripts/demo.sh"), (8, "torchrun --nproc-per-node 8 scripts/pretrain_gpt.py"),
               (1, ".venv/bin/python scripts/pretrain_gpt.py"), (8, "NPROC=8 launch/run_local.sh"),
               (64, "WORLD_SIZE=64 python scripts/pretrain_gpt.py"), (16, "sbatch launch/slurm.sbatch"),
               (32, "launch/run_multinode.sh --nnodes 4"), (2, "MEGAZERO_FAULT=sigkill@1:6 NPROC=2 launch")]
    for world, start in anchors:
        assert any(w == world and what.startswith(start) for w, what in checked), (world, start, checked)
    assert len(checked) >= 19


@pytest.mark.slow
def test_the_dry_run_check_finds_world_sizes_and_catches_bad_commands(tmp_path, monkeypatch, capsys):
    block = ("torchrun --nnodes 2:4 --nproc_per_node=4 scripts/pretrain_gpt.py --model tiny --mock-data\n"
             "NPROC=3 launch/run_local.sh --model tiny --mock-data --tensor-model-parallel-size 2\n"
             "sbatch --nodes 4 --gpus-per-node 2 launch/slurm.sbatch --model tiny --mock-data\n"
             "WORLD_SIZE=2 megazero-pretrain --model tiny --mock-data --context-parallel-size 2\n"
             "bash scripts/test.sh -k nothing   # runs no training: not started here\n")
    checked, bad = dry_run_problems(commands(block), tmp_path, monkeypatch, capsys)
    assert [w for w, _ in checked] == [8, 16, 3, 8, 2]
    assert len(bad) == 2
    assert bad[0].startswith("NPROC=3 launch/run_local.sh --model tiny --mock-data "
                             "--tensor-model-parallel-size 2: at 3 ranks, --dry-run exited 2: ")
    assert "--tensor-model-parallel-size" in bad[0].split("exited 2: ")[1]
    assert bad[1].startswith("WORLD_SIZE=2 megazero-pretrain") and "--attention-dropout 0.1" in bad[1]


def where_things_live():
    """docs/design.md's "Where things live" block: {package path: the text about it}; "" is the top of
    megazero/ (files directly in it) and models/ the top of models/."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read()
    block = re.search(r"^## Where things live\n\n```\n(.*?)^```", text, re.S | re.M).group(1)
    sections, top, current = {}, None, None
    for line in block.splitlines():
        if re.match(r"^\S+/", line):
            top = line.split()[0]
            current = top
        elif re.match(r"^  \S+/ ", line):
            current = top + line.split()[0]
        sections[current] = sections.get(current, "") + line + "\n"
    return sections


def test_design_names_every_module_where_it_lives():
    sections = where_things_live()
    files = subprocess.run(["git", "ls-files", "megazero", "models"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    missing = []
    for path in files:
        if not path.endswith((".py", ".txt")) or path.endswith("__init__.py"):
            continue
        package, name = path.rsplit("/", 1)
        parent, _, sub = package.rpartition("/")  # a sub-package may be named under its parent: sub/name
        if not (has_flag(sections.get(package + "/", ""), name)
                or has_flag(sections.get(parent + "/", ""), f"{sub}/{name}")):
            missing.append(path)
    assert files and missing == [], f"docs/design.md's 'Where things live' does not name {missing}"


@pytest.mark.slow
def test_the_plans_quoted_in_planning_md_are_what_plan_py_prints():
    """Each bash block of plan.py commands followed by quoted output (plain blocks that begin
    'N layouts fit' or 'nothing fits', one per command) is what those commands print today."""
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        blocks = fenced_blocks(f.read())
    checked = 0
    for i, (lang, text) in enumerate(blocks):
        cmds = commands(text)
        if lang != "bash" or not cmds or any(c[:2] != ["python", "scripts/plan.py"] for c in cmds):
            continue
        quoted = "\n".join(t for lg, t in blocks[i + 1:i + 1 + len(cmds)] if lg == "").rstrip("\n")
        heads = [t for t in quoted.split("\n") if " layouts fit " in t or t.startswith("nothing fits")]
        if len(heads) != len(cmds):
            continue  # a command block whose output is not quoted verbatim
        printed = [subprocess.run([sys.executable, *c[1:]], capture_output=True, text=True, cwd=ROOT,
                                  timeout=300).stdout.rstrip("\n") for c in cmds]
        assert "\n\n".join(printed) == quoted, " ".join(cmds[0])
        checked += len(cmds)
    assert checked >= 4
