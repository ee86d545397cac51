"""Credentials out of everything a run writes or sends: RUN_DIR/config.toml, every record (metrics.jsonl,
metrics.csv, the console), summary.json, the trackers' parameters and the warning lines.

    >>> redact({"mlflow_tracking_uri": "http://alice:s3cret@host:5000", "api_key": "abc", "lr": 0.1})
    {'mlflow_tracking_uri': 'http://***@host:5000', 'api_key': '***', 'lr': 0.1}
    >>> redact("POST http://alice:s3cret@host/api?token=abc&page=2")
    'POST http://***@host/api?token=***&page=2'

What counts as a credential: the user part of a URI (``scheme://USER[:PASSWORD]@``), the string value of a
field whose name says token, key, password, secret, credential or auth (``hf_token``, ``api_key``,
``client_secret``; not a tokenizer's ``pad_token`` nor a dataset's ``text_key``), the same as ``NAME=VALUE``
or ``NAME: VALUE`` in text, ``Bearer ...``, and values in the well-known token formats (``hf_...``,
``ghp_...``, ``sk-...``, ``AKIA...``). Numbers, flags and names stay: metrics are never touched. Redacting twice
is redacting once.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "redact", "is_secret_name"]

MASK = "***"

# scheme://userinfo@ : greedy up to the last '@' before the path, so a password holding '@' goes whole.
_URI_USER = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s\"'<>]+@")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_TOKEN_VALUE = re.compile(r"\b(?:hf_|ghp_|gho_|ghu_|ghs_|ghr_|github_pat_|glpat-|sk-|xox[abprs]-|AKIA|ASIA)"
                          r"[A-Za-z0-9_\-]{16,}")
_QUERY = re.compile(r"(?<=[?&;])(?P<name>[^=&#\s]+)=(?P<value>[^&#\s]+)")
# NAME=VALUE, NAME: VALUE, "NAME":"VALUE"; not module:function (no space after the colon) nor scheme://.
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][\w.-]*)(?P<sep>[\"']?(?:\s*=\s*|\s*:\s+|\s*:(?=[\"'])))(?!//)"
                         r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s&,;)\]}]+)")

_SECRET_WORDS = {"password", "passwd", "passphrase", "pwd", "secret", "secrets", "credential", "credentials",
                 "token", "apikey", "auth", "authorization", "cookie"}
_KEY_OWNERS = {"api", "access", "secret", "private", "auth", "signing", "encryption", "account", "master", "ssh",
               "service", "license", "wandb", "hf", "openai"}
"""'X_key' is a credential for these X only: a dataset's text_key or a sort_key is a name, not a secret."""
_TOKENIZER = {"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "special", "max", "num", "per"}
"""'pad_token' and friends are a tokenizer's symbols."""


def _words(name: str) -> list[str]:
    last = name.rsplit(".", 1)[-1]
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", last)  # camelCase -> camel_Case
    return [word for word in re.split(r"[_\-\s]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    """Whether a field called ``name`` (the last part of a dotted name) holds a credential."""
    words = _words(name)
    for i, word in enumerate(words):
        if word == "token" and (i == 0 or words[i - 1] not in _TOKENIZER):
            return True
        if word in _SECRET_WORDS - {"token"}:
            return True
        if word == "key" and i > 0 and words[i - 1] in _KEY_OWNERS:
            return True
    return False


def _redact_text(text: str) -> str:
    text = _URI_USER.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", text)
    text = _TOKEN_VALUE.sub(MASK, text)
    text = _QUERY.sub(lambda m: f"{m.group('name')}={MASK}" if is_secret_name(m.group("name")) else m.group(0), text)

    def assignment(match: re.Match) -> str:
        if not is_secret_name(match.group("name")) or match.group("value").strip("\"'") in ("", MASK):
            return match.group(0)
        quote = match.group("value")[0] if match.group("value")[0] in "\"'" else ""
        return f"{match.group('name')}{match.group('sep')}{quote}{MASK}{quote}"

    return _ASSIGNMENT.sub(assignment, text)


def redact(value: Any) -> Any:
    """``value`` with its credentials replaced by ``***``: text, or dicts, lists and tuples of anything (a
    new object; the given one is left as it was). Anything else is returned as it is."""
    return _redact(value, secret=False)


def _redact(value: Any, secret: bool) -> Any:
    """``secret``: under a field whose name says credential, every non-empty text is one."""
    if isinstance(value, str):
        return MASK if secret and value else _redact_text(value)
    if isinstance(value, dict):
        return {key: _redact(item, secret or (isinstance(key, str) and is_secret_name(key)))
                for key, item in value.items()}
    if isinstance(value, list):
        return [_redact(item, secret) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # a named tuple stays as it is
        return tuple(_redact(item, secret) for item in value)
    return value
