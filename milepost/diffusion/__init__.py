"""Diffusion RL (report section 6, "Miles-Diffusion"): a flow-matching rollout engine that records
denoising trajectories, objectives that re-score a subset of steps (Flow-GRPO, DiffusionNFT, SFT),
and weights back to the engine. `docs/diffusion.md` describes the pieces and their limits.
"""
