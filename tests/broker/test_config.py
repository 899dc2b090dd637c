"""Configuration: shipped defaults, TOML overrides, flags, and clear refusals of bad input."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from broker.config import Config, ConfigError, is_loopback, parse_listen

CONTRACT = Path(__file__).resolve().parents[3] / "shared" / "CONTRACT.md"


def test_printed_defaults_are_the_contract_block() -> None:
    text = CONTRACT.read_text(encoding="utf-8")
    block = re.search(r"```toml\n(\[server\].*?)```", text, re.S)
    assert block is not None
    # One documented extension (docs/contract-extensions.md): the default area floor is 10,000 m².
    contract_line = "min_area_m2 = 0.0\n"
    shipped_line = "min_area_m2 = 10000.0           # not 0: co-located users, see README\n"
    assert block.group(1).count(contract_line) == 1
    assert Config().to_toml() == block.group(1).replace(contract_line, shipped_line)


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
    assert is_loopback("127.3.4.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
