"""Secrets: what counts as one, and how they are kept out of records and messages.

The rule (docs/security.md): a secret never appears in MLflow params or tags, a
config file, a log line, Ray's job info, the Ray Train loop config or the
runtime env `ray job list` shows. Credentials reach a process through its own
environment (or a file it names), never through something the driver records
or ships.

- `is_secret_name(name)`: an environment variable that holds a credential by
  its name (`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `MLFLOW_TRACKING_PASSWORD`, `..._WEBHOOK...`, `RAY_AUTH_TOKEN`, ...).
- `url_credentials(text)`: whether a URL carries a user or password
  (`https://user:pass@host`, `s3://KEY:SECRET@bucket`).
- `redact(text)`: any URL in `text` with its credentials and secret query
  parameters (`?token=`, `X-Amz-Signature=`) replaced by `***`; everything
  else unchanged. Used wherever a URI is printed or recorded.
- `shareable_env(env, also_secret)`: the variables of `env` that may travel
  to other processes and records: no secret names, no values with URL
  credentials, none of `also_secret` (e.g. the variable a config names for its
  alert webhook).

Import-light (standard library only): config validation uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MASK = "***"

# Parts of a variable name that mark it as a credential.
_SECRET_NAME = re.compile(
    r"SECRET|PASSW(OR)?D|TOKEN|CREDENTIAL|PRIVATE|WEBHOOK|API_?KEY|ACCESS_KEY|"
    r"SESSION|AUTH|COOKIE|SIGNATURE|(^|_)PASS($|_)|(^|_)KEY($|_)",
    re.IGNORECASE,
)
# A URL: scheme://[userinfo@]rest, up to whitespace or a quote.
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>]+)")
# Query parameters whose values are credentials (presigned URLs, tokens).
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&](?:[A-Za-z0-9_\-]*(?:token|signature|secret|password|passwd|"
    r"credential|key|sig|auth)[A-Za-z0-9_\-]*)=)(?P<value>[^&#\s]*)",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """True for an environment variable named like a credential."""
    return bool(_SECRET_NAME.search(name))


def url_credentials(text: str) -> bool:
    """True when `text` is (or contains) a URL with a user name or password."""
    for m in _URL.finditer(text):
        netloc = m.group("rest").split("/", 1)[0]
        if "@" in netloc:
            return True
    return False


def _redact_url(m: re.Match[str]) -> str:
    rest = m.group("rest")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    rest = _SECRET_PARAM.sub(lambda p: p.group("key") + MASK, netloc + slash + path)
    return m.group("scheme") + rest


def redact(text: str) -> str:
    """`text` with every URL's credentials (user:password@, secret query
    parameters) replaced by `***`."""
    if "://" not in text:
        return text
    return _URL.sub(_redact_url, text)


def shareable_env(env: Mapping[str, str], also_secret: Iterable[str] = ()) -> dict[str, str]:
    """The variables of `env` that are not secrets: no credential names, no values
    with URL credentials, none named in `also_secret`."""
    extra = set(also_secret)
    return {
        k: v
        for k, v in env.items()
        if k not in extra and not is_secret_name(k) and not url_credentials(v)
    }
