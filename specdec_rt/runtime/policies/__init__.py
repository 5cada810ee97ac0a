"""How much to draft: the adaptive draft length of chains (:mod:`.adaptive`), tree shapes and
their policy (:mod:`.tree_shapes`, :mod:`.tree`), and the measured cost model they decide from
(:mod:`.cost_model`).

May import ``engines`` (to measure them) and ``core``; never ``drafters``, ``loop`` or ``api``.
"""
