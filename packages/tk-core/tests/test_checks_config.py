"""Validation messages and process-wide settings."""

import pytest
import torch

from tk_core import checks, config


def test_messages_name_op_argument_expectation_and_value():
    x = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^myop: x must be of dtype float32 or bfloat16, got int32$"):
        checks.check_dtype("myop", "x", x, (torch.float32, torch.bfloat16))
    with pytest.raises(TypeError, match=r"^myop: x must be a torch.Tensor, got list$"):
        checks.check_tensor("myop", "x", [1])
    with pytest.raises(ValueError, match=r"^myop: x must be 3-D, got shape \(2, 3\)$"):
        checks.check_ndim("myop", "x", x, 3)
    with pytest.raises(ValueError, match=r"^myop: x must be of shape \(\*, 4\), got shape \(2, 3\)$"):
        checks.check_shape("myop", "x", x, (None, 4))
    with pytest.raises(ValueError, match=r"^myop: hidden must be a multiple of 64, got 100$"):
        checks.check_divisible("myop", "hidden", 100, 64)
    with pytest.raises(ValueError, match=r"^myop: fmt must be one of \('e4m3', 'e2m1'\), got 'e5m2'$"):
        checks.check_one_of("myop", "fmt", "e5m2", ("e4m3", "e2m1"))
    with pytest.raises(ValueError, match="myop: x must be unit-stride in its last dimension"):
        checks.check_inner_contiguous("myop", "x", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="myop: x must be contiguous"):
        checks.check_contiguous("myop", "x", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="myop: y must be on device meta"):
        checks.check_same_device("myop", "y", x, torch.device("meta"))
    with pytest.raises(ValueError, match="myop: n must be a positive int, got 0"):
        checks.check_positive_int("myop", "n", 0)
    with pytest.raises(TypeError, match="myop: n must be a positive int, got 1.5"):
        checks.check_positive_int("myop", "n", 1.5)


def test_kind_checks_reject_lookalikes():
    # 128.0 == 128 and True == 1, but neither is the int a size or block option means
    with pytest.raises(TypeError, match=r"^myop: bm must be one of \(32, 128\), got 128.0 \(float\)$"):
        checks.check_one_of("myop", "bm", 128.0, (32, 128))
    with pytest.raises(TypeError, match=r"^myop: bm must be one of \(0, 1\), got True \(bool\)$"):
        checks.check_one_of("myop", "bm", True, (0, 1))
    with pytest.raises(TypeError, match=r"^myop: bm must be one of \(32, 128\), got 64.5$"):
        checks.check_one_of("myop", "bm", 64.5, (32, 128))
    with pytest.raises(TypeError, match=r"^myop: fmt must be one of \('e4m3',\), got tensor"):
        checks.check_one_of("myop", "fmt", torch.zeros(2), ("e4m3",))
    with pytest.raises(ValueError, match=r"^myop: bm must be one of \(32, 128\), got 64$"):
        checks.check_one_of("myop", "bm", 64, (32, 128))
    assert checks.check_one_of("myop", "bm", torch.tensor(128).item(), (32, 128)) is None
    with pytest.raises(TypeError, match=r"^myop: n must be a positive int, got True$"):
        checks.check_positive_int("myop", "n", True)
    with pytest.raises(TypeError, match=r"^myop: flag must be a bool, got 'False' \(str\)$"):
        checks.check_bool("myop", "flag", "False")
    with pytest.raises(TypeError, match=r"^myop: flag must be a bool, got 1 \(int\)$"):
        checks.check_bool("myop", "flag", 1)
    assert checks.check_bool("myop", "flag", False) is None


def test_check_float_and_check_int():
    assert checks.check_float("myop", "eps", 0) == 0.0 and isinstance(checks.check_float("myop", "eps", 1), float)
    with pytest.raises(TypeError, match=r"^myop: eps must be a float, got str$"):
        checks.check_float("myop", "eps", "1e-6")
    with pytest.raises(TypeError, match=r"^myop: eps must be a float or None, got bool$"):
        checks.check_float("myop", "eps", True, kind="a float or None")
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^myop: eps must be a finite float >= 0, got"):
            checks.check_float("myop", "eps", bad)
    with pytest.raises(ValueError, match=r"^myop: c must be a finite float > 0, got 0.0$"):
        checks.check_float("myop", "c", 0.0, strict=True)
    with pytest.raises(ValueError, match=r"^myop: c must be at least 2\*\*-10, got 0.0001$"):
        checks.check_float("myop", "c", 1e-4, 2.0**-10, expected="at least 2**-10")
    assert checks.check_int("myop", "n", 0, 0, "a non-negative int") is None
    with pytest.raises(ValueError, match=r"^myop: n must be a non-negative int, got -1$"):
        checks.check_int("myop", "n", -1, 0, "a non-negative int")
    with pytest.raises(TypeError, match=r"^myop: n must be a non-negative int, got False$"):
        checks.check_int("myop", "n", False, 0, "a non-negative int")


def test_check_disjoint_compares_byte_ranges():
    buf = torch.zeros(4, 8)
    checks.check_disjoint("myop", "out", buf[2:], "x", buf[:2])  # adjacent rows: no shared byte
    checks.check_disjoint("myop", "out", buf, "x", torch.zeros(4, 8))
    checks.check_disjoint("myop", "out", buf[:0], "x", buf)  # nothing is written
    for x in (buf, buf[1:3, 4:], buf.t(), buf[:, 7:].view(-1)):
        with pytest.raises(ValueError, match=r"^myop: out must be memory disjoint from x, got a tensor whose bytes"):
            checks.check_disjoint("myop", "out", buf[1:3], "x", x)


def test_passing_checks_return_none():
    x = torch.zeros(2, 64)
    assert checks.check_dtype("op", "x", x, torch.float32) is None
    assert checks.check_shape("op", "x", x, (2, 64)) is None
    assert checks.check_inner_contiguous("op", "x", x[:, ::1]) is None


@pytest.fixture
def clean_config():
    yield
    config.reset()


def test_config_getters_setters_and_reset(clean_config):
    with pytest.warns(UserWarning, match="set_pdl.True. has no effect"):
        config.set_pdl(True)
    config.set_token_alignment(64)
    config.set_deterministic(False)
    config.set_amax_clamp("e4m3", 1e-3)
    config.set_num_sms(1)
    assert config.get_pdl() and config.get_token_alignment() == 64 and not config.is_deterministic()
    assert config.get_amax_clamp("e4m3") == 1e-3 and config.get_num_sms() == 1
    config.reset()
    assert not config.get_pdl() and config.get_token_alignment() == 128 and config.is_deterministic()
    assert config.get_amax_clamp("e4m3") == 1e-4 and config.get_amax_clamp("e2m1") == 6 * 2.0**-126


def test_config_rejects_bad_values(clean_config):
    with pytest.raises(ValueError, match="alignment must be a positive power of two, got 96"):
        config.set_token_alignment(96)
    with pytest.raises(ValueError, match="fmt must be one of"):
        config.get_amax_clamp("e3m4")
    with pytest.raises(ValueError, match="value must be a finite float > 0"):
        config.set_amax_clamp("e4m3", 0.0)
    with pytest.raises(ValueError, match="num_sms must be a positive int or None"):
        config.set_num_sms(0)
    # kinds: a flag is a bool, a count is an int (not a bool), a floor a finite real
    for setter in (config.set_pdl, config.set_deterministic):
        with pytest.raises(TypeError, match="enabled must be a bool, got 'False'"):
            setter("False")
    with pytest.raises(TypeError, match="num_sms must be a positive int or None, got True"):
        config.set_num_sms(True)
    with pytest.raises(TypeError, match="alignment must be a positive power of two, got 64.0"):
        config.set_token_alignment(64.0)
    with pytest.raises(TypeError, match="value must be a finite float > 0, got '1'"):
        config.set_amax_clamp("e4m3", "1")
    with pytest.raises(TypeError, match="value must be a finite float > 0, got True"):
        config.set_amax_clamp("e4m3", True)
    with pytest.raises(ValueError, match="value must be a finite float > 0, got inf"):
        config.set_amax_clamp("e4m3", float("inf"))
    with pytest.raises(ValueError, match="fmt must be one of"):
        config.set_amax_clamp(["e4m3"], 1.0)
    with pytest.raises(ValueError, match="fmt must be one of"):
        config.get_amax_clamp(["e4m3"])
    assert config.get_pdl() is False and config.is_deterministic() is True and config.get_amax_clamp("e4m3") == 1e-4


def test_check_grid_extent():
    checks.check_grid_extent("op", "dilation", 65535)
    with pytest.raises(ValueError, match="op: dilation must be at most 65535, got 65536"):
        checks.check_grid_extent("op", "dilation", 65536)
    with pytest.raises(ValueError, match="x must be at most 65535 rows, got shape"):
        checks.check_grid_extent("op", "x", 70000, "rows", "shape (70000, 8)")
