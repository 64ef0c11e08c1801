"""loragw gateway package (built by a later issue)."""
