"""Pydantic request and response schemas of the HTTP APIs (apart from the
database models in `gateway.store.models`)."""
