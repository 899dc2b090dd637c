"""The embedded MQTT broker (amqtt) for a zero-setup start, run in a child process on loopback.

``python -m broker.embedded_mqtt --listen 127.0.0.1:1883 [--tokens FILE --service-secret FILE]``.
In open mode anyone on loopback may connect. With tokens, the username is the user id and the
password its token, and the contract's ACL (§3) pins each user to its own topics; the service
account ``_kcloak`` (password from the secret file) may read and write ``kcloak/v1/#``.
amqtt's own logging is silenced below warnings (its messages carry client ids).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action, BaseContext
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from broker.auth import TokenStore
from broker.serve_cli import event_loop_factory

SERVICE_USER = "_kcloak"
_ROOT = "kcloak/v1/"


def acl_allows(user: str | None, topic: str, action: str, published_readers: frozenset[str]) -> bool:
    """The ACL of contract §3, for one user, topic and action (``publish`` or ``subscribe``)."""
    if user is None:
        return False
    if user == SERVICE_USER:
        return topic.startswith(_ROOT) or topic == "kcloak/v1/#"
    if action == "publish":
        return topic in {f"{_ROOT}{kind}/{user}" for kind in ("update", "updates", "profile", "query")}
    if topic in (f"{_ROOT}answer/{user}", f"{_ROOT}status/{user}", f"{_ROOT}broker/status"):
        return True
    return user in published_readers and (topic == f"{_ROOT}published/#" or topic.startswith(f"{_ROOT}published/"))


class TokenAuthPlugin(BaseAuthPlugin):
    """Username = user id, password = its token; ``_kcloak`` uses the service secret."""

    @dataclass
    class Config:
        tokens_file: str = ""
        service_secret_file: str = ""

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self._tokens = TokenStore.from_file(self.config.tokens_file)
        self._secret = Path(self.config.service_secret_file).read_text(encoding="utf-8").strip()

    async def authenticate(self, *, session: Session) -> bool | None:
        user = session.username
        password = session.password
        if not user or password is None:
            return False
        pw = password.decode() if isinstance(password, bytes) else str(password)
        if user == SERVICE_USER:
            return hmac.compare_digest(pw.encode(), self._secret.encode())
        return self._tokens.check(user, pw)


class ContractAclPlugin(BaseTopicPlugin):
    """Enforces :func:`acl_allows` on every publish and subscribe."""

    @dataclass
    class Config:
        published_readers: list[str] = field(default_factory=list)

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Action | None = None
    ) -> bool | None:
        if session is None or topic is None:
            return False
        act = "publish" if action == Action.PUBLISH else "subscribe"
        return acl_allows(session.username, topic, act, frozenset(self.config.published_readers))


def broker_config(listen: str, tokens_file: str | None, secret_file: str | None, readers: list[str]) -> dict[str, Any]:
    plugins: dict[str, Any]
    if tokens_file:
        plugins = {
            "broker.embedded_mqtt.TokenAuthPlugin": {
                "tokens_file": tokens_file,
                "service_secret_file": secret_file or "",
            },
            "broker.embedded_mqtt.ContractAclPlugin": {"published_readers": readers},
        }
    else:
        plugins = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    return {
        "listeners": {"default": {"type": "tcp", "bind": listen, "max_connections": 10000}},
        "plugins": plugins,
    }


async def _main(args: argparse.Namespace) -> int:
    cfg = broker_config(args.listen, args.tokens, args.service_secret, args.published_readers)
    broker = Broker(cfg)
    try:
        await broker.start()
    except Exception as exc:
        print(f"embedded MQTT: cannot start ({type(exc).__name__})", file=sys.stderr)
        return 1
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_watch_parent(os.getppid(), stop))
    await stop.wait()
    watcher.cancel()
    await broker.shutdown()
    return 0


async def _watch_parent(parent: int, stop: asyncio.Event, period_s: float = 1.0) -> None:
    """Set ``stop`` when the parent process is gone (this child runs in a session of its own, so
    nothing else would stop it if the broker were killed)."""
    while os.getppid() == parent:
        await asyncio.sleep(period_s)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m broker.embedded_mqtt")
    p.add_argument("--listen", default="127.0.0.1:1883")
    p.add_argument("--tokens")
    p.add_argument("--service-secret")
    p.add_argument("--published-readers", nargs="*", default=[])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="embedded-mqtt %(levelname)s %(name)s")
    for name in ("amqtt", "transitions"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with asyncio.Runner(loop_factory=event_loop_factory(default="uvloop")) as runner:
        return runner.run(_main(args))


if __name__ == "__main__":
    raise SystemExit(main())
