"""loragw adapters package (built by a later issue)."""
