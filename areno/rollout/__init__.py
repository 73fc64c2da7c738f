"""Rollout engines and the flat RolloutBatch layout they produce."""
