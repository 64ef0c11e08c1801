"""loragw billing package: meter, spool, ledger and exports (docs/billing.md)."""
