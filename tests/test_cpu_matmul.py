"""--cpu-matmul auto: the decision from a measurement of the model's own products, cached per machine.

A fake timer stands in for the clock, so the decision logic is checked on any CPU: the costs it
reports are those of an AVX-512 CPU (oneDNN faster), of an AVX2 one (oneDNN slower on the wide
products, faster on the others) and of a tie.
"""
import json

import pytest
import torch

import megazero.tensor_parallel.cpu_matmul as cm
import megazero.tensor_parallel.layers as tp_layers
from megazero.config import config_from_dict, validate
from megazero.tensor_parallel.cpu_matmul import MARGIN, Product, choose_onednn, linear_products, measure


def _costs(onednn_factor):
    """A fake timer: seconds proportional to the multiply-adds actually run (read from the result's
    rows, so the row budget's scaling is checked too), oneDNN's scaled by ``onednn_factor(product,
    direction)``."""
    seen = []

    def timer(library, product, direction, fn):
        rows = fn().shape[0]
        seen.append((library, product, direction, rows))
        factor = onednn_factor(product, direction) if library == "onednn" else 1.0
        return 1e-9 * rows * product.out * product.inp * factor
    return timer, seen


def _never(*args):
    raise AssertionError("measured although the answer was known")


SMALL = [Product(64, 96, 32, 3), Product(64, 384, 32, 1)]  # wide: 384 outputs


@pytest.fixture
def small_products(monkeypatch):
    monkeypatch.setattr(tp_layers, "ONEDNN_MIN_MACS", 0)
    monkeypatch.setattr(cm, "ROW_BUDGET_MACS", 16 * 96 * 32)  # 16 of the 64 rows: scaled back up
    monkeypatch.setattr(cm, "MIN_ROWS", 8)
    return SMALL


@pytest.mark.parametrize("name,factor,expected", [
    ("avx512: oneDNN faster everywhere", lambda p, d: 0.8, True),
    ("avx2: oneDNN 1.35x slower on the wide product, which dominates",
     lambda p, d: 1.35 if p.out > 96 else 0.9, False),
    ("avx2: slower on the input gradient only, faster overall",
     lambda p, d: 1.1 if d == "input grad" else 0.8, True),
    ("a tie within the margin keeps PyTorch's BLAS", lambda p, d: 1.0 - MARGIN / 2, False),
])
def test_the_decision_follows_the_measured_totals(small_products, tmp_path, name, factor, expected):
    timer, seen = _costs(factor)
    assert choose_onednn(small_products, timer, str(tmp_path / "c.json")) is expected, name
    # both libraries, both directions, every product; a warm-up round and REPS timed ones
    assert len(seen) == 2 * 2 * len(small_products) * (cm.REPS + 1)


def test_measure_scales_each_product_to_its_rows_and_count(small_products):
    timer, seen = _costs(lambda p, d: 0.5 if d == "forward" else 0.25)
    detail = {}
    seconds = measure(small_products, timer, detail=detail)
    # 16 rows fit the budget for the narrow product; the wide one would get 4, raised to MIN_ROWS
    assert {(p.out, rows) for _, p, _, rows in seen} == {(96, 16), (384, 8)}
    torch_s = sum(2 * 1e-9 * p.macs * p.count for p in small_products)  # forward + input gradient
    assert seconds["torch"] == pytest.approx(torch_s, rel=1e-12)
    assert seconds["onednn"] == pytest.approx(torch_s * (0.5 + 0.25) / 2, rel=1e-12)
    assert detail["torch", "forward"] == pytest.approx(torch_s / 2, rel=1e-12)
    assert detail["onednn", "input grad"] == pytest.approx(torch_s / 2 * 0.25, rel=1e-12)


def test_the_answer_is_cached_per_machine_torch_build_and_shapes(small_products, tmp_path, monkeypatch):
    path = str(tmp_path / "c.json")
    timer, seen = _costs(lambda p, d: 1.2)
    assert choose_onednn(small_products, timer, path) is False
    assert choose_onednn(small_products, _never, path) is False  # cached: no second measurement
    (entry,) = json.load(open(path)).values()
    assert entry["onednn"] is False and entry["onednn_s"] > entry["torch_s"] > 0
    fast, _ = _costs(lambda p, d: 0.5)
    assert choose_onednn(small_products[:1], fast, path) is True  # other shapes: measured
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another instruction set: measured again
    assert choose_onednn(small_products, fast, path) is True
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch, "__version__", "0.0-other")  # another torch build: measured again
    assert choose_onednn(small_products, fast, path) is True
    assert len(json.load(open(path))) == 4


def test_a_broken_cache_file_is_measured_over(small_products, tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    timer, _ = _costs(lambda p, d: 0.5)
    assert choose_onednn(small_products, timer, str(path)) is True
    assert len(json.loads(path.read_text())) == 1


def test_products_below_the_threshold_are_not_measured(tmp_path):
    tiny = [Product(16, 32, 32, 4)]  # far below ONEDNN_MIN_MACS: oneDNN never runs them
    assert choose_onednn(tiny, _never, str(tmp_path / "c.json")) is True
    assert not (tmp_path / "c.json").exists()


def test_resolve_measures_only_for_auto_where_onednn_exists(small_products, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAZERO_CACHE_DIR", str(tmp_path))
    assert cm.resolve_cpu_matmul("torch", small_products, _never) is False
    if tp_layers.onednn_linear_available():
        assert cm.resolve_cpu_matmul("onednn", small_products, _never) is True
        slow, _ = _costs(lambda p, d: 1.3)
        assert cm.resolve_cpu_matmul("auto", small_products, slow) is False
        assert (tmp_path / cm.CACHE_FILE).exists()
    monkeypatch.setattr(tp_layers, "onednn_linear_available", lambda: False)
    assert cm.resolve_cpu_matmul("auto", small_products, _never) is False
    with pytest.raises(ValueError, match="--cpu-matmul onednn"):
        cm.resolve_cpu_matmul("onednn", small_products, _never)


def test_a_real_measurement_runs_and_is_cached(small_products, tmp_path):
    """The wall clock on real products (tiny: the answer is whatever this CPU says, cached)."""
    if not tp_layers.onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch build")
    path = str(tmp_path / "c.json")
    first = choose_onednn(small_products, path=path)
    assert choose_onednn(small_products, _never, path) is first


def test_linear_products_are_the_models_shapes():
    cfg = validate(config_from_dict(dict(num_layers=4, hidden_size=64, num_attention_heads=4,
                                         num_query_groups=2, ffn_hidden_size=96, activation="swiglu",
                                         seq_length=32, micro_batch_size=2, vocab_size=200,
                                         pipeline_model_parallel_size=2)), 4, check_data=False)
    tp = 2
    got = {(p.out, p.inp): (p.rows, p.count) for p in linear_products(cfg, tp)}
    rows, layers = 2 * 32, 2  # a micro-batch; the layers of one of 2 stages
    assert got == {((4 + 2 * 2) * 16 // tp, 64): (rows, layers),  # qkv: 4 query heads, 2 groups of 16
                   (64, 64 // tp): (rows, layers),  # attention projection
                   (96 // tp, 64): (rows, 2 * layers),  # gate and fc1
                   (64, 96 // tp): (rows, layers),  # fc2
                   (cfg.model.padded_vocab_size // tp, 64): (rows, 1)}  # the output head
    assert linear_products(validate(config_from_dict(dict(bf16=True)), 1, check_data=False), 1) == []
