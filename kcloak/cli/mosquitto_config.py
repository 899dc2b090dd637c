"""``kcloak mosquitto-config`` (contract §3, §9): flags → :func:`kcloak.broker.mosquitto.write_config`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kcloak.cli.main import SubParsers


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser(
        "mosquitto-config",
        help="generate a mosquitto configuration that enforces kcloak's per-user ACL",
        description=(
            "Write mosquitto.conf, passwd, acl and service.secret into DIR so that a mosquitto "
            "broker authenticates every user with its kcloak token and pins it to its own topics."
        ),
    )
    p.add_argument("--tokens", required=True, metavar="FILE", help="tokens file (user_id:token lines)")
    p.add_argument("-o", dest="out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--listen", default="127.0.0.1:1883", metavar="HOST:PORT", help="mosquitto listener")
    p.add_argument("--published-readers", default="", metavar="a,b", help="users allowed to read published data")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcloak.broker.config import ConfigError, parse_listen
    from kcloak.broker.mosquitto import SERVICE_USER, write_config
    from kcloak.wire.tokens import TokensFileError

    readers = [r for r in args.published_readers.split(",") if r]
    out = Path(args.out)
    try:
        skipped, _ = write_config(args.tokens, out, args.listen, readers)
    except (TokensFileError, ConfigError) as exc:
        print(f"kcloak mosquitto-config: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kcloak mosquitto-config: cannot write {out} ({exc.strerror})", file=sys.stderr)
        return 1
    for number in skipped:
        print(f"warning: tokens file line {number} is hashed (sha256) and was skipped", file=sys.stderr)
    host, port = parse_listen(args.listen)
    print(
        "note: passwd and service.secret are readable by you only; run mosquitto as this user "
        "(mosquitto.conf option 'user') or give its user read access",
        file=sys.stderr,
    )
    print(f"mosquitto -c {out.resolve() / 'mosquitto.conf'}")
    print(
        f"kcloak serve --mqtt mqtt://{SERVICE_USER}@{host}:{port} "
        f"--mqtt-password-file {out.resolve() / 'service.secret'} --tokens {Path(args.tokens).resolve()}"
    )
    return 0
