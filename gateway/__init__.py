"""loragw gateway package: the HTTP front of the engine (docs/gateway.md)."""
