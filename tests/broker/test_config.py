"""Configuration: shipped defaults, TOML overrides, flags, and clear refusals of bad input."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kcloak.broker.config import Config, ConfigError, is_loopback, parse_listen

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_printed_defaults_are_the_documented_block() -> None:
    """docs/configuration.md, the project's own reference, shows exactly what --print-config prints."""
    text = REFERENCE.read_text(encoding="utf-8")
    block = re.search(r"```toml\n(\[server\].*?)```", text, re.S)
    assert block is not None
    assert Config().to_toml() == block.group(1)


def test_printed_config_round_trips() -> None:
    cfg = Config().with_values({"cloaking.algorithm": "casper", "profile.k": 7, "auth.published_readers": ["a"]})
    again = Config.from_toml_text(cfg.to_toml())
    assert again == cfg
    assert tomllib.loads(cfg.to_toml())["profile"]["k"] == 7


def test_toml_overrides_and_flags_win() -> None:
    cfg = Config.from_toml_text('[cloaking]\nalgorithm = "nn"\n[profile]\nk = 9\n')
    assert cfg.cloaking.algorithm == "nn" and cfg.profile.k == 9
    cfg2 = cfg.with_values({"cloaking.algorithm": "hilbert", "profile.k": None})
    assert cfg2.cloaking.algorithm == "hilbert" and cfg2.profile.k == 9


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[nope]\nx = 1\n", "unknown section"),
        ("[server]\nbogus = 1\n", "unknown key server.bogus"),
        ("[profile]\nk = 5.0\n", "profile.k: must be an integer"),
        ("[profile]\nk = 0\n", "profile.k"),
        ('[cloaking]\nalgorithm = "magic"\n', "cloaking.algorithm"),
        ('[http]\nlisten = "nowhere"\n', "http.listen"),
        ("[http]\nhead_timeout_s = 0\n", "http.head_timeout_s: must be > 0"),
        ("[http]\nbody_timeout_s = -1.0\n", "http.body_timeout_s: must be > 0"),
        ("[storage]\nretention_s = 10.0\n", "storage.retention_s"),
        ("[profile]\nmin_area_m2 = 5e6\n", "min_area_m2"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_config_is_refused_with_the_key(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Config.from_toml_text(text)


def test_listen_parsing_and_loopback() -> None:
    assert parse_listen("127.0.0.1:8470") == ("127.0.0.1", 8470)
    assert parse_listen("[::1]:80") == ("::1", 80)
    with pytest.raises(ConfigError):
        parse_listen("8470")
    for unicode_digits in ("127.0.0.1:8\u00b2", "127.0.0.1:\u0663\u0663"):  # '²', Arabic-Indic '٣٣'
        with pytest.raises(ConfigError):
            parse_listen(unicode_digits)
    assert is_loopback("127.3.4.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
