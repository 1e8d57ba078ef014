"""Keep secrets out of everything deepspec writes: saved configs (run folders, checkpoints, caches, model cards'
configs), wandb's run config and log lines.

A value is a secret when its key names one (api_key, token, password, ...), when it follows a secret-naming flag
in an argument list (`--api-key X`), or when it is the password or a secret query parameter of a URL.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"^(?!(bos|eos|pad|unk|sep|cls|mask)[_-]token$)(.*[_-])?(api[_-]?key|apikey|token|access[_-]?token|auth[_-]?token|hf[_-]?token|secret|password|passwd|authorization)$", re.I)
_SECRET_FLAG = re.compile(r"^--?(api[_-]?key|token|hf[_-]?token|access[_-]?token|password|secret)$", re.I)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<pw>[^/@\s]*)@", re.I)
# inside override text: `--api-key, X` / `--api-key=X` in a list, `hf_token: X` in a mapping
_INLINE_FLAG = re.compile(r"(?P<key>--?(?:api[_-]?key|token|hf[_-]?token|access[_-]?token|password|secret)\s*[,=\s]\s*)[^,\]\s]+", re.I)
_INLINE_KEY = re.compile(r"(?P<key>\b(?:[\w-]*[_-])?(?:api[_-]?key|apikey|token|access[_-]?token|auth[_-]?token|hf[_-]?token|secret|password|passwd)\s*:\s*)[^,}\s]+", re.I)
_URL_QUERY = re.compile(r"(?P<key>[?&](?:api[_-]?key|token|access[_-]?token|key|password|secret)=)[^&\s#]*", re.I)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.match(str(key)))


def redact_text(text: str) -> str:
    """A URL's password and secret query parameters, `key=value` overrides of secret keys."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    text = _URL_QUERY.sub(lambda m: f"{m['key']}{REDACTED}", text)
    text = _INLINE_FLAG.sub(lambda m: f"{m['key']}{REDACTED}", text)
    text = _INLINE_KEY.sub(lambda m: m["key"] + REDACTED if not re.match(r"(bos|eos|pad|unk|sep|cls|mask)[_-]token", m["key"], re.I) else m[0], text)
    if "=" in text and not text.startswith(("http://", "https://")):
        key, _, value = text.partition("=")
        if is_secret_key(key.rsplit(".", 1)[-1].strip()) and value:
            return f"{key}={REDACTED}"
    return text


def redact(obj: Any) -> Any:
    """A copy of a config mapping with every secret replaced by '<redacted>'."""
    if isinstance(obj, dict):
        return {k: (REDACTED if is_secret_key(k) and v not in (None, "") else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out, hide_next = [], False
        for item in obj:
            if hide_next and isinstance(item, str):
                out.append(REDACTED)
                hide_next = False
                continue
            hide_next = isinstance(item, str) and bool(_SECRET_FLAG.match(item))
            if isinstance(item, str) and "=" in item and _SECRET_FLAG.match(item.split("=", 1)[0]):
                out.append(item.split("=", 1)[0] + "=" + REDACTED)
                continue
            out.append(redact(item))
        return out
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
