"""HTTP routes, one module per resource; each exposes `routes()`."""
