"""Hypothesis strategies for raw single-fix requests as real clients and attackers write them:
the plain form of phone apps and HTTP libraries, and every way of bending it (header case and
spacing, repeated or conflicting framing headers, other media types, tokens, ``Connection``
values, obs-fold, bare LF, control and non-ASCII bytes, other request lines)."""

from __future__ import annotations

from hypothesis import strategies as st

USER_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"
TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

users = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from("abcXYZ019"),
    st.text(USER_CHARS, max_size=63),
)


def _case(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from([name, name.lower(), name.upper(), name.title()])


_ows = st.sampled_from(["", " ", "  ", "\t", " \t"])
_eol = st.sampled_from(["\r\n"] * 12 + ["\n", "\r", "\r\r\n"])


@st.composite
def header(draw: st.DrawFn, name: str, value: str) -> str:
    """One header line with its line ending: mostly plain, sometimes bent."""
    line = draw(_case(name)) + ":" + draw(_ows) + value + draw(_ows)
    bend = draw(st.sampled_from(["none"] * 14 + ["space_before_colon", "fold", "nul", "latin1"]))
    if bend == "space_before_colon":
        line = line.replace(":", " :", 1)
    elif bend == "fold":
        line = line + "\r\n " + "x"
    elif bend == "nul":
        line = line + "\x00"
    elif bend == "latin1":
        line = line + "\xe9"
    return line + draw(_eol)


_request_lines = st.sampled_from(
    [
        "POST /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/location HTTP/1.0",
        "post /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/location?x=1 HTTP/1.1",
        "POST /v1/users/{u}/location/ HTTP/1.1",
        "POST  /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/location  HTTP/1.1",
        "POST /v1/users/%75{u}/location HTTP/1.1",
        "PUT /v1/users/{u}/location HTTP/1.1",
        "POST /v1/users/{u}/profile HTTP/1.1",
        "POST http://127.0.0.1/v1/users/{u}/location HTTP/1.1",
    ]
)

_content_types = st.sampled_from(
    ["application/json"] * 8
    + [
        "application/json; charset=utf-8",
        "application/json; charset=UTF-8",
        "application/json;charset=utf-8",
        'application/json; charset="utf-8"',
        "application/json; charset=iso-8859-1",
        "application/json; v=1",
        "Application/JSON",
        "application/jsonx",
        "text/plain",
        "application/json ;",
        "",
    ]
)
_connections = st.sampled_from(["keep-alive", "close", "Close", "KEEP-ALIVE", "keep-alive, close", "upgrade", ""])
_extra_names = st.text(TOKEN_CHARS, min_size=1, max_size=12) | st.sampled_from(
    ["User-Agent", "Accept", "Accept-Encoding", "X-Request-Id", "bad name", "bad:name", "", "é"]
)
_extra_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40) | st.sampled_from(
    ["a\tb", "  padded  ", "", "\x7f", "caf\xe9"]
)


@st.composite
def fix_requests(draw: st.DrawFn, body: bytes, tokens: list[str], user: str | None = None) -> bytes:
    """A request carrying ``body`` (a fix), mostly in the plain single-fix form.

    ``tokens``: bearer tokens to draw from (an ``Authorization`` header is sometimes left out,
    repeated or bent)."""
    u = user if user is not None else draw(users)
    head = draw(_request_lines).format(u=u) + draw(st.sampled_from(["\r\n"] * 10 + ["\n"]))
    length = str(len(body))
    fields: list[tuple[str, str]] = [("Host", "127.0.0.1")]
    fields.append(("Content-Type", draw(_content_types)))
    fields.append(
        (
            "Content-Length",
            draw(st.sampled_from([length] * 8 + ["0" + length, "+" + length, length + " ", str(len(body) + 1)])),
        )
    )
    if tokens and draw(st.integers(0, 5)) > 0:
        token = draw(st.sampled_from(tokens))
        fields.append(
            (
                "Authorization",
                draw(st.sampled_from([f"Bearer {token}", f"bearer {token}", f"Bearer  {token}", "Basic Zm9v", token])),
            )
        )
    if draw(st.booleans()):
        fields.append(("Connection", draw(_connections)))
    for _ in range(draw(st.integers(0, 3))):
        fields.append((draw(_extra_names), draw(_extra_values)))
    extra = draw(
        st.sampled_from(
            [None] * 10
            + [
                ("Transfer-Encoding", "chunked"),
                ("Expect", "100-continue"),
                ("Content-Length", length),
                ("Content-Type", "application/json"),
                ("Host", "other"),
                ("Upgrade", "websocket"),
                ("Content-Encoding", "gzip"),
            ]
        )
    )
    if extra is not None:
        fields.insert(draw(st.integers(0, len(fields))), extra)
    fields = draw(st.permutations(fields))
    text = head + "".join(draw(header(name, value)) for name, value in fields) + draw(_eol)
    return text.encode("latin-1") + body
