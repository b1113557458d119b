"""No code runs from a file megazero reads (issue 42, item 1).

* a code walk (``ast``: comments and strings do not count) over megazero/, models/ and scripts/ finds
  no ``eval``/``exec``, no ``pickle``/``marshal`` load, no ``torch.load`` without
  ``weights_only=True``, no ``yaml.load`` without ``SafeLoader`` and no ``numpy.load`` with pickles;
* an engine checkpoint whose ``metadata.json`` carries a pickle that would create a file (its
  checksum recomputed, as an attacker would) is refused with one line naming the file and the key,
  and the file is never created (``load_checkpoint`` and ``zero_to_fp32``);
* ``--moe-layer-freq`` is read by a bounded grammar: ``[1]*9**9**9`` is refused at once, Megatron-LM's
  forms give the lists ``eval`` gave;
* :func:`megazero.process.local_ranks.run_ranks` reads its ranks' results with ``weights_only=True``.
"""
import ast
import base64
import glob
import io
import json
import os
import re
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first torch optimizer imports it, ~2 s: paid at collection)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("megazero", "models", "scripts")
SUSPECT = re.compile(r"\beval\b|\bexec\b|\bloads?\b|pickle|marshal|yaml")


# ---- the code walk --------------------------------------------------------------------------------
def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _call_finding(call: ast.Call, imported: dict):
    """Why this call may run code from data, or None."""
    name = _dotted(call.func)
    name = imported.get(name.split(".")[0], name.split(".")[0]) + name[len(name.split(".")[0]):]
    if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
        return f"{name}("
    if name.split(".")[0] in ("pickle", "_pickle", "cPickle", "dill", "marshal") and \
            name.split(".")[-1] in ("load", "loads", "Unpickler"):
        return f"{name}("
    if name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        return "torch.load without weights_only=True"
    loader = _keyword(call, "Loader")
    if name in ("yaml.unsafe_load", "yaml.full_load") or (
            name == "yaml.load" and (loader is None or "SafeLoader" not in ast.unparse(loader))):
        return f"{name} without SafeLoader"
    if name in ("numpy.load", "np.load") and _is_true(_keyword(call, "allow_pickle")):
        return "numpy.load(allow_pickle=True)"
    return None


def findings(root: str):
    """``path:line: what`` for every call in the Python sources under ``root`` that may run code."""
    out = []
    for top in SOURCES:
        for path in sorted(glob.glob(os.path.join(root, top, "**", "*.py"), recursive=True)):
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            if not SUSPECT.search(text):  # each form _call_finding flags needs one of these words
                continue
            tree = ast.parse(text, filename=path)
            imported, calls = {}, []  # local name -> dotted origin (``import numpy as np``)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    calls.append(node)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    imported.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
                elif isinstance(node, ast.Import):
                    imported.update({a.asname or a.name: a.name for a in node.names})
            for node in calls:
                what = _call_finding(node, imported)
                if what:
                    out.append(f"{os.path.relpath(path, root)}:{node.lineno}: {what}")
    return out


def test_no_source_calls_eval_exec_pickle_or_an_unsafe_load():
    assert findings(ROOT) == []


def test_the_walk_finds_each_form(tmp_path):
    pkg = tmp_path / "megazero"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "import pickle, marshal, yaml, torch\nimport numpy as np\nfrom pickle import loads as l\n"
        "# eval(x) in a comment and 'exec(y)' in a string do not count\n"
        "eval('1')\nexec('x = 1')\npickle.load(f)\nl(b)\nmarshal.loads(b)\ntorch.load(p)\n"
        "torch.load(p, weights_only=False)\nyaml.load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
        "np.load(p, allow_pickle=True)\ntorch.load(p, weights_only=True)\nmodel.eval()\n")
    got = [line.split(": ", 1)[1] for line in findings(str(tmp_path))]
    assert got == ["eval(", "exec(", "pickle.load(", "pickle.loads(", "marshal.loads(",
                   "torch.load without weights_only=True", "torch.load without weights_only=True",
                   "yaml.load without SafeLoader", "numpy.load(allow_pickle=True)"], got


# ---- a planted pickle in an engine checkpoint ---------------------------------------------------------
class Planted:
    """Unpickled, it would create ``path`` (``open(path, "w")``): the proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x):
        return self.a(x).pow(2).mean()


def _engine():
    import megazero
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    return megazero.initialize(model=Net(), config=config)[0]


def _saved(directory):
    engine = _engine()
    engine.backward(engine(torch.ones(2, 4)))
    engine.step()
    engine.save_checkpoint(directory, client_state={"ids": torch.arange(3)})
    (meta,) = glob.glob(os.path.join(directory, "global_step1", "*", "metadata.json"))
    return meta


def _plant(meta_path, key, sentinel):
    from megazero.checkpoint.integrity import seal
    buf = io.BytesIO()
    torch.save({"x": Planted(sentinel)}, buf)
    with open(meta_path) as fh:
        meta = json.load(fh)
    meta["extra"]["engine"][key] = {"torch": base64.b64encode(buf.getvalue()).decode("ascii")}
    with open(meta_path, "w") as fh:
        json.dump(seal(meta), fh)  # the checksum an attacker recomputes


@pytest.mark.parametrize("key", ["client_state", "lr_scheduler", "buffers"])
def test_a_planted_pickle_in_engine_metadata_is_refused_and_never_runs(tmp_path, key):
    from megazero.checkpoint.errors import CheckpointError
    from megazero.engine import get_fp32_state_dict_from_zero_checkpoint
    d, sentinel = str(tmp_path / "ckpt"), str(tmp_path / "pwned")
    meta = _saved(d)
    _plant(meta, key, sentinel)
    engine = _engine()
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(d)
    msg = str(err.value)
    assert f"{meta}: {key} is refused" in msg and "io.open" in msg and "\n" not in msg, msg
    assert not os.path.exists(sentinel)
    if key == "buffers":  # zero_to_fp32 reads the buffers too
        with pytest.raises(CheckpointError, match="buffers is refused"):
            get_fp32_state_dict_from_zero_checkpoint(d)
        assert not os.path.exists(sentinel)


def test_plain_client_state_round_trips_and_other_objects_are_refused_at_save(tmp_path):
    from megazero.errors import ConfigError
    d = str(tmp_path / "ckpt")
    _saved(d)
    _, client = _engine().load_checkpoint(d)
    assert torch.equal(client["ids"], torch.arange(3))
    with pytest.raises(ConfigError, match=r"client_state holds a .*Planted; a checkpoint holds tensors"):
        _engine().save_checkpoint(str(tmp_path / "other"),
                                  client_state={"p": Planted("x"), "t": torch.ones(1)})


def test_a_latest_file_naming_a_path_outside_is_refused(tmp_path):
    from megazero.engine import get_fp32_state_dict_from_zero_checkpoint
    from megazero.errors import ConfigError
    d = str(tmp_path / "ckpt")
    _saved(d)
    with open(os.path.join(d, "latest"), "w") as fh:
        fh.write("../ckpt/global_step1")
    latest = os.path.join(d, "latest")
    needle = re.escape(f"'../ckpt/global_step1' (read from {latest}) must be a plain directory name")
    with pytest.raises(ConfigError, match=needle):
        _engine().load_checkpoint(d)
    with pytest.raises(ConfigError, match=needle):
        get_fp32_state_dict_from_zero_checkpoint(d)


# ---- --moe-layer-freq ------------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("[1,0,1]", [1, 0, 1]), ("[1]*3+[0]*1", [1, 1, 1, 0]), ("([0]*1+[1]*1)*2", [0, 1, 0, 1]),
    ("(([1]*2+[0])*2)", [1, 1, 0, 1, 1, 0]), ("2*[0,1]", [0, 1, 0, 1]), (" [ 1 , 0, ] ", [1, 0]),
    ("[1]*(1+2)", [1, 1, 1]), ("[]", []),
])
def test_moe_layer_freq_forms_parse_as_python_did(text, want):
    from megazero.moe.list_expression import parse_list_expression
    from megazero.moe.settings import moe_layer_pattern
    assert parse_list_expression(text) == want
    if want:
        assert moe_layer_pattern(text, len(want)) == [bool(v) for v in want]


@pytest.mark.parametrize("text,needle", [
    ("[1]*9**9**9", "unexpected '*'"), ("[1]*99999*99999", "longer than 100000"),
    ("(" * 100 + "[1]" + ")" * 100, "nest deeper than 64"), ("[1]*100000" + "*1" * 20, "built in all"),
    ("9" * 5000, "5000 digits"), ("[1]+1", "not a list and an integer"), ("(1,0)", "expected )"),
])
def test_moe_layer_freq_payloads_are_refused_at_once(text, needle):
    from megazero.moe.settings import moe_layer_pattern
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"--moe-layer-freq") as err:
        moe_layer_pattern(text, 4)
    assert time.perf_counter() - start < 1.0
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_moe_layer_freq_payload_ends_a_dry_run_with_one_line(capsys):
    from models.cli import pretrain_main
    argv = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--disable-bias-linear", "--num-experts", "8", "--moe-layer-freq", "[1]*9**9**9", "--dry-run"]
    start = time.process_time()  # CPU time: the check holds on a busy machine too (eval spun for minutes)
    assert pretrain_main(argv) == 2
    assert time.process_time() - start < 1.0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--moe-layer-freq '[1]*9**9**9'" in err[0], err


# ---- run_ranks' results ------------------------------------------------------------------------------
def _plain_result():
    return {"t": torch.ones(2), "l": [1, 2.5, "s", None, (True,)], "dtype": torch.float16, "r": range(3)}


def _planted_result(sentinel):
    return {"x": Planted(sentinel)}


def test_run_ranks_reads_plain_results_and_refuses_others(tmp_path):
    from megazero.process.local_ranks import RankError, run_ranks
    (got,) = run_ranks(_plain_result, 1)
    assert torch.equal(got["t"], torch.ones(2)) and got["l"] == [1, 2.5, "s", None, (True,)]
    assert got["dtype"] is torch.float16 and got["r"] == range(3)
    sentinel = str(tmp_path / "pwned")
    with pytest.raises(RankError, match="return value holds io.open"):
        run_ranks(_planted_result, 1, sentinel)
    assert not os.path.exists(sentinel)
