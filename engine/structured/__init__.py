"""Structured output: decoding constrained to a JSON schema, a regex, a
choice or a grammar, enforced at the logits with llguidance.

`spec` is the plain value a request carries; `grammar` compiles and caches
specs; `runtime` is the sampler stage that masks logits and advances each
sequence's grammar state. Only `spec` is part of the torch-free core.
"""
