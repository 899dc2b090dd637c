"""Attack (operator error): one token listed for two users in the tokens file.

HTTP then acts as one of them while MQTT authenticates the token for both, so whoever holds it
can act as either user on MQTT. Contract §9: a tokens file that cannot be used exits 2 with a
message naming the line numbers, never the token. Covers plain tokens, the ``sha256:`` form, and
a plain token equal to another line's hash.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.conformance.conftest import ROOT, Servers, free_port, http_json, kcloak

SECRET = "Zq7mK3xV-shared-token"
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()

FILES = {
    "plain": (f"alice:{SECRET}\n# rotation\nbob:{SECRET}\n", (1, 3)),
    "hash": (f"alice:{SECRET}\n\ncarol:other-token\nbob:sha256:{DIGEST}\n", (1, 4)),
    "two hashes": (f"alice:sha256:{DIGEST}\nbob:sha256:{DIGEST}\n", (1, 2)),
}


def _serve(tmp_path: Path, tokens: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kcloak(
            "serve",
            "--http",
            f"127.0.0.1:{free_port()}",
            "--mqtt",
            "none",
            "--data-dir",
            str(tmp_path / "data"),
            "--tokens",
            str(tokens),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("case", sorted(FILES))
def test_token_listed_for_two_users_is_refused_at_start(tmp_path: Path, case: str) -> None:
    text, (a, b) = FILES[case]
    tokens = tmp_path / "tokens"
    tokens.write_text(text, encoding="utf-8")
    result = _serve(tmp_path, tokens)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"lines {a} and {b}" in result.stderr
    assert SECRET not in result.stderr + result.stdout and DIGEST not in result.stderr + result.stdout
    assert "alice" not in result.stderr and "bob" not in result.stderr


def test_rotation_for_one_user_still_starts(servers: Servers, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{SECRET}\nalice:sha256:{DIGEST}\nalice:second\nbob:bobs-token\n", encoding="utf-8")
    served = servers.serve("--tokens", str(tokens), mqtt=False)
    status, _, body = http_json("GET", served.url("/v1/users/alice/profile"), token=SECRET)
    assert status == 200 and body["source"] == "default"
    status, _, body = http_json("GET", served.url("/v1/users/bob/profile"), token=SECRET)
    assert status == 403 and body["error"]["code"] == "forbidden"
