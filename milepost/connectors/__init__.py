"""Connectors: thin adapters from ecosystems users already have onto milepost's plug-in layers.

Each lives behind a pip extra (`milepost[math]`, `[reasoning-gym]`, `[verifiers]`, `[openenv]`,
`[strands]`) and imports its package only when used, naming the extra when it is missing.
`episodes.py` is what they share: a bad environment fails its episode, not the run
(docs/environments.md).
"""
