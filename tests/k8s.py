"""Kubernetes manifest checks shared by the launch and serving tests."""

from __future__ import annotations

import json


def validated(obj: dict, kind: str) -> dict:
    """The object as the official client's model reads it, serialized back: keys the API does
    not know are dropped, and required fields are enforced."""
    from kubernetes.client import ApiClient

    class Response:
        data = json.dumps(obj)

    api = ApiClient()
    return api.sanitize_for_serialization(api.deserialize(Response(), kind))
