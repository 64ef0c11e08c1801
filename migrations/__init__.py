"""loragw migrations package (built by a later issue)."""
