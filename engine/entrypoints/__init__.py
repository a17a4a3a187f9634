"""The command lines over the engine: ``generate``, ``diff``, ``bench`` (``python -m engine.X``).

Their engine flags come from ``EngineConfig`` through ``engine_args``; what they share besides
(the one-line-error parser, the seed's prompts, the stats table) is in ``cli_utils``.
"""
