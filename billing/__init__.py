"""loragw billing package (built by a later issue)."""
