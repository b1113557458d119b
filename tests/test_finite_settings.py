"""Every numeric setting is checked for finiteness and range where it is read (issue 42 item 3): NaN and
the infinities pass a ``v < 0`` test, so each float setting is refused unless finite, in one line that
names its flag, before any range check or any use."""
import math
from dataclasses import fields

import pytest

from megazero.config import SECTIONS, ConfigError, config_from_dict, flag_of, parse_args, validate

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
FLOAT_TYPES = ("float", "Optional[float]")


def _refused(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + argv, world_size=1)
    message = str(err.value)
    assert needle in message and "\n" not in message, message
    return message


def _float_fields():
    return [(section, f) for section, cls in SECTIONS.items() for f in fields(cls)
            if str(f.type) in FLOAT_TYPES and not f.metadata.get("derived")]


def test_every_float_setting_refuses_nan_and_the_infinities_naming_its_flag():
    found = _float_fields()
    assert len(found) >= 40  # the table is read, not a hand-kept list
    for section, f in found:
        for bad in (math.nan, math.inf, -math.inf):
            cfg = config_from_dict({"mock_data": True, f.name: bad})
            with pytest.raises(ConfigError) as err:
                validate(cfg, world_size=1)
            message = str(err.value)
            assert message.startswith(flag_of(f) + " must be a finite number"), (f.name, message)
            assert "\n" not in message


@pytest.mark.parametrize("argv, needle", [
    (["--moe-router-bias-update-rate", "nan"], "--moe-router-bias-update-rate must be a finite number"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"],
     "--moe-expert-capacity-factor must be a finite number, got inf"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "nan"], "--moe-expert-capacity-factor must be"),
    (["--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff must be a finite number"),
    (["--moe-z-loss-coeff=-inf"], "--moe-z-loss-coeff must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
    (["--adam-beta2", "nan"], "--adam-beta2 must be a finite number"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number"),
    (["--hidden-dropout", "nan"], "--hidden-dropout must be a finite number"),
])
def test_the_reported_non_finite_flags_are_one_line_naming_the_flag(argv, needle):
    _refused(argv, needle)


@pytest.mark.parametrize("argv, needle", [
    (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
    (["--norm-epsilon=-1e-5"], "--norm-epsilon must be > 0"),
    (["--rotary-base", "0"], "--rotary-base must be > 0"),
    (["--position-embedding-type", "yarn", "--yarn-beta-slow", "0"], "--yarn-beta-slow 0.0 must be > 0"),
    (["--adam-beta1", "1.5"], "--adam-beta1/--adam-beta2 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--clip-grad=-1"], "--clip-grad must be >= 0 (0 disables clipping)"),
    (["--attention-dropout", "1"], "--attention-dropout must be in [0, 1)"),
])
def test_ranges_name_the_flag(argv, needle):
    _refused(argv, needle)


@pytest.mark.parametrize("weights, needle", [
    (["nan", "a", "1", "b"], "--data-path: the weight 'nan' before 'a' must be a finite number > 0"),
    (["1", "a", "inf", "b"], "the weight 'inf' before 'b'"),
    (["0", "a", "1", "b"], "the weight '0' before 'a'"),
])
def test_blend_weights_are_finite_and_positive(weights, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(["--data-path", *weights, "--vocab-size", "300"], world_size=1)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_non_finite_split_is_named():
    with pytest.raises(ConfigError, match=r"--split 'nan,1,1': expected up to three finite"):
        parse_args(["--data-path", "a", "--vocab-size", "300", "--split", "nan,1,1"], world_size=1)


def test_float_text_of_a_config_file_is_read_as_its_number_and_other_text_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-3\nmock_data: true\n")  # YAML 1.1 reads 1e-3 as a string
    assert parse_args(["--config", str(path)], world_size=1).optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match=r"^--lr must be a number, got 'fast'$"):
        validate(config_from_dict({"mock_data": True, "lr": "fast"}), world_size=1)
    with pytest.raises(ConfigError, match=r"^--adam-eps must be a number, got None$"):
        validate(config_from_dict({"mock_data": True, "adam_eps": None}), world_size=1)
