"""Programs built on loragw's parts (`make demo-adapters`); not installed."""
