"""What rank 0 says before training: Megatron-LM's defaults and the settings it requires, the
parameters, the settings (also written to --save), the data and its epochs, the tokenizer; a data path
without a tokenizer is an error naming --vocab-size."""
import json

import numpy as np
import pytest

from megazero.config import ConfigError, parse_args
from megazero.training.summary import (data_lines, parameter_line, provider_stage_counts, settings_line,
                                       stage_counts, startup_summary, tokenizer_line)


def test_defaults_are_megatrons():
    cfg = parse_args(["--mock-data"], world_size=1)
    m, opt, tr = cfg.model, cfg.optimizer, cfg.training
    assert (m.hidden_dropout, m.attention_dropout, m.activation) == (0.1, 0.1, "gelu_exact")
    assert (opt.lr_decay_style, opt.sgd_momentum, opt.weight_decay) == ("linear", 0.9, 0.01)
    assert (tr.eval_iters, cfg.logging.log_interval, m.init_method_std) == (100, 100, 0.02)
    swiglu = parse_args(["--mock-data", "--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32"],
                        world_size=1)
    assert swiglu.model.ffn_hidden_size == int(4 * 4096 * 2 / 3 / 64) * 64 == 10880  # Megatron-LM's rule


def test_settings_megatron_requires_are_named_when_left_to_megazero():
    notes = parse_args(["--mock-data"], world_size=1).notes
    (note,) = [n for n in notes if n.startswith("Megatron-LM requires")]
    for flag in ("--num-layers 2", "--hidden-size 64", "--lr 0.001", "--micro-batch-size 2",
                 "--train-iters 10"):
        assert flag in note, flag
    given = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--train-samples", "20"]
    assert not [n for n in parse_args(given, world_size=1).notes if n.startswith("Megatron-LM requires")]
    from models.presets import PRESETS
    preset = parse_args(["--mock-data", "--model", "gpt2-small", "--lr", "1e-4", "--micro-batch-size", "1",
                         "--train-iters", "1"], presets=PRESETS, world_size=1)
    assert not [n for n in preset.notes if n.startswith("Megatron-LM requires")]


def _dataset(tmp_path, docs=20, length=50, vocab=300):
    from megazero.data.indexed import IndexedDatasetWriter
    prefix = str(tmp_path / "corpus_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as w:
        for _ in range(docs):
            w.add_document(rng.integers(0, vocab, length))
    return prefix


def test_data_path_without_a_tokenizer_names_vocab_size(tmp_path):
    prefix = _dataset(tmp_path)
    with pytest.raises(ConfigError, match="--data-path without a tokenizer.*--vocab-size N"):
        parse_args(["--data-path", prefix], world_size=1)
    cfg = parse_args(["--data-path", prefix, "--vocab-size", "300"], world_size=1)
    assert any(n.startswith("WARNING: --data-path without a tokenizer") and "--vocab-size 300" in n
               for n in cfg.notes)
    null = parse_args(["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
                      world_size=1)
    assert not any("without a tokenizer" in n for n in null.notes)


def test_summary_counts_parameters_data_and_epochs(tmp_path):
    import models
    from megazero.data import build_data
    from megazero.mesh import ParallelMesh
    prefix = _dataset(tmp_path, docs=20, length=50)  # 1000 tokens; split 90,10,0: 18 train documents
    cfg = parse_args(["--data-path", prefix, "--vocab-size", "300", "--split", "90,10,0", "--seq-length",
                      "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "30",
                      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--save", str(tmp_path / "run")], world_size=1)
    (model,) = models.build_chunks(cfg, ParallelMesh.single())
    held = sum(p.numel() for p in model.parameters())  # the padded vocabulary, as this rank holds it
    counted = stage_counts([model], ParallelMesh.single())
    assert counted == [held] == provider_stage_counts(cfg, models.build_chunks)
    assert f"stage 0: {held / 1e3:.4g}K" in parameter_line(cfg, [held])
    data = build_data(cfg)
    (head, line) = data_lines(cfg, data)
    per_epoch = (18 * 50 - 1) // 16  # samples of seq + 1 tokens in the 900 training tokens
    assert "30 iterations take 120 samples" in head and "20 documents" in line
    assert f"{per_epoch} samples per epoch" in line and f"{120 / per_epoch:.3g} epochs" in line
    assert tokenizer_line(cfg).startswith("tokenizer: none; ids are below --vocab-size 300")
    lines = startup_summary(cfg, data, [held])
    written = json.load(open(tmp_path / "run" / "megazero_config.json"))
    assert written["model"]["num_layers"] == 2 and written["data"]["data_path"] == [prefix]
    assert "--seq-length 16" in settings_line(cfg, None) and "megazero_config.json" in lines[1]


def _stage_counts_pp2():
    import models
    from megazero.mesh import ParallelMesh
    cfg = parse_args(["--mock-data", "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads",
                      "4", "--seq-length", "16", "--vocab-size", "300", "--global-batch-size", "4",
                      "--train-iters", "1", "--pipeline-model-parallel-size", "2",
                      "--decoder-first-pipeline-num-layers", "2"], world_size=2)
    mesh = ParallelMesh.build(1, 2)
    return stage_counts(models.build_chunks(cfg, mesh), mesh), provider_stage_counts(cfg, models.build_chunks)


def test_stage_counts_gather_every_stage_from_the_built_model():
    """Each rank counts its own chunks; the pipeline group hands every rank all stages' counts, equal
    to the stages built on the meta device (3 layers: 2 and the embedding, 1 and the head)."""
    from megazero.process.local_ranks import run_ranks
    (a, built), (b, _) = run_ranks(_stage_counts_pp2, 2)
    assert a == b == built and a[0] != a[1]
