"""The any-model engine's parts that need no model library: the ds_config read into megazero's config
(supported keys, "auto", DeepSpeed's batch rule, every unsupported key named in one line), DeepSpeed's
learning-rate schedules, the optimizer settings taken from torch optimizers and parameter groups,
ZeRO-3's units for any module, and zero.Init in one process."""
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megazero.engine.auto import resolve_auto
from megazero.engine.config import read_config
from megazero.engine.optim import read_optimizer
from megazero.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from megazero.engine.units import module_blocks, register_external_parameter
from megazero.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _read(extra=None, dp=2, **kw):
    return read_config({**BASE, **(extra or {})}, dp, **kw)


# ---- the keys --------------------------------------------------------------------------------
def test_supported_keys_land_in_megazeros_sections():
    c = _read({"gradient_accumulation_steps": 3, "gradient_clipping": 0.5, "steps_per_print": 7,
               "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
                        "hysteresis": 3, "min_loss_scale": 0.25},
               "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 5e5,
                                     "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 9000,
                                     "stage3_param_persistence_threshold": 10,
                                     "stage3_gather_16bit_weights_on_model_save": True,
                                     "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    m = c.megazero
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (12, 2, 3)
    assert (m.training.global_batch_size, m.training.num_micro_batches) == (12, 3)
    assert m.optimizer.clip_grad == 0.5 and c.steps_per_print == 7
    p = m.precision
    assert p.fp16 and not p.bf16 and p.loss_scale is None  # 0: dynamic
    assert (p.initial_loss_scale, p.loss_scale_window, p.hysteresis) == (4096.0, 50, 3)
    assert p.min_loss_scale == 0.25
    par = m.parallel
    assert (par.zero_stage, par.overlap_grad_reduce, par.ddp_bucket_size) == (3, False, 500000)
    assert (par.offload_optimizer_device, par.optimizer_offload_fraction) == ("cpu", 0.5)
    assert (c.prefetch_numel, c.max_live_numel, c.persistence_threshold) == (1000, 9000, 10)
    assert c.gather_16bit_on_save and c.optimizer == ("adam", {"lr": 1e-3, "betas": [0.9, 0.999],
                                                               "eps": 1e-8, "weight_decay": 0.0})


def test_deepspeeds_defaults_and_constant_loss_scale():
    c = _read({"fp16": {"enabled": True, "loss_scale": 128}})
    assert c.megazero.precision.loss_scale == 128.0 and c.megazero.precision.initial_loss_scale == 2.0 ** 16
    assert c.megazero.parallel.zero_stage == 0 and c.steps_per_print == 10
    assert c.megazero.optimizer.clip_grad == 1.0  # DeepSpeed's default (0.19.8: runtime/constants.py)
    assert _read({"zero_optimization": {"stage": 3}}).megazero.parallel.overlap_grad_reduce  # stage 3: True


def test_accepted_keys_without_effect_are_named_in_the_notes():
    c = _read({"zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": 2, "contiguous_gradients": False, "reduce_scatter": False,
                                     "allgather_bucket_size": 10, "reduce_bucket_size": 20}})
    notes = "\n".join(c.notes)
    for key in ("zero_allow_untested_optimizer", "contiguous_gradients", "reduce_scatter",
                "allgather_bucket_size"):
        assert key in notes
    assert c.megazero.parallel.ddp_bucket_size == 20


@pytest.mark.parametrize("extra, needle", [
    ({"train_batch_sise": 8}, "unknown key 'train_batch_sise'"),
    ({"zero_optimization": {"stage": 2, "cpu_offlaod": True}}, "unknown key 'zero_optimization.cpu_offlaod'"),
    ({"fp16": {"enabled": True, "fp16_scale": 1}}, "unknown key 'fp16.fp16_scale'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be one of 0, 1, 2, 3, got 4"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast = True is not supported"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type 'Lamb' is not supported"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad = True"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}},
     "adam_w_mode false"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type 'OneCycle' is not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps is required for WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
     "unknown key 'scheduler.params.warmup_steps'"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     "offload_param.device = nvme needs zero_optimization.stage 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device is nvme but zero_optimization.offload_optimizer.nvme_path is not given"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "needs zero_optimization.stage 1"),
    ({"gradient_clipping": -1}, "gradient_clipping must be a finite number >= 0"),
    ({"train_batch_size": 7}, "train_batch_size 7 must equal train_micro_batch_size_per_gpu 2 x"),
    ({"steps_per_print": "often"}, "steps_per_print must be an integer >= 1"),
])
def test_an_unsupported_key_or_value_is_named_in_one_line(extra, needle):
    with pytest.raises(ConfigError) as err:
        _read(extra)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_batch_rule_any_two_give_the_third():
    def batch(**keys):
        c = read_config({"optimizer": BASE["optimizer"], **keys}, 4)
        return c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps
    assert batch(train_batch_size=32, train_micro_batch_size_per_gpu=2) == (32, 2, 4)
    assert batch(train_batch_size=32, gradient_accumulation_steps=2) == (32, 4, 2)
    assert batch(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2) == (24, 3, 2)
    assert batch(train_batch_size=8) == (8, 2, 1)
    assert batch(train_micro_batch_size_per_gpu=5) == (20, 5, 1)
    with pytest.raises(ConfigError, match="needs train_batch_size or train_micro_batch_size_per_gpu"):
        batch(gradient_accumulation_steps=2)


def test_auto_is_resolved_as_the_hugging_face_integration_does():
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.7,
                           learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6,
                           weight_decay=0.05, fp16=False, bf16=True, max_steps=100, warmup_steps=0)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=32))
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupDecayLR",
                         "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    c = read_config(raw, 2, args=args, model=model)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (16, 4, 2)
    assert c.megazero.precision.bf16 and not c.megazero.precision.fp16
    assert c.megazero.optimizer.clip_grad == 0.7
    assert c.optimizer == ("adam", {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05})
    assert c.scheduler == ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                             "warmup_num_steps": 1, "total_num_steps": 100})
    sizes = (c.megazero.parallel.ddp_bucket_size, c.prefetch_numel, c.persistence_threshold)
    assert sizes == (1024, 921, 320)  # hidden 32: h^2, 0.9 h^2, 10 h


def test_auto_without_a_source_is_refused_naming_the_key():
    for raw, needle in (({"gradient_clipping": "auto"}, "gradient_clipping is \"auto\""),
                        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
                        ({"zero_optimization": {"reduce_bucket_size": "auto"}}, "config.hidden_size"),
                        ({"fp16": {"enabled": "auto"}}, "TrainingArguments.fp16"),
                        ({"steps_per_print": "auto"}, "steps_per_print is \"auto\"")):
        with pytest.raises(ConfigError, match=needle):
            resolve_auto({**BASE, **raw})
    # the batch keys left "auto" are not given: DeepSpeed's rule derives them from the others
    c = read_config({**BASE, "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}, 2)
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (4, 1)


def test_a_config_file_that_is_not_json_or_missing_is_named(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match="ds.json: not valid JSON"):
        read_config(str(bad), 1)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_config(str(tmp_path / "missing.json"), 1)


# ---- DeepSpeed's schedules, from their definitions ---------------------------------------------
def _opt(lr=0.01, groups=1):
    """What a schedule reads and writes: the optimizer's parameter groups."""
    return SimpleNamespace(param_groups=[{"params": [], "lr": lr} for _ in range(groups)])


def test_warmup_schedules_follow_deepspeeds_formulas():
    opt = _opt()
    s = WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.001  # before the first step: the minimum
    rates = []
    for _ in range(12):
        s.step()
        rates.append(opt.param_groups[0]["lr"])
    expect = [0.001 + 0.009 * (math.log(n + 1) / math.log(10) if n < 10 else 1.0) for n in range(12)]
    assert rates == pytest.approx(expect, rel=1e-12, abs=0)
    opt = _opt()
    d = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear")
    got = []
    for _ in range(22):
        d.step()
        got.append(opt.param_groups[0]["lr"])
    expect = [0.01 * (n / 4 if n < 4 else max(0.0, (20 - n) / 16)) for n in range(22)]
    assert got == pytest.approx(expect, rel=1e-12, abs=0) and d.state_dict() == {"last_batch_iteration": 21}
    opt = _opt(lr=0.1)
    c = WarmupCosineLR(opt, total_num_steps=12, warmup_min_ratio=0.1, warmup_num_steps=3, cos_min_ratio=0.01,
                       warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0
    got = []
    for _ in range(14):
        c.step()
        got.append(opt.param_groups[0]["lr"])

    def ratio(n):
        if n < 3:
            return 0.1 + 0.9 * n / 3
        p = min(1.0, (n - 2) / 9)
        return 0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2
    assert got == pytest.approx([0.1 * ratio(n) for n in range(14)], rel=1e-12, abs=0)
    with pytest.raises(ConfigError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_opt(), warmup_num_steps=0)


# ---- the optimizer settings --------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)


def test_parameter_groups_decide_which_parameters_decay():
    from megazero.config import MegazeroConfig
    m, cfg = Tiny(), MegazeroConfig()
    decay = [m.a.weight]
    rest = [m.a.bias, m.norm.weight, m.norm.bias]
    section = ("adam", {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0})
    groups, client = read_optimizer(m, None, [{"params": decay, "weight_decay": 0.1},
                                              {"params": rest, "weight_decay": 0.0}], section, cfg)
    assert client is None and len(groups) == 2
    assert [p.apply_weight_decay for p in m.parameters()] == [True, False, False, False]
    assert (cfg.optimizer.optimizer, cfg.optimizer.weight_decay) == ("adam", 0.1)
    assert cfg.optimizer.adam_beta2 == 0.95
    # one group over everything: DeepSpeed decays every parameter, biases and norms included
    read_optimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01), None, None, cfg)
    assert all(p.apply_weight_decay for p in m.parameters()) and cfg.optimizer.weight_decay == 0.01
    read_optimizer(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), None, None, cfg)
    assert (cfg.optimizer.optimizer, cfg.optimizer.sgd_momentum) == ("sgd", 0.9)


@pytest.mark.parametrize("make, needle", [
    (lambda m: torch.optim.Adagrad(m.parameters()), "optimizer Adagrad is not supported"),
    (lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1), "use torch.optim.AdamW"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad=True"),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
    (lambda m: torch.optim.AdamW([{"params": [m.a.weight], "lr": 1.0},
                                  {"params": list(m.norm.parameters()) + [m.a.bias]}], lr=0.1),
     "parameter group 0 sets lr=1.0"),
    (lambda m: torch.optim.AdamW([m.a.weight], lr=0.1), "leaves out 3 trainable parameters of the model"),
])
def test_an_optimizer_megazero_cannot_run_is_named(make, needle):
    from megazero.config import MegazeroConfig
    m = Tiny()
    with pytest.raises(ConfigError, match=needle):
        read_optimizer(m, make(m), None, None, MegazeroConfig())


# ---- ZeRO-3 units for any module -------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10)
        self.head.weight = self.emb.weight
        self.scale = torch.nn.Parameter(torch.ones(8))


def test_units_are_the_submodules_owning_parameters_tied_and_small_ones_go_to_the_root():
    m = Tied()
    units = {id(mod): [id(p) for p in ps] for mod, ps in module_blocks(0)(m)}
    # emb.weight is tied to head.weight and scale is the root's own: both in the root
    assert units == {id(m.mid): [id(m.mid.weight), id(m.mid.bias)],
                     id(m.norm): [id(m.norm.weight), id(m.norm.bias)], id(m.head): [id(m.head.bias)]}
    small = {id(mod): [id(p) for p in ps] for mod, ps in module_blocks(8)(m)}  # <= 8 elements: persistent
    assert small == {id(m.mid): [id(m.mid.weight)], id(m.head): [id(m.head.bias)]}
    register_external_parameter(m, m.mid.weight)
    assert id(m.mid) not in {id(mod) for mod, _ in module_blocks(8)(m)}


def test_zero_init_in_one_process_keeps_the_whole_slice_and_gathers_back():
    from megazero.zero.partition import GatheredParameters, Init
    torch.manual_seed(3)
    ref = Tied()
    torch.manual_seed(3)
    with Init():
        m = Tied()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.numel() == 0 and p.zero_shape == q.shape and p.zero_shard.numel() == q.numel(), name
    with GatheredParameters(list(m.parameters()), modifier_rank=0):
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
        m.mid.bias.data.fill_(2.0)
    assert m.mid.bias.numel() == 0 and torch.equal(m.mid.bias.zero_shard, torch.full((8,), 2.0))


@pytest.mark.slow
def test_megazero_initialize_is_lazy_and_deepspeed_names_exist():
    code = ("import sys, megazero; assert 'megazero.engine' not in sys.modules; "
            "assert 'torch' not in sys.modules; import megazero.deepspeed as ds; "
            "assert callable(ds.initialize) and callable(ds.init_distributed); "
            "assert ds.zero.Init and ds.zero.GatheredParameters and ds.add_config_arguments; "
            "assert ds.comm.get_rank is __import__('torch').distributed.get_rank; "
            "from megazero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint; "
            "import megazero.zero as z; assert z.Init is ds.zero.Init")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.slow
@pytest.mark.parametrize("front", ["import megazero.deepspeed as deepspeed", "import megazero as deepspeed"])
def test_a_config_error_in_a_script_is_one_line_and_exit_2(tmp_path, front):
    script = tmp_path / "train.py"
    script.write_text(f"import torch\n{front}\n"
                      "m = torch.nn.Linear(2, 2)\n"
                      "deepspeed.initialize(model=m, model_parameters=m.parameters(),\n"
                      "                     config={'train_micro_batch_size_per_gpu': 1,\n"
                      "                             'zero_optimisation': {}})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(env, PYTHONPATH=ROOT))
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("train.py: error: ds_config: unknown key 'zero_optimisation'; megazero's "
                                  "engine reads only the keys docs/engine.md lists (remove it, or see there "
                                  "what replaces it)")
