"""Connectors: thin adapters from ecosystems users already have onto milepost's plug-in layers.

Each lives behind a pip extra (`milepost[math]`, `milepost[reasoning-gym]`) and imports its package
only when used, naming the extra when it is missing (docs/environments.md).
"""
