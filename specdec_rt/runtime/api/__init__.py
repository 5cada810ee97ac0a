"""The public API: :class:`~specdec_rt.runtime.api.generator.Generator` and ``load`` (what
``specdec_rt.load`` returns), chat templates, the checks a prompt passes before it reaches an
engine, and the warm-up a server runs at load.

May import every other runtime sub-package (``loop``, ``drafters``, ``policies``, ``engines``,
``core``); nothing in the runtime imports it back.
"""
