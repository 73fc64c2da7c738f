"""Multi-turn environments (--env-path): see docs/DESIGN.md, "Multi-turn environments".

  plugin.py      the contract (reset/step), EnvState, loading, calling it
  pool.py        EnvPool: env calls on the reward pool's workers
  trajectory.py  flat trajectory arrays: sampled turns + observation tokens, the mask
  driver.py      the multi-turn rollout
"""
