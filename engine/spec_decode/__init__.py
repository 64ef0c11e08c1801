"""Speculative decoding: n-gram drafts (ngram.py), which requests and steps
speculate and how far (policy.py), and the verification of drafts against
the target model's samples (verify.py). All pure Python; the runner does
the tensor work."""
