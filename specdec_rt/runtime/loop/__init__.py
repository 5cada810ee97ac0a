"""The decoding loop: the speculative step (draft, verify, accept, commit) that chains, trees,
batches and overlap share, rows in batch sessions, the tree step, the requests the loop runs
(validated once where they enter), the per-request choice of drafter and the policy store a
generator keeps across generations.

May import ``drafters``, ``policies``, ``engines`` and ``core``; never ``api``.
"""
