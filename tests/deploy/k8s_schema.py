"""Offline validation of rendered Kubernetes objects against the API's own
schemas, as the official `kubernetes` Python client generates them.

kubectl cannot validate without a cluster (`apply --dry-run=client` fetches
the OpenAPI document from the API server), and kubeconform downloads its
schemas. The client's models are generated from the same OpenAPI document
and are pydantic models that forbid unknown fields, check types strictly and
require what the API requires, so validating a document by its JSON names
(the aliases) is a schema check that needs no network.
"""

from __future__ import annotations

import kubernetes.client
from pydantic import BaseModel, ValidationError

__all__ = ["ValidationError", "model_for", "validate"]


def model_for(api_version: str, kind: str) -> type[BaseModel] | None:
    """The client's model of a built-in kind (`apps/v1` + `Deployment` ->
    V1Deployment); None for kinds it does not know (custom resources)."""
    version = api_version.rsplit("/", 1)[-1]
    model = getattr(kubernetes.client, version[:1].upper() + version[1:] + kind, None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return None


def validate(doc: dict) -> BaseModel:
    """Raise ValidationError naming each unknown field, wrong type or missing
    required field of `doc`; KeyError for a kind the client does not know."""
    model = model_for(doc["apiVersion"], doc["kind"])
    if model is None:
        raise KeyError(f"no schema for {doc['apiVersion']} {doc['kind']}")
    # By the JSON names only: `liveness_probe` is not a field of a container.
    return model.model_validate(doc, by_alias=True, by_name=False)
