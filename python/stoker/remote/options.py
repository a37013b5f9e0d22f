"""How remote shards are fetched: the options a dataset is opened with, which every
layer of the fetch path reads (the transport, the retries, the downloads, the cache)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchOptions:
    """How remote shards are fetched: ``stoker.Dataset(url, fetch=FetchOptions(...))``.
    The defaults suit a data-centre link.

    Connection errors, 5xx, 408, 429, stalls and short bodies are retried with
    exponential backoff and full jitter; a broken body resumes with a ``Range`` request
    where the server takes ranges. Other 4xx fail at once.

    Args:
        connections: Transfers at once, per process.
        retries: Attempts after the first, per transfer.
        backoff: The first retry's delay in seconds; doubled at each retry, and drawn
            uniformly below that (full jitter).
        max_backoff: The longest delay between retries, in seconds.
        max_retry_after: A server's ``Retry-After`` is honoured up to this many seconds.
        stall_timeout: Seconds without a byte after which a transfer is retried.
        connect_timeout: Seconds to wait for a connection.
        max_redirects: Redirects followed, to http(s) URLs only.
        allow_insecure_redirects: Follow a redirect from https to plain http (refused by
            default, with a FetchError naming both URLs).
        cache_wait: Seconds to wait for room in a full cache before failing.
        endpoint_url: ``s3://``: the store's endpoint (R2, MinIO, Ceph, SeaweedFS...);
            else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or ``S3_ENDPOINT_URL``,
            else AWS. A custom endpoint is addressed path-style.
        region: ``s3://``: the region; else ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the
            profile's, else ``us-east-1``.
        profile: The botocore profile to take credentials from (else ``AWS_PROFILE``);
            for ``gs://``, the profile whose HMAC keys sign when ``GS_ACCESS_KEY_ID`` /
            ``GS_SECRET_ACCESS_KEY`` are not set.
        unsigned: Send requests without credentials (public buckets).
        requester_pays: Ask for requester-pays buckets' objects (the requester is
            billed).
        gs_endpoint_url: ``gs://``: the endpoint of Google Cloud Storage's XML API, by
            default ``https://storage.googleapis.com``.
    """

    connections: int = 16  # transfers at once, per process
    retries: int = 6  # attempts after the first, per transfer
    backoff: float = 0.25  # first retry's delay (s); doubled each time, with full jitter
    max_backoff: float = 20.0
    max_retry_after: float = 120.0  # a server's Retry-After is honoured up to this (s)
    stall_timeout: float = 30.0  # no byte for this long: the transfer is retried
    connect_timeout: float = 10.0
    max_redirects: int = 5
    # A redirect from https to plain http is refused unless this is set: what the http
    # answer says (sizes, bytes) could come from anyone on the path.
    allow_insecure_redirects: bool = False
    cache_wait: float = 600.0  # how long to wait for room in a full cache before failing
    # Object stores. s3://: the endpoint (else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    # S3_ENDPOINT_URL, else AWS itself), the region (else AWS_REGION, AWS_DEFAULT_REGION,
    # the profile's), the botocore profile (else AWS_PROFILE). gs://: the endpoint (else
    # storage.googleapis.com). unsigned: no credentials (public buckets).
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    unsigned: bool = False
    requester_pays: bool = False
    gs_endpoint_url: str | None = None
