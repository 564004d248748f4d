"""Amazon S3 and S3-compatible servers (MinIO, Ceph, moto's) as a backend:
`s3://bucket/prefix` (also `s3a://`).

The endpoint of an S3-compatible server comes from AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL, the region from AWS_REGION / AWS_DEFAULT_REGION (only a
signing parameter with an endpoint override: S3-compatible servers take the
SDK's default one). Credentials are never part of a location: the AWS SDK reads
them from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_PROFILE) or the node's instance role.
"""

from __future__ import annotations

import functools
import os
from typing import Any
from urllib.parse import urlsplit

from trainlab.errors import UserError
from trainlab.location.core import Backend
from trainlab.location.errors import Conflict
from trainlab.redact import redact

ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_ENV_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
DEFAULT_REGION = "us-east-1"
SETTINGS_ENV_VARS = (*ENDPOINT_ENV_VARS, *REGION_ENV_VARS)
SCHEMES = ("s3", "s3a")
CREDENTIALS_HINT = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role)"


def s3_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint override: the argument, else AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL."""
    if endpoint_url:
        return endpoint_url
    return next((os.environ[v] for v in ENDPOINT_ENV_VARS if os.environ.get(v)), None)


class S3(Backend):
    scheme = "s3"
    settings_hint = "the AWS_* variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"

    def __init__(self, endpoint_url: str | None):
        self.endpoint_url = endpoint_url

    def make_filesystem(self) -> Any:
        from pyarrow import fs

        region = next((os.environ[v] for v in REGION_ENV_VARS if os.environ.get(v)), None)
        kwargs: dict[str, Any] = {"region": region or DEFAULT_REGION}
        if self.endpoint_url:
            ep = urlsplit(self.endpoint_url)
            kwargs.update(endpoint_override=ep.netloc, scheme=ep.scheme)
        return fs.S3FileSystem(**kwargs)

    def describe(self) -> str:
        return f"endpoint {redact(self.endpoint_url)}" if self.endpoint_url else ""

    # Conditional writes: S3's If-None-Match / If-Match on PUT (AWS since 2024,
    # MinIO, moto), through boto3, since pyarrow's filesystem has none.
    conditional = True

    @functools.cached_property
    def client(self) -> Any:
        import boto3

        region = next((os.environ[v] for v in REGION_ENV_VARS if os.environ.get(v)), None)
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=region or DEFAULT_REGION
        )

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        bucket, _, key = path.partition("/")
        try:
            got = self.client.get_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return got["Body"].read(), str(got["ETag"])

    def write_if(self, path: str, data: bytes, version: str | None) -> str:
        from botocore.exceptions import ClientError

        bucket, _, key = path.partition("/")
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            put = self.client.put_object(Bucket=bucket, Key=key, Body=data, **condition)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412):  # PreconditionFailed; 409: a concurrent conditional write
                raise Conflict(f"{self.uri(path)}: written by another writer first") from e
            raise
        return str(put["ETag"])


def backend(endpoint_url: str | None = None) -> S3:
    """The S3 backend for this process's settings (one per endpoint)."""
    endpoint = s3_endpoint(endpoint_url)
    if endpoint:
        ep = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if ep.scheme not in ("http", "https") or not ep.netloc:
            raise UserError(f"S3 endpoint {redact(endpoint)!r}: expected http(s)://host:port")
        endpoint = f"{ep.scheme}://{ep.netloc}"
    return _backend(endpoint)


_BACKENDS: dict[str | None, S3] = {}


def _backend(endpoint: str | None) -> S3:
    if endpoint not in _BACKENDS:
        _BACKENDS[endpoint] = S3(endpoint)
    return _BACKENDS[endpoint]
