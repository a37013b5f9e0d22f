"""Object stores: ``s3://`` (AWS S3 and the stores that speak its API: R2, MinIO, Ceph,
SeaweedFS...) and ``gs://`` (Google Cloud Storage's XML API, with HMAC keys).

They are reached by the fetcher's own aiohttp session, as any URL is; this module only
says which https URL an object has and signs each request. botocore (``stoker[s3]``)
gives the SigV4 signer and the usual credential chain (environment, ``AWS_PROFILE``,
config and credentials files, SSO, instance and container roles, credentials that
refresh themselves); it never sends a request of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Any

from stoker.errors import ShardFormatError, StokerError, UsageError, clip, located, quoted

log = logging.getLogger("stoker.remote")

STORE_SCHEMES = ("s3://", "gs://")
_LOOK_AGAIN = 60.0  # seconds before credentials that were not found are looked for again
GCS_ENDPOINT = "https://storage.googleapis.com"

#: What a store's error code means, in words a user can act on.
_EXPLAINED = {
    "SignatureDoesNotMatch": "signature does not match: check the secret key and the region",
    "InvalidAccessKeyId": "the store does not know this access key id: check the credentials",
    "AccessDenied": "access denied (without list permission a store also says this of a "
    "key that does not exist)",
    "AllAccessDisabled": "access to this bucket is disabled",
    "NoSuchKey": "no such key",
    "NoSuchBucket": "no such bucket",
    "ExpiredToken": "the session token has expired: renew the credentials",
    "TokenRefreshRequired": "the session token has expired: renew the credentials",
    "InvalidToken": "the session token is not valid",
    "RequestTimeTooSkewed": "this machine's clock is too far from the store's: set the clock",
    "AuthorizationHeaderMalformed": "wrong region for this bucket",
    "PermanentRedirect": "the bucket is in another region or behind another endpoint",
    "InvalidObjectState": "the object is archived: restore it before reading",
    "RequestHasExpired": "the signed URL has expired",
    "PreconditionFailed": "the object changed since the dataset was opened: open it again",
}

#: Codes that say the credentials or the clock are wrong: every other request would fail
#: the same way, so they are never retried and never taken for "no manifest here".
AUTH_CODES = frozenset(
    {
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidToken",
        "RequestTimeTooSkewed",
        "AuthorizationHeaderMalformed",
    }
)

#: Codes that mean "slow down", whatever the status that carries them.
THROTTLE_CODES = frozenset({"SlowDown", "RequestLimitExceeded", "Throttling", "TooManyRequests"})


_HOSTLIKE = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


def is_object_url(text: str) -> bool:
    return text.startswith(STORE_SCHEMES)


@dataclass(frozen=True)
class ObjectName:
    """``s3://bucket/key`` taken apart."""

    scheme: str  # "s3" or "gs"
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectName:
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise UsageError(f"{url}: no bucket (an object URL is {scheme}://BUCKET/KEY)")
        return cls(scheme, bucket, key)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"


def store_error(status: int, body: bytes) -> tuple[str | None, str]:
    """The error code and words of a store's XML error body (``<Error><Code>``), or
    (None, "") when the body is not one."""
    text = body.lstrip()
    if not text.startswith(b"<"):
        return None, ""
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError:
        return None, ""
    # S3 answers <Error>; some stores put it in a namespace.
    fields = {child.tag.rsplit("}", 1)[-1]: (child.text or "").strip() for child in root}
    code = fields.get("Code") or None
    message = fields.get("Message", "")
    if code is None:
        return None, ""
    words = _EXPLAINED.get(code)
    if code == "AuthorizationHeaderMalformed" and fields.get("Region"):
        words = f"wrong region for this bucket: it is in {fields['Region']}"
    if code == "AccessDenied" and "expired" in message.lower():
        words = _EXPLAINED["RequestHasExpired"]
    if words is None:
        words = f"{code}: {clip(message, 160)}" if message else code
    return code, words


def _encode(text: str, safe: str = "") -> str:
    # SigV4's canonical form: every byte but A-Z a-z 0-9 - _ . ~ percent-encoded. The
    # URL is sent exactly as signed (aiohttp is told not to encode it again).
    return urllib.parse.quote(text, safe=safe)


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


def _botocore() -> Any:
    try:
        import botocore.auth
        import botocore.awsrequest
        import botocore.credentials
        import botocore.exceptions
        import botocore.session
    except ImportError:
        raise UsageError(
            "s3:// and gs:// sources need botocore to sign their requests: pip install 'stoker[s3]'"
        ) from None
    return botocore


class ObjectStore:
    """One kind of store (``s3`` or ``gs``) as this process reaches it: its endpoint, its
    region, how a bucket is addressed, and the credentials requests are signed with."""

    def __init__(self, scheme: str, options: Any) -> None:
        self.scheme = scheme
        self.unsigned = bool(options.unsigned)
        self.requester_pays = bool(options.requester_pays) and scheme == "s3"
        self.profile = options.profile
        if not self.unsigned:
            _botocore()  # said now, not from the event loop
        if scheme == "gs":
            endpoint = options.gs_endpoint_url or GCS_ENDPOINT
            self.region = "auto"  # what GCS takes in a SigV4 scope
        else:
            endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")
            endpoint = options.endpoint_url or endpoint
            self.region = (
                options.region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or self._profile_region()
            )
        self.custom = endpoint is not None
        if endpoint is None:
            endpoint = f"https://s3.{self.region}.amazonaws.com"
        if "://" not in endpoint:
            endpoint = "https://" + endpoint
        scheme, _, rest = endpoint.rstrip("/").partition("://")
        host, slash, path = rest.partition("/")
        # The signer puts the host in lower case; what is sent must say the same.
        self.endpoint = f"{scheme.lower()}://{host.lower()}{slash}{path}"
        self._credentials: Any = None
        self._found = False
        self._found_at = 0.0
        self._warned = False
        self._lock = threading.Lock()

    def _profile_region(self) -> str:
        try:
            session = _botocore().session.Session(profile=self.profile)
            return session.get_config_variable("region") or "us-east-1"
        except Exception:  # no botocore (unsigned), or a profile that is not there: said later
            return "us-east-1"

    # -- addresses -----------------------------------------------------------------------

    def url_of(self, name: ObjectName, query: dict[str, str] | None = None) -> str:
        """The https URL of an object (or, with an empty key and a query, of a bucket
        request), percent-encoded once: what is signed is what is sent."""
        key = _encode(name.key, safe="/~")
        # AWS itself: the bucket in the host name, except names that are no host name's
        # part (dots: their TLS certificate would not match; capitals, underscores). Every
        # other endpoint: the bucket in the path.
        if self.custom or not _HOSTLIKE.fullmatch(name.bucket):
            url = f"{self.endpoint}/{_encode(name.bucket)}/{key}"
        else:
            scheme, _, host = self.endpoint.partition("://")
            url = f"{scheme}://{name.bucket}.{host}/{key}"
        if query:
            url += "?" + "&".join(f"{_encode(k)}={_encode(v)}" for k, v in sorted(query.items()))
        return url

    # -- signing -------------------------------------------------------------------------

    def _stale(self) -> bool:
        """Whether the credentials are to be looked up (again): never yet, or none found
        a while ago (a metadata service that did not answer in time may answer now)."""
        if not self._found:
            return True
        return (
            self._credentials is None
            and not self.unsigned
            and time.monotonic() - self._found_at > _LOOK_AGAIN
        )

    def credentials(self) -> Any:
        """The credentials the chain finds (looked up once, or again a minute after none
        were: the chain may ask an instance metadata service); None to send requests
        unsigned."""
        with self._lock:
            if self._stale():
                self._credentials = self._find_credentials()
                self._found, self._found_at = True, time.monotonic()
            return self._credentials

    def _find_credentials(self) -> Any:
        if self.unsigned:
            return None
        botocore = _botocore()
        found = None
        if self.scheme == "gs":
            # HMAC keys of their own, or a profile named for them; never the AWS keys
            # meant for s3:// (a public GCS bucket would refuse them).
            key, secret = _env("GS_ACCESS_KEY_ID"), _env("GS_SECRET_ACCESS_KEY")
            if key and secret:
                return botocore.credentials.Credentials(key, secret)
        if self.scheme == "s3" or self.profile:
            try:
                found = botocore.session.Session(profile=self.profile).get_credentials()
            except botocore.exceptions.ProfileNotFound as e:
                raise UsageError(f"{e} (FetchOptions(profile=...) or AWS_PROFILE)") from None
            except Exception as e:  # SSO, STS, a credential_process: their own errors
                raise StokerError(
                    f"cannot load credentials: {type(e).__name__}: {clip(str(e))}"
                ) from None
        if found is None and not self._warned:
            self._warned = True
            where = (
                "GS_ACCESS_KEY_ID / GS_SECRET_ACCESS_KEY, or FetchOptions(profile=...)"
                if self.scheme == "gs"
                else "environment, AWS_PROFILE, config files, SSO, instance role"
            )
            log.warning(
                "%s:// no credentials found (%s): requests go unsigned, as to a public bucket",
                self.scheme,
                where,
            )
        return found

    async def sign(
        self, method: str, url: str, headers: dict[str, str], body: Any = None
    ) -> dict[str, str]:
        """`headers` plus the store's: SigV4 authorization (unless unsigned) and
        requester-pays. `body`: a PUT's open file, whose sha256 the signature holds (read
        through here, off the event loop, and put back at its start)."""
        headers = dict(headers)
        if self.requester_pays:
            headers["x-amz-request-payer"] = "requester"
        loop = asyncio.get_running_loop()
        found = self._credentials
        if self._stale():
            found = await loop.run_in_executor(None, self.credentials)
        if found is None:
            return headers
        botocore = _botocore()
        try:
            if isinstance(found, botocore.credentials.RefreshableCredentials):
                # A refresh may ask STS, SSO or a metadata service: not on the event loop.
                frozen = await loop.run_in_executor(None, found.get_frozen_credentials)
            else:
                frozen = found.get_frozen_credentials()
            request = botocore.awsrequest.AWSRequest(
                method=method, url=url, headers=headers, data=body
            )
            signer = botocore.auth.S3SigV4Auth(frozen, "s3", self.region)
            if body is None:
                signer.add_auth(request)
            else:
                await loop.run_in_executor(None, signer.add_auth, request)
        except Exception as e:  # an expired SSO token, a failing credential_process...
            raise StokerError(
                f"cannot sign the request: {type(e).__name__}: {clip(str(e))}"
            ) from None
        return dict(request.headers.items())

    # -- listing -------------------------------------------------------------------------

    def list_request(self, name: ObjectName, token: str | None) -> str:
        """The URL of one page of a ListObjectsV2 listing of the keys under `name.key`."""
        query = {"list-type": "2", "prefix": name.key}
        if token:
            query["continuation-token"] = token
        return self.url_of(ObjectName(name.scheme, name.bucket, ""), query)


def parse_listing(body: bytes, where: str) -> tuple[list[tuple[str, int, str | None]], str | None]:
    """One ListObjectsV2 page: (key, size, ETag) of each object, and the token of the next
    page (None on the last)."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as e:
        raise located(ShardFormatError, where, 0, f"the listing is not XML: {e}") from None
    ns = re.match(r"\{[^}]*\}", root.tag)
    prefix = ns.group(0) if ns else ""
    objects = []
    for item in root.iter(prefix + "Contents"):
        key = item.findtext(prefix + "Key")
        size = item.findtext(prefix + "Size")
        if key is None or size is None:
            continue
        try:
            objects.append((key, int(size), item.findtext(prefix + "ETag")))
        except ValueError:
            raise located(
                ShardFormatError, where, 0, f"the listing gives {quoted(size)} as a size"
            ) from None
    truncated = (root.findtext(prefix + "IsTruncated") or "").strip().lower() == "true"
    token = root.findtext(prefix + "NextContinuationToken") if truncated else None
    if truncated and not token:  # (a repeated token is caught by the caller)
        raise located(
            ShardFormatError, where, 0, "the listing is cut short but gives no continuation token"
        )
    return objects, token


#: The signing schemes of presigned URLs: a parameter whose presence says the URL is signed
#: that way, and the parameters that scheme adds (all of them sign, none names the object).
_SIGNED_BY = [
    ("x-amz-signature", re.compile(r"x-amz-.*")),  # S3 SigV4
    ("x-goog-signature", re.compile(r"x-goog-.*")),  # GCS V4
    ("awsaccesskeyid", re.compile(r"awsaccesskeyid|signature|expires|x-amz-security-token")),
    ("googleaccessid", re.compile(r"googleaccessid|signature|expires")),
    ("key-pair-id", re.compile(r"key-pair-id|signature|expires|policy")),  # CloudFront
    # Azure SAS: `sig`, with the token's other fields.
    (
        "sig",
        re.compile(r"sig|sv|ss|srt|sp|se|st|spr|sip|si|sr|sdd|ses|skoid|sktid|skt|ske|sks|skv"),
    ),
]


def without_signature(url: str) -> str:
    """`url` less the query parameters that sign it, where it is recognisably signed (a
    presigned S3 or GCS URL, an Azure SAS, a CloudFront signed URL): what names the object,
    for the cache. A query that is not a signature is kept whole."""
    if "?" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    if not parts.query:
        return url
    pairs = [p for p in parts.query.split("&") if p]
    names = [urllib.parse.unquote(p.partition("=")[0]).lower() for p in pairs]
    for marker, signing in _SIGNED_BY:
        if marker in names:
            kept = [p for p, n in zip(pairs, names) if not signing.fullmatch(n)]
            return urllib.parse.urlunsplit(parts._replace(query="&".join(kept)))
    return url
