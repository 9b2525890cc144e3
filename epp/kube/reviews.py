"""Who a bearer token is and what it may do, as the Kubernetes API says: `TokenReview` and
`SubjectAccessReview` (`authentication.k8s.io/v1`, `authorization.k8s.io/v1`).

The picker's own credentials make the calls, so its ServiceAccount needs `create` on
`tokenreviews` and `subjectaccessreviews` (a ClusterRole: both are cluster-scoped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

_decode = msgspec.json.Decoder().decode


class ReviewError(Exception):
    """The API server could not answer a review (unreachable, forbidden to the picker, malformed reply)."""


@dataclass(frozen=True)
class UserInfo:
    """An authenticated user as TokenReview names it: what SubjectAccessReview is then asked about."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def from_status(cls, user: Mapping[str, Any]) -> UserInfo:
        """From a TokenReview's `status.user`."""
        extra = user.get("extra") or {}
        return cls(username=str(user.get("username") or ""), uid=str(user.get("uid") or ""),
                   groups=tuple(str(g) for g in user.get("groups") or ()),
                   extra=tuple(sorted((str(k), tuple(str(v) for v in vs or ())) for k, vs in extra.items())))


@dataclass(frozen=True)
class AccessDecision:
    """A SubjectAccessReview's answer: allowed or not, and the reason the authorizer gave."""

    allowed: bool
    reason: str = ""


class KubernetesReviews:
    """TokenReview and SubjectAccessReview calls through an API client (`epp.kube.client.load_api_client`)."""

    def __init__(self, api_client: Any, *, timeout_s: float = 10.0) -> None:
        from kubernetes_asyncio import client

        self.api_client = api_client
        self.timeout_s = timeout_s
        self._authn = client.AuthenticationV1Api(api_client)
        self._authz = client.AuthorizationV1Api(api_client)

    async def _post(self, call: Any, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            response = await call(body, _preload_content=False, _request_timeout=self.timeout_s)
            try:
                raw = await response.read()
            finally:
                response.release()
        except Exception as exc:  # connection refused, timeout, TLS: the API did not answer
            raise ReviewError(f"{what}: {type(exc).__name__}: {exc}") from None
        if response.status not in (200, 201):
            raise ReviewError(f"{what}: HTTP {response.status} from the API server")
        try:
            document = _decode(raw)
        except msgspec.DecodeError:
            raise ReviewError(f"{what}: the API server's answer is not JSON") from None
        if not isinstance(document, dict):
            raise ReviewError(f"{what}: the API server's answer is not an object")
        return document

    async def authenticate(self, token: str) -> UserInfo | None:
        """The user a bearer token belongs to, or None when the API does not accept the token."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        status = (await self._post(self._authn.create_token_review, body, "TokenReview")).get("status") or {}
        if status.get("authenticated") is not True:
            return None
        return UserInfo.from_status(status.get("user") or {})

    async def authorize(self, user: UserInfo, verb: str, path: str) -> AccessDecision:
        """Whether `user` may `verb` the non-resource URL `path` (as `get` on `/metrics`)."""
        spec: dict[str, Any] = {"user": user.username, "groups": list(user.groups),
                                "nonResourceAttributes": {"path": path, "verb": verb}}
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {k: list(v) for k, v in user.extra}
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
        status = (await self._post(self._authz.create_subject_access_review, body,
                                   "SubjectAccessReview")).get("status") or {}
        return AccessDecision(allowed=status.get("allowed") is True and status.get("denied") is not True,
                              reason=str(status.get("reason") or ""))

    async def close(self) -> None:
        """Close the API client's connections."""
        await self.api_client.close()
